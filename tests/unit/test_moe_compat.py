"""megatron-core 0.16.1 MoE layers train on CPU with ``apply_moe_compat`` and our stacked experts
(``grouped_experts``), and match GPT-OSS's MoE MLP.

A tiny GPTModel (2 layers, 4 experts, top 2, biases everywhere, GPT-OSS's clamped SwiGLU) runs
forward and backward on CPU in a one-process gloo world; one layer's MoE MLP, loaded with a
transformers ``GptOssMLP``'s weights through ``backend.model.hf.gpt_oss``'s maps, gives its
outputs, through the grouped GEMM and through the per-expert fallback alike.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # noqa: E402  (a dev dependency: a missing one fails, never skips)

from backend.megatron_compat import import_megatron_module  # noqa: E402
from backend.model.attention import AttentionContext, core_attention_spec  # noqa: E402
from backend.model.builder import PORTABLE_FUSIONS_OFF  # noqa: E402
from backend.model.grouped_experts import experts_spec  # noqa: E402
from backend.model.hf.gpt_oss import deinterleave_gate_up, gpt_oss_fields, gpt_oss_param_maps  # noqa: E402
from backend.model.moe_compat import apply_moe_compat, moe_config_kwargs  # noqa: E402
from backend.model.rope import Rope  # noqa: E402

HIDDEN, INTER, EXPERTS, TOPK = 32, 48, 4, 2


@pytest.fixture(scope="module")
def world():
    import os

    from backend.distributed.setup import init_distributed, shutdown_distributed

    saved = dict(os.environ)
    init_distributed(1)
    yield
    shutdown_distributed()
    os.environ.clear()
    os.environ.update(saved)


def _moe_gpt(aux_loss_coeff=0.0, seed=0):
    apply_moe_compat()
    tc = import_megatron_module("megatron.core.transformer")
    gpt = import_megatron_module("megatron.core.models.gpt")
    specs = import_megatron_module("megatron.core.models.gpt.gpt_layer_specs")
    config = tc.TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=8,
        ffn_hidden_size=INTER,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **PORTABLE_FUSIONS_OFF,
        moe_z_loss_coeff=1e-3 if aux_loss_coeff else None,
        **moe_config_kwargs(num_experts=EXPERTS, topk=TOPK, moe_ffn_hidden_size=INTER, aux_loss_coeff=aux_loss_coeff),
    )
    spec = specs.get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False, normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = core_attention_spec("sdpa", Rope(head_dim=8))
    spec.submodules.mlp.submodules.experts = experts_spec()
    torch.manual_seed(seed)
    return gpt.GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=64,
        position_embedding_type="none",
    )


@pytest.mark.parametrize("aux_loss_coeff", [0.0, 1e-2])
def test_moe_gpt_trains_on_cpu(world, aux_loss_coeff):
    model = _moe_gpt(aux_loss_coeff)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 12), generator=g)
    positions = torch.arange(12)[None].expand(2, 12).contiguous()
    valid = positions < torch.tensor([[12], [7]])
    ctx = AttentionContext(positions=positions, valid=valid)
    losses = model(tokens, positions, ctx, labels=tokens, padding_mask=~valid)
    loss = losses[valid].mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    for layer in range(2):
        assert float(grads[f"decoder.layers.{layer}.mlp.router.weight"].abs().sum()) > 0
        hit = [float(g.abs().sum()) > 0 for g in grads[f"decoder.layers.{layer}.mlp.experts.fc2_bias"]]
        assert sum(hit) >= TOPK  # 19 tokens, top 2 of 4: several experts receive gradient
    assert float(grads["decoder.layers.0.self_attention.linear_proj.bias"].abs().sum()) > 0


def _hf_config(**kw):
    return transformers.GptOssConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOPK,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        **kw,
    )


def _hf_mlp(seed=0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    mlp = GptOssMLP(_hf_config()).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            # gate/up pre-activations of several units exceed swiglu_limit 7; outputs stay O(1)
            p.copy_((0.02 if "down_proj" in name else 0.5) * torch.randn(p.shape, generator=g))
    return mlp


@torch.no_grad()
def _load_layer_mlp(layer_mlp, layer: int, hf_state: dict) -> None:
    """One layer's MoE MLP from a ``GptOssMLP`` state dict, through the import maps."""
    fields = gpt_oss_fields(_hf_config(tie_word_embeddings=False).to_dict())
    params = dict(layer_mlp.named_parameters())
    prefix, hf_prefix = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    for pm in gpt_oss_param_maps(fields):
        if pm.megatron.startswith(prefix):
            params[pm.megatron.removeprefix(prefix)].copy_(
                pm.to_megatron([hf_state[n.removeprefix(hf_prefix)] for n in pm.hf])
            )


