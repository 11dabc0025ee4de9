"""Hugging Face import and export: weight mapping, RoPE scaling, safetensors I/O, export, loading.

Each module does one job and none imports training code, so tools (export, log-probabilities) and
the model factory can use them alone:

- ``rope``: inverse frequencies for default, linear, Llama 3 and YaRN RoPE (as transformers).
- (``backend.config.hf``: a HF ``config.json`` -> our model fields, refusing what we cannot
  express; it lives with the config because the config loader resolves ``model.hf_checkpoint``.)
- ``mapping``: parameter names and tensor layouts, HF <-> megatron-core GPTModel (local spec).
- ``safetensors_io``: lazy per-tensor reads and a sharded writer.
- ``export``: our fields and tensors -> a HF directory's config.json and tensors.
- ``load``: fill a built (FSDP2-sharded) model from the safetensors, one parameter at a time.

Chat data (``backend.data.chat``) renders conversations with a checkpoint's chat template.
"""
