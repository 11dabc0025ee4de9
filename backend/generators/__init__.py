"""Rollout generators and the one weight transport they share.

- ``transport``: a Hugging Face weight stream packed into byte buckets cut from its metadata alone
  (names, dtypes, shapes), broadcast over a gloo group: the generator process and the vLLM
  servers receive the same buckets.
- ``vllm_server``: vLLM OpenAI-compatible servers (started by the loop, or given by URL) as the
  RL loop's generator, fed through vLLM's weight-transfer API.
- ``vllm_engine``: the transfer engine a vLLM server's workers run (registered in the worker).
- ``hf``: transformers in the trainer's process; ``vllm_local``: vLLM in the trainer's process;
  ``process``: a transformers generator in a process of its own (the asynchronous loop's).
- ``base``: the interface all of them keep (``Generator``, ``Sampler``, ``Probed``, ``Queued``).

The older paths (``backend.rl.generate``, ``backend.rl.vllm_generator``,
``backend.rl.remote_generator``) stay importable as the same modules.

Nothing here imports the trainer: the worker-side engine runs inside vLLM's processes.
"""
