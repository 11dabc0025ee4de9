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
import transformers  # noqa: E402  (a dev dependency: a missing one fails, never skips)

from backend.checkpoint.hf_export import full_named_tensors  # noqa: E402
from backend.config.hf import read_hf_config  # noqa: E402
from backend.model.hf.export import export_hf_dir  # noqa: E402
from backend.model.rope import Rope  # noqa: E402
from tests.helpers.hf_tiny import KINDS, build_from_hf, hf_logits, our_logits, right_padded_batch  # noqa: E402

TOL = 1e-4


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


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_export_of_our_checkpoint_is_bitwise_without_training(world, tiny_hf, kind, tmp_path):
    """import -> our distributed checkpoint -> backend.checkpoint.hf_export (what tools/export_hf.py
    runs): every tensor equals the original checkpoint's bitwise, the config.json round-trips."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from backend.checkpoint.hf_export import export_checkpoint
    from backend.config import load_config
    from tests.helpers.hf_tiny import hf_overrides

    hf_dir, _ = tiny_hf[kind]
    built = build_from_hf(hf_dir, world)
    step = tmp_path / "checkpoints" / "step_00000000"
    dcp.save({"model": get_model_state_dict(built.model)}, checkpoint_id=str(step))
    cfg = load_config(None, hf_overrides(hf_dir))
    out = export_checkpoint(step, cfg, tmp_path / "out", world, dtype="fp32", max_shard_bytes=10**9)
    original, exported = load_file(hf_dir / "model.safetensors"), load_file(out / "model.safetensors")
    if kind == "qwen3":
        original.pop("lm_head.weight", None)  # tied: transformers may save the shared copy
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    assert read_hf_config(out) == read_hf_config(hf_dir)
    assert json.loads((out / "config.json").read_text())["architectures"] == [type(tiny_hf[kind][1]).__name__]
