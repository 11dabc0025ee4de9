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
