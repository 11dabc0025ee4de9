#!/usr/bin/env python3
"""Load time and per-rank peak memory of a Hugging Face import into the FSDP2-sharded model.

    python tools/bench/bench_hf_load.py [--nproc 2] [--layers 24] [--hidden 1024] [--dtype bf16] [--json]

Writes a random Qwen3-style checkpoint (default: hidden 1024, 24 layers, 16 heads of 128, 8 KV
heads, FFN 3072, vocabulary 151,936, tied: 0.52B parameters, 1.05 GB in BF16) to a temporary
directory, without ever holding it whole (random tensors streamed into safetensors shards),
then loads it with ``build_model`` (``model.hf_checkpoint``) under torchrun at dp = --nproc and
reports, per rank: seconds from the start of ``build_model`` to a loaded model, the process's
resident memory before the build and its peak (ru_maxrss) after, beside the model's size in
bytes (FP32 in memory, --dtype on disk).

Measured on a 2-core CPU machine (BF16 checkpoint, dp 2): 6.9 s per rank; RSS 0.43 GB before,
2.48 GB peak; anonymous memory after the load 1.46 GB, i.e. +1.03 GB = the rank's 1.07 GB FP32
shard. The rest of the peak is mostly clean file-backed pages of the memory-mapped safetensors (shared
page cache, released when the file closes) plus one parameter in flight: no rank allocates the 2.13 GB model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _status_bytes(field: str) -> int:
    """A line of /proc/self/status (RssAnon: private memory; RssFile: mapped file pages)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write_random_checkpoint(out: Path, *, layers: int, hidden: int, dtype: str, seed: int = 0) -> dict:
    """A random Qwen3 checkpoint in ``out``; returns its config.json as a dict."""
    import torch
    import transformers

    from backend.model.hf.safetensors_io import write_sharded

    cfg = transformers.Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in transformers.AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    shapes.pop("lm_head.weight", None)  # tied
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(seed)

    def tensors():
        for name, shape in shapes.items():
            t = torch.ones(shape) if "norm" in name else 0.02 * torch.randn(shape, generator=g)
            yield name, t.to(torch_dtype)

    write_sharded(tensors(), out, max_shard_bytes=1_000_000_000)
    cfg.save_pretrained(out)
    return json.loads((out / "config.json").read_text())


def worker(hf_dir: str, out: str) -> int:
    """One rank, inside torchrun: build_model from the checkpoint, record time and memory."""
    import logging

    from backend.config import load_config, validate
    from backend.distributed.collectives import all_gather_objects
    from backend.distributed.setup import init_distributed, shutdown_distributed
    from backend.model.factory import build_model

    logging.getLogger("megatron").setLevel(logging.WARNING)
    overrides = [
        f"model.hf_checkpoint={hf_dir}",
        "data.tokenizer=byte",
        "train.precision=fp32",
        "data.max_seq_length=4096",
    ]
    cfg = validate(load_config(None, overrides), int(os.environ["WORLD_SIZE"]))
    env = init_distributed(1, "auto")
    try:
        before, peak_before = _rss_bytes(), _peak_rss_bytes()
        start = time.perf_counter()
        built = build_model(cfg, env, tokenizer_vocab=256, training=False)
        seconds = time.perf_counter() - start
        local = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in built.model.parameters()
        )
        mine = {
            "rank": env.rank,
            "load_s": seconds,
            "rss_before_bytes": before,
            "peak_rss_before_bytes": peak_before,
            "peak_rss_bytes": _peak_rss_bytes(),
            "rss_anon_after_bytes": _status_bytes("RssAnon"),
            "rss_file_after_bytes": _status_bytes("RssFile"),
            "local_shard_bytes": local,
            "num_parameters": built.num_parameters,
        }
        ranks = all_gather_objects(mine, group=env.group("world"))
        if env.is_main:
            Path(out).write_text(json.dumps(ranks))
    finally:
        shutdown_distributed(env)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    from backend.distributed.launch import torchrun_command

    with tempfile.TemporaryDirectory(prefix="bench_hf_load_") as tmp:
        hf_dir = Path(tmp) / "hf"
        start = time.perf_counter()
        write_random_checkpoint(hf_dir, layers=args.layers, hidden=args.hidden, dtype=args.dtype)
        write_s = time.perf_counter() - start
        disk = sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
        out = Path(tmp) / "ranks.json"
        cmd = torchrun_command(args.nproc, str(Path(__file__).resolve()), "--worker", str(hf_dir), str(out))
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            return 1
        ranks = json.loads(out.read_text())
    n = ranks[0]["num_parameters"]
    result = {
        "num_parameters": n,
        "model_fp32_bytes": 4 * n,
        "checkpoint_bytes_on_disk": disk,
        "checkpoint_dtype": args.dtype,
        "write_checkpoint_s": write_s,
        "nproc": args.nproc,
        "ranks": ranks,
    }
    gb = 1e9
    print(
        f"model: {n / 1e9:.3f}B parameters, {4 * n / gb:.2f} GB in FP32; checkpoint {disk / gb:.2f} GB ({args.dtype})"
    )
    head = ("rank", "load s", "RSS before", "peak RSS", "peak-before", "FP32 shard", "anon after", "file after")
    print(" ".join(f"{h:>11}" for h in head) + "   (GB)")
    for r in ranks:
        cells = [r["rss_before_bytes"], r["peak_rss_bytes"], r["peak_rss_bytes"] - r["rss_before_bytes"]]
        cells += [r["local_shard_bytes"], r["rss_anon_after_bytes"], r["rss_file_after_bytes"]]
        print(f"{r['rank']:>11} {r['load_s']:>11.2f} " + " ".join(f"{c / gb:>11.2f}" for c in cells))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(*sys.argv[2:4]))
    sys.exit(main())
