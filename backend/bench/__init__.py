"""Benchmark and comparison machinery used by tools/ and tests, never by training itself.

``length_sets`` (synthetic and real sequence-length sets), ``train_bench`` (arms on the same
windows with a calibrated cost model), ``compare`` (fixed versus dynamic arms as real torchrun
runs), ``memory`` (the CPU saved-activation meter).
"""
