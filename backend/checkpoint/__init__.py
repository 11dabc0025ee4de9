"""Checkpoints: what a checkpoint is and what it may do to us.

The format and atomic writing (``store``), safe reading (``safe_dcp``: DCP's pickled metadata
through a bounded, restricted unpickler, ``bounded_pickle``; regular files only, ``files``;
validated ``meta.json``, ``meta``), the resume policy (``resume``, ``resume_policy``), the
run-directory lock (``run_lock``), the metrics rewind after a restart (``metrics_rewind``) and
the export of a checkpoint as a Hugging Face directory (``hf_export``). Nothing here imports the
trainer: ``backend.train`` uses this package, never the reverse.
"""
