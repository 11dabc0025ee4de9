#!/usr/bin/env python3
"""One grouped GEMM per projection or one GEMM per expert? Measure the MoE experts both ways.

``backend.model.grouped_experts.GroupedExperts`` runs forward and backward on random tokens
already routed (top-k of E experts, uneven counts as a router gives them), once through
``torch._grouped_mm`` and once through its per-expert loop (the way megatron-core's
``SequentialMLP`` runs experts), side by side in one process on the same weights, and prints the
median times and their ratio. Defaults are GPT-OSS-20B's layer shape scaled by ``--scale``
(hidden 2880, 32 experts, top 4); BF16 on CUDA, FP32 on CPU.

    python tools/bench/bench_moe_experts.py [--tokens 4096] [--scale 0.25] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def build(hidden: int, experts: int, topk: int, dtype, device):
    """A GPT-OSS-style ``GroupedExperts`` (expert size = hidden, clamped SwiGLU with biases)."""
    from backend.megatron_compat import import_megatron_module
    from backend.model.builder import PORTABLE_FUSIONS_OFF
    from backend.model.grouped_experts import grouped_experts_class
    from backend.model.moe_compat import moe_config_kwargs

    config = import_megatron_module("megatron.core.transformer").TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=8,
        ffn_hidden_size=hidden,
        use_cpu_initialization=True,
        params_dtype=dtype,
        **PORTABLE_FUSIONS_OFF,
        **moe_config_kwargs(num_experts=experts, topk=topk, moe_ffn_hidden_size=hidden),
    )
    return grouped_experts_class()(experts, config).to(device)


def routed_counts(tokens: int, experts: int, topk: int, seed: int) -> list[int]:
    """Token counts per expert for ``tokens`` tokens routed top-k with a skewed (Zipf-like) load."""
    import torch

    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 0.7
    picks = torch.stack([torch.multinomial(weights, topk, generator=g) for _ in range(tokens)])
    return torch.bincount(picks.flatten(), minlength=experts).tolist()


def time_arm(module, x, counts, probs, repeats: int, device) -> float:
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times = []
    grad = torch.randn_like(x)
    for _ in range(repeats + 1):  # the first run warms up
        module.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        out, _ = module(x, counts, probs)
        out.backward(grad)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    import torch

    from backend.model import grouped_experts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens before routing (each goes to top-k experts)")
    ap.add_argument("--scale", type=float, default=0.25, help="hidden and expert sizes relative to GPT-OSS-20B")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden = max(8, int(2880 * args.scale) // 8 * 8)
    module = build(hidden, args.experts, args.topk, dtype, device)
    counts = torch.tensor(routed_counts(args.tokens, args.experts, args.topk, seed=0))
    routed = int(counts.sum())
    x = torch.randn(routed, hidden, dtype=dtype, device=device, requires_grad=True)
    probs = torch.rand(routed, device=device)
    applies = grouped_experts.grouped_mm_applies(x, module.fc1_weight)
    grouped = time_arm(module, x, counts, probs, args.repeats, device)
    original = grouped_experts.grouped_mm_applies
    grouped_experts.grouped_mm_applies = lambda x, w: False
    try:
        loop = time_arm(module, x, counts, probs, args.repeats, device)
    finally:
        grouped_experts.grouped_mm_applies = original
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "hidden": hidden,
        "experts": args.experts,
        "topk": args.topk,
        "routed_tokens": routed,
        "tokens_per_expert_max_over_mean": max(counts.tolist()) / (routed / args.experts),
        "grouped_mm_used": applies,
        "grouped_s": grouped,
        "per_expert_loop_s": loop,
        "speedup": loop / grouped,
    }
    print(f"device {result['device']}, {result['dtype']}, hidden {hidden}, {args.experts} experts top {args.topk}")
    print(f"{'arm':<18}{'fwd+bwd s':>12}")
    print(f"{'grouped GEMM':<18}{grouped:>12.4f}" + ("" if applies else "  (kernel does not apply: loop)"))
    print(f"{'per-expert loop':<18}{loop:>12.4f}")
    print(f"experts speedup grouped vs loop: {result['speedup']:.2f}x")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
