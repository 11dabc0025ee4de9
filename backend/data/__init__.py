"""Datasets (.bin/.idx, JSONL, embedded), tokenizers, the window sampler and the data iterator."""
