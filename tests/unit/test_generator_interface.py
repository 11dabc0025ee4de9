"""Every rollout generator keeps the one interface of ``backend.generators.base``, and the old
import paths name the very same modules (code written against them keeps working)."""

import importlib

import pytest

from backend.generators import base


def methods(kind) -> set[str]:
    """The public methods a protocol names (its own and those it extends)."""
    return {m for k in kind.__mro__ if k.__module__ == base.__name__ for m in vars(k) if not m.startswith("_")}


@pytest.mark.parametrize(
    ("module", "name", "kinds"),
    [
        ("backend.generators.hf", "HFGenerator", (base.Generator, base.Sampler)),
        ("backend.generators.process", "RemoteGenerator", (base.Generator, base.Queued, base.Probed)),
        (
            "backend.generators.vllm_server",
            "VLLMServerGenerator",
            (base.Generator, base.Sampler, base.Queued, base.Probed),
        ),
    ],
)
def test_each_generator_class_keeps_the_interface(module, name, kinds):
    cls = getattr(importlib.import_module(module), name)
    for kind in kinds:
        missing = [m for m in methods(kind) if not hasattr(cls, m)]
        assert not missing, f"{name} lacks {missing} of {kind.__name__}"


def test_the_in_process_vllm_generator_keeps_it_too():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from backend.generators.vllm_local import VLLMGenerator

    for kind in (base.Generator, base.Sampler, base.Probed):
        assert all(hasattr(VLLMGenerator, m) for m in methods(kind)), kind


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("backend.rl.generate", "backend.generators.hf"),
        ("backend.rl.vllm_generator", "backend.generators.vllm_local"),
        ("backend.rl.remote_generator", "backend.generators.process"),
    ],
)
def test_old_paths_are_the_same_modules(old, new):
    if new.endswith("vllm_local"):
        pytest.importorskip("vllm", reason="vLLM is not installed")
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_server_transport_is_nccl_on_cuda_by_default_and_refused_without_it():
    from backend.generators.transport import backend

    assert backend("auto", cuda=True) == "nccl"
    assert backend("auto", cuda=False) == "gloo"
    assert backend("gloo", cuda=True) == "gloo"
    with pytest.raises(ValueError, match="rl.vllm_server.transport=nccl needs CUDA"):
        backend("nccl", cuda=False)


def test_a_server_started_for_nccl_takes_vllms_engine_and_not_ours():
    import json

    from backend.generators.servers import EXTENSION, server_command

    def config(cmd):
        return json.loads(cmd[cmd.index("--weight-transfer-config") + 1])

    gloo = server_command("m", 1, max_model_len=64, tensor_parallel_size=1, cpu=True)
    nccl = server_command("m", 1, max_model_len=64, tensor_parallel_size=1, cpu=False, transfer="nccl")
    assert config(gloo) == {"backend": "gloo"} and EXTENSION in gloo
    assert config(nccl) == {"backend": "nccl"} and EXTENSION not in nccl


def test_a_bad_transport_is_a_config_error_naming_the_key():
    from backend.config import ConfigError, load_config, validate
    from tests.conftest import REPO

    cfg = load_config(str(REPO / "configs" / "grpo_demo.yaml"), ["rl.vllm_server.transport=tcp"])
    with pytest.raises(ConfigError, match=r"rl.vllm_server.transport='tcp': must be one of auto, gloo, nccl"):
        validate(cfg)


def test_a_group_error_names_each_silent_server_as_engine_errors_do():
    """A weight broadcast that fails has no single peer: its error names every server that no
    longer answers /health, as "vLLM server URL" (what a generate error says), so a run killed in
    either phase names the engine the same way."""
    from backend.config.schema import VLLMServerConfig
    from backend.distributed.setup import free_port
    from backend.generators.vllm_server import VLLMServerGenerator

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gen = VLLMServerGenerator([url], [], VLLMServerConfig(), sender=True)
    assert gen.named_silent() == f"vLLM server {url} no longer answer(s) /health"
    gen.urls = []
    assert gen.named_silent() == "every vLLM server still answers /health"
