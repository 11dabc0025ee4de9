"""GPU-only checks: FlexAttention backward on CUDA, a BF16 train step, Transformer Engine, and the
GPT-OSS attention (sinks + sliding windows, MoE) on flex and TE against sdpa, padded and packed.

Each is marked and skips with its reason where there is no CUDA device (or no TE); the CPU
paths they mirror are tested in tests/distributed.
"""

from __future__ import annotations

import pytest
import torch

from backend.distributed.fsdp import full_tensor
from tests.distributed.harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _batch(device, layout: str = "padded"):
    import numpy as np

    from backend.batching import Microbatch
    from backend.data.collate import collate
    from backend.data.sample import Sample

    rng = np.random.default_rng(0)
    samples = [Sample(tokens=rng.integers(0, 256, size=n)) for n in (300, 17, 512, 64)]
    if layout == "packed":  # one row of the four back to back (plus a tail joining the last)
        mb = Microbatch(indices=tuple(range(4)), padded_len=300 + 17 + 512 + 64 + 11, cost=0, tokens=0, packed=True)
    else:
        mb = Microbatch(indices=tuple(range(4)), padded_len=512, cost=0, tokens=0)
    return collate(samples, list(range(4)), mb).to(device)


def backend_vs_sdpa(rank: int, world: int, backend: str, layout: str = "padded"):
    from backend.config import load_config
    from backend.distributed.setup import init_distributed
    from backend.loss.outputs import microbatch_token_losses
    from backend.model.factory import build_model

    env = init_distributed(1)
    base = ["model.hidden_size=256", "model.num_layers=2", "data.max_seq_length=512", "train.seed=3"]
    batch = _batch(env.device, layout)
    out = {}
    grads = {}
    for name in ("sdpa", backend):
        cfg = load_config(None, [*base, f"model.attention_backend={name}", "train.precision=fp32"])
        model = build_model(cfg, env, tokenizer_vocab=256).model
        losses = microbatch_token_losses(model, batch)
        loss = (losses * batch.loss_weight).sum() / batch.loss_mask.sum()
        loss.backward()
        out[name] = losses.detach()[batch.valid].cpu()
        grads[name] = torch.cat([full_tensor(p.grad).reshape(-1) for p in model.parameters()]).cpu()
    out["fwd_diff"] = float((out["sdpa"] - out[backend]).abs().max())
    g0, g1 = grads["sdpa"], grads[backend]
    out["grad_cos"] = float(torch.dot(g0, g1) / (g0.norm() * g1.norm()))
    return out


def test_flex_backward_on_cuda_matches_sdpa(tmp_path):
    r = run_ranks(backend_vs_sdpa, 1, tmp_path, "flex", backend="nccl", timeout=600)[0]
    assert r["fwd_diff"] <= 1e-3 and r["grad_cos"] >= 0.9999, r


def test_te_matches_sdpa(tmp_path):
    from backend.megatron_compat import te_status

    ok, why = te_status()
    if not ok:
        pytest.skip(f"needs Transformer Engine: {why}")
    r = run_ranks(backend_vs_sdpa, 1, tmp_path, "te", backend="nccl", timeout=600)[0]
    assert r["fwd_diff"] <= 2e-2 and r["grad_cos"] >= 0.999, r


@pytest.mark.parametrize("backend", ["flex", "te"])
def test_packed_rows_match_sdpa(tmp_path, backend):
    """Packed rows: flex's document BlockMask and TE's THD path against per-sequence SDPA."""
    if backend == "te":
        from backend.megatron_compat import te_status

        ok, why = te_status()
        if not ok:
            pytest.skip(f"needs Transformer Engine: {why}")
    r = run_ranks(backend_vs_sdpa, 1, tmp_path, backend, "packed", backend="nccl", timeout=600)[0]
    assert r["fwd_diff"] <= 2e-2 and r["grad_cos"] >= 0.999, r


OSS = [
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.attention_sinks=true",
    "model.attention_bias=true",
    "model.sliding_window=64",
    "model.window_attn_skip_freq=[1,0]",
]


