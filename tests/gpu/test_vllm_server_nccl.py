"""``rl.generator: vllm_server`` on CUDA with vLLM's own NCCL transfer engine
(``rl.vllm_server.transport=nccl``, the default where CUDA is): one server on a GPU of its own
(the trainer on GPU 0, the server on GPU 1), a sync through vLLM's packed NCCL producer, then the
loop's probe check (the engine's log-probabilities equal the trainer's). Skips with its reason
below two CUDA devices (NCCL refuses two ranks on one device) or without the ``vllm`` extra; the
gloo path it mirrors is tested on CPU in tests/distributed/test_vllm_server.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.conftest import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (the trainer's and the server's)"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm extra (pip install .[vllm])"),
]


def test_a_sync_over_nccl_puts_the_server_on_the_trainers_weights(world, tmp_path):
    from backend.config.schema import VLLMServerConfig
    from backend.generators.servers import start_servers, stop_servers
    from backend.generators.vllm_server import VLLMServerGenerator
    from backend.rl import PolicyWorker
    from backend.rl.loop import GRPOLoop

    settings = VLLMServerConfig(num_engines=1, first_gpu=1, transport="nccl", bucket_mib=1, sync_timeout_s=120.0)
    worker = PolicyWorker.from_config(
        str(REPO / "configs" / "grpo_demo.yaml"), ["rl.generator=vllm_server", f"logger.run_dir={tmp_path}"], env=world
    )
    servers = start_servers(worker.hf_config(torch.float32), settings, max_model_len=256, log_dir=tmp_path)
    try:
        gen = VLLMServerGenerator(
            [s.url for s in servers],
            worker.weight_metadata(torch.float32),
            settings,
            sender=True,
            vocab_limit=worker.sampling_vocab,
            vocab_size=worker.hf_config()["vocab_size"],
        )
        assert gen.transfer == "nccl"
        loop = GRPOLoop(worker, gen)
        stats = loop.sync_weights()  # raises when the probe check fails
        assert stats.tensors == len(worker.weight_metadata())
        assert loop.last_probe_diff <= 1e-2  # the server runs BF16 on CUDA
        gen.close()
    finally:
        worker.close()
        stop_servers(servers)