def _export_layer_mlp(layer_mlp, layer: int) -> dict:
    fields = gpt_oss_fields(_hf_config(tie_word_embeddings=False).to_dict())
    params = dict(layer_mlp.named_parameters())
    prefix, hf_prefix = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
    out = {}
    for pm in gpt_oss_param_maps(fields):
        if pm.megatron.startswith(prefix):
            for n, t in zip(pm.hf, pm.to_hf(params[pm.megatron.removeprefix(prefix)].detach()), strict=True):
                out[n.removeprefix(hf_prefix)] = t
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert_loop"])
def test_moe_mlp_matches_transformers_gpt_oss_mlp(world, monkeypatch, grouped):
    from backend.model import grouped_experts

    if not grouped:
        monkeypatch.setattr(grouped_experts, "grouped_mm_applies", lambda x, w: False)
    model = _moe_gpt().eval()
    layer_mlp = model.decoder.layers[1].mlp
    hf = _hf_mlp()
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    _load_layer_mlp(layer_mlp, 1, state)
    g = torch.Generator().manual_seed(1)
    x = 2.0 * torch.randn(2, 9, HIDDEN, generator=g)  # [b, s, h]
    with torch.no_grad():
        ref, _ = hf(x)
        ours, bias = layer_mlp(x.transpose(0, 1).contiguous())  # megatron-core takes [s, b, h]
        gate_up = x.reshape(-1, HIDDEN) @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
    assert bias is None
    diff = float((ours.transpose(0, 1) - ref).abs().max())
    print(f"MoE MLP vs transformers GptOssMLP: max |diff| = {diff:.2e} (output scale {float(ref.abs().max()):.1f})")
    assert diff <= 1e-5
    assert float(gate_up.abs().max()) > 7.0  # the swiglu_limit clamp is exercised

    # The mapping has teeth: without undoing GPT-OSS's gate/up interleave the output is wrong.
    wrong = dict(state)
    wrong["experts.gate_up_proj"] = deinterleave_gate_up(state["experts.gate_up_proj"])
    wrong["experts.gate_up_proj_bias"] = deinterleave_gate_up(state["experts.gate_up_proj_bias"])
    _load_layer_mlp(layer_mlp, 1, wrong)
    with torch.no_grad():
        bad, _ = layer_mlp(x.transpose(0, 1).contiguous())
    assert float((bad.transpose(0, 1) - ref).abs().max()) > 1e-1

    # Export is the inverse of import.
    _load_layer_mlp(layer_mlp, 1, state)
    back = _export_layer_mlp(layer_mlp, 1)
    assert set(back) == {k for k in state if k.startswith("experts.") or k.startswith("router.")}
    for name, t in back.items():
        assert torch.equal(t, state[name]), name


def test_grouped_gemm_and_per_expert_loop_agree_in_backward(world, monkeypatch):
    """The execution paths of ``GroupedExperts`` (one grouped GEMM per projection, the same with
    every group padded to 8 rows as on CUDA, or a loop over experts) give the same outputs and
    gradients, including experts that receive no token."""
    from backend.model import grouped_experts

    torch.manual_seed(3)
    experts = grouped_experts.grouped_experts_class()(EXPERTS, _moe_gpt().config)
    tokens = torch.randn(11, HIDDEN)
    counts = torch.tensor([4, 0, 7, 0])  # two experts idle
    probs = torch.rand(11)

    def grads():
        experts.zero_grad(set_to_none=True)
        x = tokens.clone().requires_grad_()
        out, bias = experts(x, counts, probs)
        assert bias is None and out.shape == (11, HIDDEN)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return [out.detach(), x.grad] + [p.grad for p in experts.parameters()]

    fast = grads()
    monkeypatch.setattr(grouped_experts, "group_alignment", lambda x, w: 8)  # CUDA's padded groups
    padded = grads()
    monkeypatch.setattr(grouped_experts, "grouped_mm_applies", lambda x, w: False)
    slow = grads()
    for a, b, c in zip(fast, slow, padded, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5) and torch.allclose(a, c, atol=1e-6, rtol=1e-5)
    assert float(fast[-1][1].abs().sum()) == 0 and float(fast[-1][0].abs().sum()) > 0  # idle expert: no gradient


def test_apply_moe_compat_is_idempotent():
    first = apply_moe_compat()
    assert apply_moe_compat() == first
    assert any(name.startswith("Router.gating") for name in first)


def test_gpt_oss_param_maps_name_every_megatron_parameter(world):
    """The mapping's megatron-core names are the MoE GPTModel's, plus the sinks our core attention will hold."""
    cfg = _hf_config(tie_word_embeddings=False)  # GPTModel's default: an output layer of its own
    names = {pm.megatron for pm in gpt_oss_param_maps(gpt_oss_fields(cfg.to_dict()))}
    ours = {n for n, _ in _moe_gpt().named_parameters()}
    assert names - ours == {f"decoder.layers.{i}.self_attention.core_attention.softmax_offset" for i in range(2)}
    assert ours <= names


def test_bench_moe_experts_runs_both_arms():
    """The experts benchmark runs end to end and reports both arms (timings are not asserted)."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO

    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "bench" / "bench_moe_experts.py"), "--tokens", "64", "--scale", "0.02"]
        + ["--experts", "4", "--topk", "2", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["routed_tokens"] == 128 and result["grouped_mm_used"] is True
    assert result["grouped_s"] > 0 and result["per_expert_loop_s"] > 0
    assert "experts speedup grouped vs loop" in out.stdout


def test_grouped_kernel_gate_reads_container_torch_versions(monkeypatch):
    """A container's pre-release torch ("2.9.0a0+...nv25.06" compares below "2.9" as a string)
    still counts as 2.9: the grouped kernel is not silently replaced by the per-expert loop."""
    from backend.model import grouped_experts

    x, w = torch.zeros(4, 8), torch.zeros(2, 8, 8)
    try:
        for version, applies in (("2.9.0a0+5228986c39.nv25.06", True), ("2.8.1", False)):
            monkeypatch.setattr(torch, "__version__", version)
            grouped_experts._torch_release.cache_clear()
            assert grouped_experts.grouped_mm_applies(x, w) is applies, version
    finally:
        monkeypatch.undo()
        grouped_experts._torch_release.cache_clear()
