"""HF <-> megatron-core name and layout mapping, and the safetensors reader and writer."""

from __future__ import annotations

import json

import pytest
import torch
import transformers  # noqa: E402,F401  (a dev dependency: a missing one fails, never skips)

from backend.config.hf import read_hf_config  # noqa: E402
from backend.model.hf.mapping import hf_to_megatron_names, ignorable_hf_names, megatron_to_hf  # noqa: E402
from backend.model.hf.safetensors_io import HFCheckpoint, HFCheckpointError, write_sharded  # noqa: E402
from tests.helpers.hf_tiny import tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("kind", ["qwen3", "llama", "qwen2"])
def test_round_trip_is_bitwise_and_covers_every_tensor(kind, tmp_path):
    hf = tiny_hf_model(kind, tmp_path)
    fields = read_hf_config(tmp_path)
    sd = hf.state_dict()
    used = set()
    for pm in hf_to_megatron_names(fields):
        merged = pm.to_megatron([sd[n] for n in pm.hf])
        back = megatron_to_hf(pm.megatron, merged, fields)
        assert [n for n, _ in back] == list(pm.hf)
        for n, t in back:
            assert torch.equal(t, sd[n]), n
        used.update(pm.hf)
    left = set(sd) - used
    assert left == ({"lm_head.weight"} if fields["tie_embeddings"] else set())


def _fields(n=4, g=2, h=3, hidden=5):
    return {
        "num_attention_heads": n,
        "num_query_groups": g,
        "head_dim": h,
        "hidden_size": hidden,
        "num_layers": 1,
        "qkv_bias": True,
        "qk_layernorm": False,
        "tie_embeddings": True,
    }


def test_qkv_layout_is_megatron_grouped():
    n, g, h, hidden = 6, 2, 3, 5
    fields = _fields(n, g, h, hidden)
    q = torch.arange(n).repeat_interleave(h)[:, None].float().expand(n * h, hidden)  # head j holds j
    k = 100 + torch.arange(g).repeat_interleave(h)[:, None].float().expand(g * h, hidden)
    v = 200 + torch.arange(g).repeat_interleave(h)[:, None].float().expand(g * h, hidden)
    pm = next(p for p in hf_to_megatron_names(fields) if p.megatron.endswith("linear_qkv.weight"))
    qkv = pm.to_megatron([q, k, v])
    # megatron-core: view [g, (n/g + 2) * h, hidden], split into n/g*h query rows, h key, h value.
    grouped = qkv.view(g, (n // g + 2) * h, hidden)
    for group in range(g):
        rows = grouped[group, :, 0].view(n // g + 2, h)[:, 0].tolist()
        assert rows == [group * (n // g) + i for i in range(n // g)] + [100 + group, 200 + group]
    bias_pm = next(p for p in hf_to_megatron_names(fields) if p.megatron.endswith("linear_qkv.bias"))
    bias = bias_pm.to_megatron([q[:, 0], k[:, 0], v[:, 0]])
    assert torch.equal(bias, qkv[:, 0])


def test_unknown_names_and_extra_state():
    fields = _fields()
    assert megatron_to_hf("decoder.layers.0.self_attention.linear_qkv._extra_state", None, fields) == []
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.router.weight"):
        megatron_to_hf("decoder.layers.0.mlp.router.weight", torch.zeros(1), fields)
    with pytest.raises(KeyError, match="beyond num_layers"):
        megatron_to_hf("decoder.layers.3.input_layernorm.weight", torch.zeros(1), fields)
    qkv = next(p for p in hf_to_megatron_names(fields) if p.megatron.endswith("linear_qkv.weight"))
    with pytest.raises(ValueError, match="k_proj has shape"):
        qkv.to_megatron([torch.zeros(12, 5), torch.zeros(5, 5), torch.zeros(6, 5)])


# ---- safetensors -------------------------------------------------------------------------------


def _tensors():
    base = torch.arange(4000, dtype=torch.float32).view(40, 100)
    gate, up = base.chunk(2)  # views of one storage: the writer must copy them apart
    return [("a", gate), ("b", up), ("c", torch.ones(3, dtype=torch.bfloat16)), ("d", torch.zeros(500))]


def test_sharded_write_and_lazy_read(tmp_path):
    files = write_sharded(_tensors(), tmp_path, max_shard_bytes=9000)
    names = sorted(p.name for p in files)
    assert names == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 2 * 8000 + 6 + 2000
    assert index["weight_map"]["d"] == "model-00003-of-00003.safetensors"
    with HFCheckpoint(tmp_path) as ckpt:
        assert ckpt.names() == ["a", "b", "c", "d"] and ckpt.shape("a") == (20, 100)
        for name, t in _tensors():
            got = ckpt.get(name)
            assert torch.equal(got, t) and got.dtype == t.dtype
        ckpt.check_consumed()


def test_single_shard_and_refusals(tmp_path):
    files = write_sharded(_tensors(), tmp_path)
    assert [p.name for p in files] == ["model.safetensors"]
    with pytest.raises(HFCheckpointError, match="already holds weights"):
        write_sharded(_tensors(), tmp_path)
    with HFCheckpoint(tmp_path) as ckpt:
        ckpt.get("a")
        with pytest.raises(HFCheckpointError, match=r"tensor 'zz' is missing \(looked in model.safetensors\)"):
            ckpt.get("zz")
        with pytest.raises(HFCheckpointError, match="missing from model.safetensors: q, zz"):
            ckpt.check_present(["a", "zz", "q"])
        with pytest.raises(HFCheckpointError, match="not used by the model: b, c, d"):
            ckpt.check_consumed()
        ckpt.check_consumed(ignorable=[r"[bcd]"])


def test_bin_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(HFCheckpointError, match="safetensors only: never unpickles .bin") as e:
        HFCheckpoint(tmp_path)
    assert "pytorch_model.bin" in str(e.value) and str(tmp_path) in str(e.value)


def test_index_cannot_point_outside(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../evil.safetensors"}}))
    with pytest.raises(HFCheckpointError, match="points outside"):
        HFCheckpoint(tmp_path)


def test_ignorable_names():
    tied = ignorable_hf_names({"tie_embeddings": True})
    import re

    assert any(re.fullmatch(p, "lm_head.weight") for p in tied)
    assert any(re.fullmatch(p, "model.layers.3.self_attn.rotary_emb.inv_freq") for p in tied)
    assert not any(re.fullmatch(p, "lm_head.weight") for p in ignorable_hf_names({"tie_embeddings": False}))
