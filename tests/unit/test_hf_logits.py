"""HF checkpoints imported through ``build_model`` (model.hf_checkpoint) give transformers' logits.

Three tiny random models cover what the import must get right: Qwen3 (QK norm, head_dim 32 !=
hidden/heads 16, tied embeddings), Llama (llama3 RoPE scaling, eps 1e-5, untied) and Qwen2 (QKV
bias, YaRN RoPE with its 1.14 attention factor). Our model is built on the meta device, sharded
by FSDP2 (a world of one here; two ranks in tests/distributed) and filled from the safetensors.
The batch is right-padded; only valid positions are compared, against transformers' eager
attention in FP32.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from backend.config.hf import read_hf_config  # noqa: E402
from backend.model.hf.export import export_hf_dir  # noqa: E402
from backend.model.rope import Rope  # noqa: E402
from backend.train.hf_export import full_named_tensors  # noqa: E402
from tests.helpers.hf_tiny import KINDS, build_from_hf, hf_logits, our_logits, right_padded_batch  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="module")
def world():
    """A one-process gloo world and megatron-core parallel state, undone afterwards (env included)."""
    import os

    from backend.distributed.setup import init_distributed, shutdown_distributed

    saved = dict(os.environ)
    env = init_distributed(1)
    yield env
    shutdown_distributed()
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("kind", KINDS)
def test_imported_logits_match_transformers(world, tiny_hf, kind):
    hf_dir, hf = tiny_hf[kind]
    built = build_from_hf(hf_dir, world)
    assert built.num_parameters == sum(p.numel() for p in hf.parameters())
    assert built.vocab_size == 300  # the checkpoint's vocabulary exactly, not padded to 384
    tokens, valid = right_padded_batch()
    ours, ref = our_logits(built.model, tokens, valid), hf_logits(hf, tokens, valid)
    diff = float((ours - ref)[valid].abs().max())
    print(f"{kind}: max |logit diff| on valid positions = {diff:.3g}")
    assert diff <= TOL
    # The comparison has teeth: logits are O(1) and differ between positions, and plain RoPE in
    # place of the checkpoint's scaled RoPE would be caught.
    assert float(ref[valid].std()) > 0.1
    if read_hf_config(hf_dir)["rope_scaling"]:
        attn = [m for m in built.model.modules() if hasattr(m, "rope_spec")]
        assert attn and all(m.rope_spec.scaling for m in attn)
        for m in attn:
            m.rope_spec = Rope(head_dim=m.rope_spec.head_dim, base=m.rope_spec.base)
        plain = our_logits(built.model, tokens, valid)
        assert float((plain - ref)[valid].abs().max()) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_in_transformers_with_equal_logits(world, tiny_hf, kind, tmp_path):
    hf_dir, hf = tiny_hf[kind]
    built = build_from_hf(hf_dir, world)
    out = export_hf_dir(
        built.fields,
        full_named_tensors(built.model),
        tmp_path / "out",
        dtype="fp32",
        source_dir=hf_dir,
        max_shard_bytes=40_000,  # several shards, so the index path is exercised
    )
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()
    assert read_hf_config(out) == read_hf_config(hf_dir)
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    tokens, valid = right_padded_batch(seed=1)
    diff = float((hf_logits(again, tokens, valid) - hf_logits(hf, tokens, valid))[valid].abs().max())
    print(f"{kind}: export -> transformers max |logit diff| = {diff:.3g}")
    assert diff == 0.0
    # Every tensor transformers holds equals the original bitwise.
    ref = hf.state_dict()
    for name, t in again.state_dict().items():
        assert torch.equal(t, ref[name]), name


def test_bf16_export_is_bf16(world, tiny_hf, tmp_path):
    built = build_from_hf(tiny_hf["qwen3"][0], world)
    out = export_hf_dir(built.fields, full_named_tensors(built.model), tmp_path / "out", dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