def oss_backend_vs_sdpa(rank: int, world: int, backend: str, precision: str):
    """A random GPT-OSS-style model (sinks drawn at random, window 64 then full, 4 experts top 2):
    ``backend`` against sdpa on one padded and one packed microbatch of the same sequences."""
    from backend.config import load_config
    from backend.distributed.setup import init_distributed
    from backend.loss.outputs import microbatch_token_losses
    from backend.model.factory import build_model

    env = init_distributed(1)
    base = ["model.hidden_size=256", "model.num_layers=2", "data.max_seq_length=1024", "train.seed=3", *OSS]
    out = {}
    for layout in ("padded", "packed"):
        batch = _batch(env.device, layout)
        losses, grads = {}, {}
        for name in ("sdpa", backend):
            cfg = load_config(None, [*base, f"model.attention_backend={name}", f"train.precision={precision}"])
            model = build_model(cfg, env, tokenizer_vocab=256).model
            sinks = [m.softmax_offset for m in model.modules() if getattr(m, "softmax_offset", None) is not None]
            assert len(sinks) == 2
            g = torch.Generator().manual_seed(11)
            with torch.no_grad():  # one rank: the FSDP2 shard is the whole vector
                for s in sinks:
                    local = s.to_local() if hasattr(s, "to_local") else s
                    local.copy_(torch.randn(local.shape, generator=g).to(local.device, local.dtype))
            try:
                per_token = microbatch_token_losses(model, batch)
            except RuntimeError as e:  # te_packed_refusal: this TE cannot run sinks on packed rows
                if "Transformer Engine >=" not in str(e):
                    raise
                out[layout] = {"refused": str(e)}
                break
            ((per_token * batch.loss_weight).sum() / batch.loss_mask.sum()).backward()
            losses[name] = per_token.detach()[batch.valid].float().cpu()
            grads[name] = torch.cat([full_tensor(p.grad).reshape(-1).double() for p in model.parameters()]).cpu()
        if layout in out:  # refused
            continue
        diff = (losses["sdpa"] - losses[backend]).abs()
        g0, g1 = grads["sdpa"], grads[backend]
        out[layout] = {
            "loss_max_diff": float(diff.max()),
            "loss_mean_diff": float(diff.mean()),
            "grad_cos": float(torch.dot(g0, g1) / (g0.norm() * g1.norm())),
        }
    return out


@pytest.mark.parametrize("backend", ["flex", "te"])
def test_gpt_oss_sinks_and_windows_match_sdpa(tmp_path, backend):
    """flex: FP32, forward and backward (the sinks' gradient through flex's log-sum-exp). te: BF16,
    ``softmax_type="learnable"`` + ``window_size`` on FusedAttention; packed (THD) rows with sinks
    need TE >= 2.12 (and cuDNN >= 9.18): an older TE must refuse them with the version to install."""
    precision = "fp32"
    te_thd_sinks = True
    if backend == "te":
        from backend.megatron_compat import te_status

        ok, why = te_status()
        if not ok:
            pytest.skip(f"needs Transformer Engine: {why}")
        import importlib.metadata

        from packaging.version import Version

        te_version = Version(importlib.metadata.version("transformer_engine").split("+")[0])
        if te_version < Version("2.8"):
            pytest.skip(f"needs Transformer Engine >= 2.8 for softmax_type='learnable' (found {te_version})")
        te_thd_sinks = te_version >= Version("2.12")
        precision = "bf16"
    r = run_ranks(oss_backend_vs_sdpa, 1, tmp_path, backend, precision, backend="nccl", timeout=600)[0]
    print(backend, precision, r)
    tol = {"fp32": (1e-3, 0.9999), "bf16": (2e-2, 0.99)}[precision]
    if not te_thd_sinks:
        assert "2.12" in r.pop("packed")["refused"]
    for layout, res in r.items():
        assert res["loss_mean_diff"] <= tol[0] and res["grad_cos"] >= tol[1], (layout, res)


