#!/usr/bin/env python3
"""Benchmark fixed versus dynamic microbatching in training, and explain the numbers.

    python tools/bench_train.py --dp 2 --json          # CPU: a tiny model, two gloo ranks
    python tools/bench_train.py --json                 # on a GPU: a ~250M-parameter model in BF16
    python tools/bench_train.py --moe --sets short     # the same arms on a tiny GPT-OSS-style MoE
    python tools/bench_train.py --recipe configs/qwen3_4b_dynamic.yaml --sets short   # Qwen3-4B, random weights

Arms on the same windows, alternating each step: micro-batch size 1, the largest fixed size safe
for the longest sequence, sort-and-stride (padded), dynamic batching with padded rows and with
packed rows (--compare-weight adds both dynamic layouts planned with attention weight 0). Per arm:
measured and modelled step time and the measured rank imbalance. Prints a table and, with --json,
one JSON object (keys: sets -> speedup_vs_mbs1, predicted_speedup, padding_efficiency,
packed_vs_padded, ..., arms; see docs/guides/performance.md).

    python tools/bench_train.py --dp 2 --sets longtail4k --compare-weight   # pricing vs imbalance
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path


def build(env, args):
    from backend.config import load_config
    from backend.model.factory import build_model
    from backend.train.optim import build_optimizer, build_scheduler

    cuda = env.device.type == "cuda"
    size = (
        ["model.hidden_size=1024", "model.num_layers=16", "model.num_attention_heads=16", "model.num_query_groups=4"]
        if cuda
        else ["model.hidden_size=128", "model.num_layers=2", "model.num_attention_heads=4", "model.num_query_groups=2"]
    )
    moe = (
        [
            "model.num_moe_experts=4",
            "model.moe_router_topk=2",
            f"model.moe_ffn_hidden_size={512 if cuda else 128}",
            "model.moe_aux_loss_coeff=0.01",
            "model.attention_bias=true",
            "model.attention_sinks=true",
            "model.qk_layernorm=false",
            "model.qkv_bias=true",
            "model.sliding_window=128",
            f"model.window_attn_skip_freq=[{','.join(['1', '0'] * (8 if cuda else 1))}]",
        ]
        if args.moe
        else []
    )
    if args.recipe:  # a real architecture (e.g. Qwen3-4B) with random weights: no checkpoint is read
        size, moe = ["model.hf_checkpoint=''"], []
    else:
        size = [*size, f"model.vocab_size={32768 if cuda else 256}"]
    cfg = load_config(
        args.recipe,
        [
            *size,
            *moe,
            f"model.attention_backend={args.attention}",
            "data.max_seq_length=8192",
            "train.seed=0",
            "optimizer.lr=1e-5",
            "optimizer.min_lr=1e-6",
            "scheduler.warmup_iters=0",
            *args.override,
        ],
    )
    built = build_model(cfg, env, tokenizer_vocab=256)
    optimizer = build_optimizer(built.model, cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.scheduler, 10**6)
    info = {
        "parameters": built.num_parameters,
        "hidden_size": cfg.model.hidden_size,
        "num_layers": cfg.model.num_layers,
        "attention_backend": built.attention_backend,
        "precision": "bf16" if built.bf16 else "fp32",
        "moe": f"{cfg.model.num_moe_experts} experts, top {cfg.model.moe_router_topk}" if args.moe else None,
    }
    return built.model, optimizer, scheduler, info


def print_table(result: dict) -> None:
    cal = result["calibration"]
    print(
        f"device {result['device']} | dp {result['dp']} | model {result['model']['parameters'] / 1e6:.1f}M params, "
        f"{result['model']['attention_backend']}, {result['model']['precision']}"
    )
    print(
        f"cost model: {cal['c0_s'] * 1e3:.2f} ms/microbatch + {cal['c1_s_per_token'] * 1e6:.3f} us/token + "
        f"{cal['c2_s_per_token_len'] * 1e9:.4f} ns/token/len; t_step {cal['t_step_s'] * 1e3:.1f} ms; "
        f"planner overhead {cal['overhead_tokens']} tokens"
    )
    print(
        f"packed rows: {cal['packed_c0_s'] * 1e3:.2f} ms/microbatch + {cal['packed_c1_s_per_token'] * 1e6:.3f} us/token"
        f" + {cal['packed_c2_s_per_token_len'] * 1e9:.4f} ns/token/len; attention weight (c2/c1): padded "
        f"{cal['attention_weight']:.3g}, packed {cal['packed_attention_weight']:.3g} token-equivalents per token x length"
    )
    head = (
        f"{'set':12} {'arm':17} {'step_s':>8} {'tok/s':>9} {'pad_eff':>7} {'mbs':>6} {'peak_MiB':>9} {'shapes':>6} "
        f"{'real_s':>7} {'pad_s':>7} {'ovh_s':>7} {'pred_s':>7} {'x_mbs1':>6} {'pred_x':>6} {'imb':>6} {'imb_mod':>7}"
    )
    print(head)
    print("-" * len(head))
    for name, s in result["sets"].items():
        for arm, a in s["arms"].items():
            tail = (
                f" {a['speedup_vs_mbs1']:6.2f} {a['predicted_speedup_vs_mbs1']:6.2f}"
                f" {a['measured_rank_imbalance']:6.3f} {a['modelled_rank_imbalance']:7.3f}"
            )
            print(
                f"{name:12} {arm:17} {a['median_step_time_s']:8.3f} {a['tokens_per_s']:9.0f} {a['padding_efficiency']:7.3f} "
                f"{a['microbatches_per_step']:6.1f} {a['peak_memory_bytes'] / 2**20:9.1f} {a['distinct_shapes']:6d} "
                f"{a['real_compute_s']:7.3f} {a['padding_compute_s']:7.3f} {a['overhead_s']:7.3f} {a['predicted_step_time_s']:7.3f}"
                + tail
            )
        print(
            f"{name:12} speedup vs mbs1: measured {s['speedup_vs_mbs1']:.2f}x, predicted {s['predicted_speedup']:.2f}x "
            f"(ratio {s['speedup_vs_mbs1'] / s['predicted_speedup']:.2f}); vs fixed mbs {s['fixed_safe_mbs']}: "
            f"{s['speedup_vs_fixed_safe']:.2f}x"
        )
        print(
            f"{name:12} packed vs padded: measured {s['packed_vs_padded']:.3f}x, predicted "
            f"{s['predicted_packed_vs_padded']:.3f}x; vs sort-and-stride: dynamic {s['dynamic_vs_sort_and_stride']:.3f}x "
            f"(predicted {s['predicted_dynamic_vs_sort_and_stride']:.3f}x), packed {s['packed_vs_sort_and_stride']:.3f}x "
            f"(predicted {s['predicted_packed_vs_sort_and_stride']:.3f}x)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp", type=int, default=1, help="data-parallel processes (started with torchrun)")
    p.add_argument("--sets", nargs="+", default=["short", "rl_longtail", "embedded"])
    p.add_argument("--steps", type=int, default=5, help="measured steps per arm")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--attention", default="auto", help="model.attention_backend")
    p.add_argument("--override", action="append", default=[], help="dotted.key=value for the model config")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--recipe",
        help="take the model architecture from this config (e.g. configs/qwen3_4b_dynamic.yaml), random weights",
    )
    p.add_argument("--moe", action="store_true", help="a GPT-OSS-style MoE model (4 experts, top 2, sinks, windows)")
    p.add_argument("--scale", type=float, default=1.0, help="scale sequences per step (a quick smoke run: 0.1)")
    p.add_argument(
        "--compare-weight", action="store_true", help="add both dynamic layouts planned with attention weight 0"
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.dp > 1 and "WORLD_SIZE" not in os.environ:
        from backend.distributed.launch import torchrun_command

        cmd = torchrun_command(args.dp, __file__, *(argv if argv is not None else sys.argv[1:]))
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))

    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    from backend.bench.length_sets import synthetic_lengths
    from backend.bench.train_bench import CPU_SETS, GPU_SETS, calibrate, measure_t_step, run_set
    from backend.distributed.setup import init_distributed, shutdown_distributed

    env = init_distributed(1)
    try:
        model, optimizer, scheduler, info = build(env, args)
        catalogue = GPU_SETS if env.device.type == "cuda" else CPU_SETS
        unknown = set(args.sets) - set(catalogue)
        if unknown:
            p.error(f"unknown --sets {sorted(unknown)}; choose from {sorted(catalogue)}")
        specs = {name: catalogue[name] for name in args.sets}
        if args.scale != 1.0:
            specs = {n: (g, cap, max(env.dp_size, int(gbs * args.scale)), b) for n, (g, cap, gbs, b) in specs.items()}
        longest = max(max(synthetic_lengths(g, 2000, seed=0, cap=cap)) for g, cap, _, _ in specs.values())
        cal = calibrate(model, env, max_tokens=max(s[3] for s in specs.values()), max_len=longest)
        cal["t_step_s"] = measure_t_step(model, optimizer, scheduler, env, cal)
        sets = {
            name: run_set(
                model,
                optimizer,
                scheduler,
                env,
                name,
                spec,
                cal,
                steps=args.steps,
                warmup=args.warmup,
                seed=args.seed,
                compare_weight=args.compare_weight,
            )
            for name, spec in specs.items()
        }
        result = {
            "device": str(env.device),
            "dp": env.dp_size,
            "model": info,
            "calibration": cal,
            "steps": args.steps,
            "memory_measure": "cuda_allocator_peak" if env.device.type == "cuda" else "saved_activation_bytes_peak",
            "sets": sets,
        }
        if env.is_main:
            print_table(result)
            if args.json:
                print(json.dumps(result))
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        shutdown_distributed(env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
