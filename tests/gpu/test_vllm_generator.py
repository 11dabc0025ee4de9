"""The vLLM generator (``rl.generator=vllm``) on a CUDA device: the worker's weight stream loaded
through vLLM's ``load_weights`` gives vLLM the policy's log-probabilities. Skips with its reason
without CUDA or without the ``vllm`` extra; the CPU path it mirrors (``HFGenerator`` on the same
stream) is tested in tests/unit/test_rl_generate.py."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from tests.conftest import TINY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra (pip install .[vllm])"),
]


def test_vllm_generator_samples_with_the_policys_logprobs(world, tmp_path):
    from backend.generators.vllm_local import VLLMGenerator
    from backend.rl import PolicyWorker

    worker = PolicyWorker.from_config(
        TINY, ["loss.type=policy", "loss.old_logprobs=detach", f"logger.run_dir={tmp_path}"], env=world
    )
    try:
        gen = VLLMGenerator.from_worker(worker, dtype="float32", gpu_memory_utilization=0.2)
        stats = gen.load_weights(worker.hf_weights())
        assert stats.tensors == len(worker.weight_metadata())
        prompt = list(b"def add(a, b):")
        out = gen.generate(prompt, 4, 1.0, 16, seed=0)
        assert [len(c.token_ids) for c in out] == [16] * 4
        rows = [{"input_ids": prompt + c.token_ids} for c in out]
        for c, lp in zip(out, worker.logprobs(rows)):
            assert np.max(np.abs(np.asarray(c.logprobs) - lp[len(prompt) :])) <= 1e-3
    finally:
        worker.close()


def test_the_colocated_engine_sleeps_through_training_and_wakes_for_the_next_sync(world, tmp_path):
    """rl.generator=vllm on CUDA: after a generation the engine sleeps (level 1), so the GPU's free
    memory grows by at least its weights; the next sync wakes it and its log-probabilities are the
    policy's again."""
    from backend.generators.vllm_local import VLLMGenerator
    from backend.rl import PolicyWorker

    worker = PolicyWorker.from_config(
        TINY, ["loss.type=policy", "loss.old_logprobs=detach", f"logger.run_dir={tmp_path}"], env=world
    )
    try:
        gen = VLLMGenerator.from_worker(worker, dtype="float32", gpu_memory_utilization=0.2)
        gen.load_weights(worker.hf_weights())
        awake_free = torch.cuda.mem_get_info()[0]
        prompt = list(b"def add(a, b):")
        gen.generate(prompt, 2, 1.0, 8, seed=0)
        assert gen.asleep
        weights = sum(t.numel() * t.element_size() for _, t in worker.hf_weights())
        assert torch.cuda.mem_get_info()[0] >= awake_free + weights
        gen.load_weights(worker.hf_weights())
        assert not gen.asleep
        out = gen.generate(prompt, 2, 1.0, 8, seed=0)
        rows = [{"input_ids": prompt + c.token_ids} for c in out]
        for c, lp in zip(out, worker.logprobs(rows)):
            assert np.max(np.abs(np.asarray(c.logprobs) - lp[len(prompt) :])) <= 1e-3
    finally:
        worker.close()