def test_bf16_train_step_tracks_fp32(tmp_path, embedded_cache):
    from backend.bench.compare import run_arm
    from tests.conftest import TINY

    base = [f"data.cache_dir={embedded_cache}", "model.hidden_size=256", "train.dynamic_batch_enable=true"]
    fp32 = run_arm(TINY, base + ["train.precision=fp32"], nproc=1, steps=3, out_dir=tmp_path, name="fp32")
    bf16 = run_arm(TINY, base + ["train.precision=bf16"], nproc=1, steps=3, out_dir=tmp_path, name="bf16")
    for a, b in zip(fp32["loss"], bf16["loss"]):
        assert abs(a - b) / a <= 2e-2
    cos = float(torch.dot(fp32["grad"][0], bf16["grad"][0]) / (fp32["grad"][0].norm() * bf16["grad"][0].norm()))
    assert cos >= 0.99, cos


def test_grouped_experts_on_cuda_match_the_per_expert_loop(monkeypatch):
    """BF16 on CUDA: the grouped kernel (with its 8-row group padding) against the per-expert loop;
    on a GPU other than compute capability 9.x both arms are the loop and the test says so."""
    from backend.model import grouped_experts
    from tools.bench.bench_moe_experts import build, routed_counts

    device = torch.device("cuda")
    module = build(256, 8, 2, torch.bfloat16, device)
    counts = torch.tensor(routed_counts(300, 8, 2, seed=1))
    x = torch.randn(int(counts.sum()), 256, dtype=torch.bfloat16, device=device)
    probs = torch.rand(x.shape[0], device=device)
    print("grouped kernel applies:", grouped_experts.grouped_mm_applies(x, module.fc1_weight))

    def run():
        module.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out, _ = module(xi, counts, probs)
        out.float().pow(2).sum().backward()
        return [out.float(), xi.grad.float()] + [p.grad.float() for p in module.parameters()]

    fast = run()
    monkeypatch.setattr(grouped_experts, "grouped_mm_applies", lambda x, w: False)
    slow = run()
    for a, b in zip(fast, slow, strict=True):
        rel = float((a - b).norm() / b.norm().clamp(min=1e-12))
        assert rel <= 2e-2, rel


def liger_vs_chunked(rank: int, world: int):
    """The cross-entropy objective's microbatch sum with Liger's fused kernel against our chunked
    path (same seed, FP32, a Qwen3-sized vocabulary), loss weights 0 and 1; and a fractional
    weight falls back to the per-token path (the same number as the chunked arm's)."""
    from backend.config import load_config
    from backend.distributed.setup import init_distributed
    from backend.loss.cross_entropy import microbatch_loss_sum
    from backend.model.factory import build_model

    env = init_distributed(1)
    base = ["model.hidden_size=256", "model.num_layers=2", "data.max_seq_length=512", "train.seed=3"]
    base += ["model.vocab_size=151936", "train.precision=fp32"]
    batch = _batch(env.device)
    batch.loss_weight[:, :40] = 0  # an unweighted prompt
    out, grads = {}, {}
    for name, keys in (("chunked", ["model.logits_chunk_tokens=256"]), ("liger", ["model.logits_fused_kernel=liger"])):
        model = build_model(load_config(None, [*base, *keys]), env, tokenizer_vocab=256).model
        loss = microbatch_loss_sum(model, batch, env, normaliser=1000)
        (loss / 1000).backward()
        out[name] = float(loss)
        grads[name] = torch.cat([full_tensor(p.grad).reshape(-1) for p in model.parameters()]).cpu()
        if name == "liger":
            half = batch.to(env.device)
            half.loss_weight = half.loss_weight * 0.5
            out["liger_half"] = float(microbatch_loss_sum(model, half, env))
    g0, g1 = grads["chunked"], grads["liger"]
    out["grad_cos"] = float(torch.dot(g0, g1) / (g0.norm() * g1.norm()))
    out["grad_rel"] = float((g0 - g1).norm() / g0.norm())
    return out


def test_liger_fused_cross_entropy_matches_the_chunked_path(tmp_path):
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except ImportError as e:
        pytest.skip(f"needs liger-kernel (the liger extra): {e}")
    r = run_ranks(liger_vs_chunked, 1, tmp_path, backend="nccl", timeout=600)[0]
    assert abs(r["liger"] - r["chunked"]) <= 1e-5 * abs(r["chunked"]), r
    assert r["grad_cos"] >= 0.99999 and r["grad_rel"] <= 1e-4, r
    assert abs(r["liger_half"] - 0.5 * r["chunked"]) <= 1e-5 * abs(r["chunked"]), r  # the per-token path
