"""Hugging Face import and export: config translation, weight mapping, safetensors I/O, chat data.

Each module does one job and none imports training code, so tools (export, log-probabilities) and
the model factory can use them alone:

- ``rope``: inverse frequencies for default, linear, Llama 3 and YaRN RoPE (as transformers).
- ``config``: a HF ``config.json`` -> our model fields, refusing what we cannot express.
- ``mapping``: parameter names and tensor layouts, HF <-> megatron-core GPTModel (local spec).
- ``safetensors_io``: lazy per-tensor reads and a sharded writer.
- ``export``: our fields and tensors -> a HF directory's config.json and tensors.
- ``chat``: chat-template rendering with an assistant-only loss mask.
"""
