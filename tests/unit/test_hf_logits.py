"""HF checkpoints imported into megatron-core's GPTModel give transformers' logits, and export back.

Three tiny random models cover what the import must get right: Qwen3 (QK norm, head_dim 32 !=
hidden/heads 16, tied embeddings), Llama (llama3 RoPE scaling, eps 1e-5, untied) and Qwen2 (QKV
bias, YaRN RoPE with its 1.14 attention factor). The batch is right-padded; only valid positions
are compared, against transformers' eager attention in FP32.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from backend.model.hf.config import read_hf_config  # noqa: E402
from backend.model.hf.export import export_hf_dir  # noqa: E402
from backend.model.hf.load import load_hf_weights  # noqa: E402
from tests.helpers.hf_tiny import build_megatron, megatron_logits, right_padded_batch, tiny_hf_model  # noqa: E402

KINDS = ("qwen3", "llama", "qwen2")
TOL = 1e-4


@pytest.fixture(scope="module")
def world():
    """A one-process gloo world and megatron-core parallel state, undone afterwards (env included)."""
    import os

    from backend.distributed.setup import init_distributed, shutdown_distributed

    saved = dict(os.environ)
    init_distributed(1)
    yield
    shutdown_distributed()
    os.environ.clear()
    os.environ.update(saved)


def _hf_logits(model, tokens, valid):
    with torch.no_grad():
        return model(input_ids=tokens, attention_mask=valid.long()).logits


@pytest.mark.parametrize("kind", KINDS)
def test_imported_logits_match_transformers(world, kind, tmp_path):
    hf = tiny_hf_model(kind, tmp_path / "hf")
    fields = read_hf_config(tmp_path / "hf")
    model = build_megatron(fields)
    assert load_hf_weights(model, tmp_path / "hf", fields) > 0
    tokens, valid = right_padded_batch()
    with torch.no_grad():
        ours = megatron_logits(model, fields, tokens, valid)
    ref = _hf_logits(hf, tokens, valid)
    diff = float((ours - ref)[valid].abs().max())
    print(f"{kind}: max |logit diff| on valid positions = {diff:.3g}")
    assert diff <= TOL
    # The comparison has teeth: logits are O(1) and differ between positions, and plain RoPE in
    # place of the checkpoint's scaled RoPE would be caught.
    assert float(ref[valid].std()) > 0.1
    if fields["rope_scaling"]:
        with torch.no_grad():
            plain = megatron_logits(model, {**fields, "rope_scaling": None}, tokens, valid)
        assert float((plain - ref)[valid].abs().max()) > 1e-2


@pytest.mark.parametrize("kind", KINDS)
def test_export_loads_in_transformers_with_equal_logits(world, kind, tmp_path):
    hf = tiny_hf_model(kind, tmp_path / "hf")
    fields = read_hf_config(tmp_path / "hf")
    model = build_megatron(fields)
    load_hf_weights(model, tmp_path / "hf", fields)
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    out = export_hf_dir(
        fields,
        model.state_dict().items(),
        tmp_path / "out",
        dtype="fp32",
        source_dir=tmp_path / "hf",
        max_shard_bytes=40_000,  # several shards, so the index path is exercised
    )
    assert (out / "model.safetensors.index.json").is_file()
    assert (out / "tokenizer_config.json").is_file()
    assert read_hf_config(out) == fields
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    tokens, valid = right_padded_batch(seed=1)
    diff = float((_hf_logits(again, tokens, valid) - _hf_logits(hf, tokens, valid))[valid].abs().max())
    print(f"{kind}: export -> transformers max |logit diff| = {diff:.3g}")
    assert diff == 0.0
    # Every tensor transformers holds equals the original bitwise.
    ref = hf.state_dict()
    for name, t in again.state_dict().items():
        assert torch.equal(t, ref[name]), name


def test_bf16_export_is_bf16(world, tmp_path):
    tiny_hf_model("qwen3", tmp_path / "hf")
    fields = read_hf_config(tmp_path / "hf")
    model = build_megatron(fields)
    load_hf_weights(model, tmp_path / "hf", fields)
    out = export_hf_dir(fields, model.state_dict().items(), tmp_path / "out", dtype="bf16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
