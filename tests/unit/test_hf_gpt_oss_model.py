"""A tiny random GPT-OSS imported through ``build_model`` (model.hf_checkpoint) gives transformers' logits.

The model: 2 layers (sliding window 4, then full), 4 experts top 2, sinks, q/k/v/o and expert
biases, YaRN RoPE (factor 32, truncate false). Also: MXFP4 experts dequantised bitwise as
transformers does, flex (sinks + window, forward only on CPU) equal to sdpa through the whole
model, export back to a directory transformers loads with equal logits, and the GPT-OSS-20B recipe
on the meta device with exactly 20,914,757,184 parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # noqa: E402  (a dev dependency: a missing one fails, never skips)

from backend.checkpoint.hf_export import full_named_tensors  # noqa: E402
from backend.model.hf.export import export_hf_dir  # noqa: E402
from backend.model.hf.gpt_oss import deinterleave_gate_up  # noqa: E402
from tests.helpers.hf_tiny import (  # noqa: E402
    build_from_hf,
    hf_logits,
    our_logits,
    right_padded_batch,
    tiny_gpt_oss_model,
    write_mxfp4_copy,
)

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpt_oss") / "tiny"
    return out, tiny_gpt_oss_model(out)


def _params(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.replace("module.", "")] = t.detach()
    return out


def test_logits_match_transformers(world, gpt_oss):
    hf_dir, hf = gpt_oss
    built = build_from_hf(hf_dir, world)
    assert built.fields["model_type"] == "gpt_oss"
    assert built.num_parameters == sum(p.numel() for p in hf.parameters())
    tokens, valid = right_padded_batch()
    ours, ref = our_logits(built.model, tokens, valid), hf_logits(hf, tokens, valid)
    diff = float((ours - ref)[valid].abs().max())
    print(f"gpt_oss: max |logit diff| on valid positions = {diff:.3g}")
    assert diff <= TOL and float(ref[valid].std()) > 0.1
    # Teeth: without the sinks (offset -inf would be no sink; zero is a different sink) logits move.
    attn = [m for m in built.model.modules() if getattr(m, "softmax_offset", None) is not None]
    assert [m.window for m in attn] == [4, 0]
    with torch.no_grad():
        saved = [m.softmax_offset.detach().clone() for m in attn]
        for m in attn:
            m.softmax_offset.fill_(-30.0)
        assert float((our_logits(built.model, tokens, valid) - ref)[valid].abs().max()) > 1e-2
        for m, s in zip(attn, saved, strict=True):
            m.softmax_offset.copy_(s)


def test_flex_forward_equals_sdpa(world, gpt_oss):
    hf_dir, _ = gpt_oss
    tokens, valid = right_padded_batch(seed=3)
    sdpa = our_logits(build_from_hf(hf_dir, world).model, tokens, valid)
    flex_built = build_from_hf(hf_dir, world, "model.attention_backend=flex")
    assert flex_built.attention_backend == "flex"
    flex = our_logits(flex_built.model, tokens, valid)
    diff = float((flex - sdpa)[valid].abs().max())
    print(f"gpt_oss: flex vs sdpa max |logit diff| = {diff:.3g}")
    assert diff <= 1e-5


def test_mxfp4_experts_dequantise_bitwise_as_transformers(world, gpt_oss, tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_dir, hf = gpt_oss
    pairs = write_mxfp4_copy(Path(hf_dir), tmp_path / "mxfp4")
    built = build_from_hf(tmp_path / "mxfp4", world)
    params = _params(built.model)
    dense = {name: convert_moe_packed_tensors(b, s, dtype=torch.float32) for name, (b, s) in pairs.items()}
    for layer in range(2):
        gu, dn = (
            dense[f"model.layers.{layer}.mlp.experts.gate_up_proj"],
            dense[f"model.layers.{layer}.mlp.experts.down_proj"],
        )
        pre = f"decoder.layers.{layer}.mlp.experts."
        fc1, fc2 = params[pre + "fc1_weight"], params[pre + "fc2_weight"]
        assert torch.equal(fc1.view(torch.int32), deinterleave_gate_up(gu).contiguous().view(torch.int32))
        assert torch.equal(fc2.view(torch.int32), dn.view(torch.int32))
    # And the model computes what transformers computes with those dequantised experts.
    with torch.no_grad():
        for layer, mod in enumerate(hf.model.layers):
            saved = (mod.mlp.experts.gate_up_proj.clone(), mod.mlp.experts.down_proj.clone())
            mod.mlp.experts.gate_up_proj.copy_(dense[f"model.layers.{layer}.mlp.experts.gate_up_proj"])
            mod.mlp.experts.down_proj.copy_(dense[f"model.layers.{layer}.mlp.experts.down_proj"])
            mod._saved = saved
    try:
        tokens, valid = right_padded_batch(seed=2)
        diff = float((our_logits(built.model, tokens, valid) - hf_logits(hf, tokens, valid))[valid].abs().max())
        print(f"gpt_oss mxfp4: max |logit diff| = {diff:.3g}")
        assert diff <= TOL
    finally:
        with torch.no_grad():
            for mod in hf.model.layers:
                mod.mlp.experts.gate_up_proj.copy_(mod._saved[0])
                mod.mlp.experts.down_proj.copy_(mod._saved[1])
                del mod._saved


def test_export_loads_in_transformers_with_equal_logits(world, gpt_oss, tmp_path):
    hf_dir, hf = gpt_oss
    built = build_from_hf(hf_dir, world)
    out = export_hf_dir(
        built.fields, full_named_tensors(built.model), tmp_path / "out", dtype="fp32", source_dir=hf_dir
    )
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "gpt_oss"
    again = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    ref = hf.state_dict()
    for name, t in again.state_dict().items():
        assert torch.equal(t, ref[name]), name
    tokens, valid = right_padded_batch(seed=1)
    assert float((hf_logits(again, tokens, valid) - hf_logits(hf, tokens, valid))[valid].abs().max()) == 0.0


def test_gpt_oss_20b_recipe_on_meta_device(world):
    from backend.config import load_config, validate
    from backend.model.factory import meta_model
    from backend.model.fields import model_family

    cfg = validate(load_config(REPO / "configs" / "gpt_oss_20b_dynamic.yaml", ["model.hf_checkpoint=''"]), 8)
    assert model_family(cfg.model) == "gpt_oss" and cfg.model.attention_backend == "flex"
    assert cfg.model.num_moe_experts == 32 and cfg.model.attention_sinks and cfg.train.dynamic_batch_enable
    model = meta_model(cfg, tokenizer_vocab=cfg.model.vocab_size)
    assert sum(p.numel() for p in model.parameters()) == 20_914_757_184


def test_right_padding_changes_no_gradient_and_no_router_statistic(world, gpt_oss):
    """Extra right padding (and a zero-weight placeholder row) leaves gradients and router counts
    unchanged, and no padding token reaches an expert (the experts compute real tokens only)."""
    from backend.model import moe_stats
    from backend.model.forward import token_losses
    from backend.model.grouped_experts import grouped_experts_class

    hf_dir, _ = gpt_oss
    built = build_from_hf(hf_dir, world, "model.moe_aux_loss_coeff=0.9", training=True)
    model = built.model
    tokens, valid = right_padded_batch(lengths=(12, 5, 9))
    computed = []  # rows every experts module computed, per forward
    experts = [m for m in model.modules() if isinstance(m, grouped_experts_class())]
    assert len(experts) == 2
    for m in experts:
        m.register_forward_hook(lambda mod, args, out: computed.append(int(args[1].sum())))

    def run(tokens, valid, rows=None):
        model.zero_grad(set_to_none=True)
        moe_stats.begin_window(model)
        computed.clear()
        positions = torch.arange(tokens.shape[1])[None].expand_as(tokens).contiguous()
        labels = torch.roll(tokens, -1, dims=1)
        weight = torch.nn.functional.pad(valid[:, 1:], (0, 1), value=False).float()  # a next token exists
        if rows is not None:
            weight = weight * rows[:, None]
        losses = token_losses(model, tokens, labels, positions, valid, route_rows=rows)
        aux = moe_stats.take_microbatch_aux(model)
        ((losses * weight).sum() / 20 + aux / 3).backward()
        stats = moe_stats.stats_of(model)
        grads = torch.cat([_full(p.grad).reshape(-1) for p in model.parameters()])
        assert computed == [2 * (12 + 5 + 9)] * 2  # top-k x real tokens, per layer: padding routes nowhere
        return grads, stats.counts.clone(), float(stats.aux_sum)

    g0, c0, a0 = run(tokens, valid)
    pad = 7
    g1, c1, a1 = run(torch.nn.functional.pad(tokens, (0, pad)), torch.nn.functional.pad(valid, (0, pad), value=False))
    extra_row = torch.cat([tokens, torch.randint(0, 300, (1, tokens.shape[1]))])
    g2, c2, a2 = run(
        extra_row,
        torch.cat([valid, torch.ones(1, tokens.shape[1], dtype=torch.bool)]),
        rows=torch.tensor([True, True, True, False]),
    )
    assert float(c0.sum()) == 2 * 2 * (12 + 5 + 9)  # layers x top-k x valid tokens
    for g, c, a in ((g1, c1, a1), (g2, c2, a2)):
        assert torch.equal(c, c0)
        assert abs(a - a0) <= 1e-6 * abs(a0)
        assert float((g - g0).abs().max()) <= 1e-5 * float(g0.abs().max())  # FP32 summation order
    assert a0 > 0


def test_packed_row_trains_like_padded_rows(world, gpt_oss):
    """The same three sequences as padded rows and as one packed row (sinks, windows, MoE): equal
    per-token losses, gradients, router counts and aux loss; the router counts per packed sequence."""
    from backend.batching import Microbatch
    from backend.data.collate import collate
    from backend.data.sample import Sample
    from backend.loss.outputs import microbatch_token_losses
    from backend.model import moe_stats

    hf_dir, _ = gpt_oss
    model = build_from_hf(hf_dir, world, "model.moe_aux_loss_coeff=0.9", training=True).model
    lengths = (12, 5, 9)
    g = torch.Generator().manual_seed(4)
    samples = [Sample(tokens=torch.randint(0, 300, (n,), generator=g).numpy()) for n in lengths]
    ids = [0, 1, 2]
    padded = collate(samples, ids, Microbatch(tuple(ids), 16, 0, 0))
    packed = collate(samples, ids, Microbatch(tuple(ids), 30, 30, 0, packed=True))  # 4 tokens of tail padding
    assert packed.tokens.shape == (1, 30) and padded.tokens.shape == (3, 16)

    def run(mb):
        model.zero_grad(set_to_none=True)
        moe_stats.begin_window(model)
        losses = microbatch_token_losses(model, mb, route_rows=mb.sample_ids >= 0)
        aux = moe_stats.take_microbatch_aux(model)
        ((losses * mb.loss_weight).sum() / 23 + aux / 3).backward()
        stats = moe_stats.stats_of(model)
        grads = torch.cat([_full(p.grad).reshape(-1) for p in model.parameters()])
        per_token = losses[mb.loss_weight > 0]
        return per_token, grads, stats.counts.clone(), float(stats.aux_sum)

    l0, g0, c0, a0 = run(padded)
    l1, g1, c1, a1 = run(packed)
    assert float(c0.sum()) == 2 * 2 * sum(lengths)  # layers x top-k x real tokens
    assert torch.equal(c0, c1)
    assert abs(a1 - a0) <= 1e-6 * abs(a0) and a0 > 0
    assert float((l1 - l0).abs().max()) <= 1e-5
    assert float((g1 - g0).abs().max()) <= 1e-5 * float(g0.abs().max())
    # Not vacuous: counting the packed row as one sample (one group) would change the aux loss,
    # which was checked by hand (9.22 per sample vs 6.48 as one group).


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["model.num_moe_experts=4", "model.moe_router_topk=5"], "model.moe_router_topk=5"),
        (["model.sliding_window=8", "model.window_attn_skip_freq=[1,0,1]"], "one per layer needed"),
        (["model.attention_bias=true"], "model.attention_bias: needs model.num_moe_experts"),
        (["model.moe_aux_loss_coeff=0.1"], "model.moe_aux_loss_coeff: needs"),
        (
            [
                "model.attention_sinks=true",
                "model.attention_backend=te",
                "model.num_attention_heads=6",
                "model.num_query_groups=3",
                "model.hidden_size=96",
                "train.dynamic_batch_enable=true",
                "train.dynamic_batch_layout=packed",
                "parallel.context_parallel_size=2",
            ],
            "Transformer Engine exchanges heads",
        ),
    ],
)
def test_gpt_oss_keys_are_validated(overrides, match):
    from backend.config import ConfigError, load_config, validate

    with pytest.raises(ConfigError, match=match):
        validate(load_config(None, overrides), 2)
