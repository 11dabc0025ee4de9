"""A vLLM engine in the trainer's process, fed by the same Hugging Face weight stream.

The optional extra ``vllm`` (CUDA only). Same interface as ``generate.HFGenerator``:
``load_weights(pairs)``, ``generate(prompt_ids, n, temperature, max_new_tokens, seed)`` and
``generate_batch(prompts, n, temperature, max_new_tokens, seeds)``.

- Start: vLLM needs a model directory to build its model class, so the policy's config.json
  (``PolicyWorker.hf_config``; no weights) is written to a temporary directory and the engine
  starts with ``load_format="dummy"`` (random weights, never read from disk), its tokenizer
  skipped (prompts and responses are token ids).
- Weights: vLLM's weight-update contract, ``model.load_weights(weights=[(hf_name, full tensor),
  ...])``, which fuses q/k/v and gate/up itself and shards for tensor parallelism; reached with
  ``LLM.apply_model`` (a function run on each worker's model), in buckets of about
  ``bucket_bytes`` so one call never holds a second copy of the model. The prefix cache is reset
  after an update (its KV was computed by the old weights).
- Sampling: ``SamplingParams(n, temperature, max_tokens, seed, logprobs=0, top_k/top_p off)``;
  ``logprobs_mode="processed_logprobs"`` makes the returned log-probability of each sampled
  token the one after temperature: what the sampler saw (``rollout_logprobs``).

References: vLLM's ``examples/offline_inference/rlhf_utils.py`` (``update_weight`` calls
``model_runner.model.load_weights``) and ``docs/training/weight_transfer``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .generate import Completion, SyncStats


class VLLMGenerator:
    def __init__(
        self,
        hf_config: dict,
        *,
        stop_token_ids: Sequence[int] = (),
        vocab_limit: int | None = None,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.3,
        bucket_bytes: int = 512 * 2**20,
        **engine_kwargs,
    ):
        try:
            from vllm import LLM
        except ImportError as e:  # an optional extra: say how to get it
            raise ImportError(
                f"rl.generator=vllm needs vLLM (pip install 'dynbatch-backend[vllm]' on a CUDA machine): {e}"
            ) from e
        self._dir = tempfile.TemporaryDirectory(prefix="vllm_config_")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
        self.llm = LLM(
            model=self._dir.name,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            **engine_kwargs,
        )
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.bucket_bytes = bucket_bytes
        # ids past the tokenizer's vocabulary (padding rows) are never sampled, as in HFGenerator
        self.allowed = list(range(vocab_limit)) if vocab_limit and vocab_limit < hf_config["vocab_size"] else None

    @classmethod
    def from_worker(cls, worker, **kwargs) -> VLLMGenerator:
        return cls(worker.hf_config(torch.bfloat16), vocab_limit=worker.tokenizer.vocab_size, **kwargs)

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        def load(model):
            model.load_weights(weights=pairs)

        self.llm.apply_model(load)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> SyncStats:
        start = time.perf_counter()
        bucket: list[tuple[str, torch.Tensor]] = []
        held = count = size = 0
        for name, tensor in weights:
            bucket.append((name, tensor))
            held += tensor.numel() * tensor.element_size()
            count += 1
            size += tensor.numel() * tensor.element_size()
            if held >= self.bucket_bytes:
                self._load(bucket)
                bucket, held = [], 0
        if bucket:
            self._load(bucket)
        self.llm.reset_prefix_cache()
        return SyncStats(count, size, time.perf_counter() - start)

    def _params(self, n: int, temperature: float, max_new_tokens: int, seed: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=1.0,
            top_k=-1,
            max_tokens=max_new_tokens,
            seed=int(seed),
            logprobs=0,
            stop_token_ids=self.stop_token_ids,
            detokenize=False,
            allowed_token_ids=self.allowed,
        )

    def generate(
        self, prompt_ids: Sequence[int], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[Completion]:
        return self.generate_batch([prompt_ids], n, temperature, max_new_tokens, [seed])[0]

    def generate_batch(
        self, prompts: Sequence[Sequence[int]], n: int, temperature: float, max_new_tokens: int, seeds: Sequence[int]
    ) -> list[list[Completion]]:
        """Every prompt in one ``LLM.generate`` call (vLLM schedules them together), each request
        with its own seed, as ``HFGenerator.generate_batch``."""
        if not prompts:
            return []
        params = [self._params(n, temperature, max_new_tokens, s) for s in seeds]
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        batches = []
        for out in outs:
            completions = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
                completions.append(Completion(ids, lps, stopped=o.finish_reason == "stop"))
            batches.append(completions)
        return batches
