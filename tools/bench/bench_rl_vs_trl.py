#!/usr/bin/env python3
"""Our GRPO loop against TRL's ``GRPOTrainer`` on the same model, prompts, reward and settings.

Each size builds one random Hugging Face Qwen3 (``save_pretrained``, a byte-level BPE tokenizer
trained here) and runs both loops on it, each in a fresh process on one thread, FP32 on the CPU:
the GRPO demo's task (``configs/grpo_demo``: copy a three-letter word, reward = letters right),
8 prompts x 8 samples a step, 8 new tokens, temperature 1, one optimizer step per generation, the
token-mean loss (TRL's ``loss_type="dapo"``), no KL, learning rate 5e-3. Reported per arm: the
median seconds a step (after the first), its generation, training and weight-sync parts, the
start-up (process start to the first step's start), and the reward curve.

    python tools/bench/bench_rl_vs_trl.py [--sizes tiny,medium] [--steps 10] [--json]

TRL is an optional extra (``pip install -e '.[trl]'``). Where a part is not separately visible in
TRL (its weight sync is none: it generates with the training model), it is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = {
    "tiny": dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    ),
    "medium": dict(
        num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4
    ),
}
PROMPTS = REPO / "configs" / "grpo_demo" / "prompts.jsonl"


def build_model(out: Path, size: str, seed: int = 0) -> Path:
    """A random Qwen3 of ``size`` with a byte-level BPE tokenizer (its vocabulary sizes the model)."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(words, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    cfg = transformers.Qwen3Config(
        vocab_size=len(fast),
        head_dim=SIZES[size]["hidden_size"] // SIZES[size]["num_attention_heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **SIZES[size],
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


def run_ours(model_dir: Path, run_dir: Path, steps: int) -> dict:
    start = time.time()
    cmd = [
        sys.executable,
        "-m",
        "backend.rl",
        str(REPO / "configs" / "grpo_demo.yaml"),
        f"model.hf_checkpoint={model_dir}",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        f"train.train_iters={steps}",
        "rl.max_new_tokens=8",
        "checkpoint.interval=0",
        f"logger.run_dir={run_dir}",
        "logger.log_interval=1000",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"our loop failed:\n{proc.stderr[-4000:]}")
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    parts = [
        {
            "generate": r["generate_s"],
            "train": r["step_time_s"] + r.get("logprobs_s", 0.0),
            "sync": r.get("weight_sync_s", 0.0),
        }
        for r in rows
    ]
    return _summary(parts, [r["reward_mean"] for r in rows], proc_wall=time.time() - start)


def _summary(parts: list[dict], rewards: list[float], proc_wall: float) -> dict:
    """Medians over the steps after the first; start-up is the process's wall time less its steps
    (imports, model build or load, the first weight sync, teardown), the same rule for both arms."""
    warm = parts[1:] or parts
    step = [p["generate"] + p["train"] + p["sync"] for p in warm]
    return {
        "s_per_step": statistics.median(step),
        "generate_s": statistics.median(p["generate"] for p in warm),
        "train_s": statistics.median(p["train"] for p in warm),
        "sync_s": statistics.median(p["sync"] for p in warm),
        "startup_s": proc_wall - sum(p["generate"] + p["train"] + p["sync"] for p in parts),
        "rewards": rewards,
        "reward_gain": (statistics.mean(rewards[-3:]) - statistics.mean(rewards[:3])) if len(rewards) >= 6 else None,
    }


TRL_WORKER = r"""
import json, sys, time
start = float(sys.argv[4])
import torch
torch.set_num_threads(1)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

model_dir, out_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(l) for l in open(sys.argv[5])]
data = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

def reward(prompts, completions, answer, **_):
    return [sum(a == b for a, b in zip(c, w)) / len(w) for c, w in zip(completions, answer)]

tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
timing = {"generate": [], "step_start": [], "step_end": []}
original = model.generate
def timed_generate(*a, **k):
    t = time.perf_counter()
    out = original(*a, **k)
    timing["generate"].append(time.perf_counter() - t)
    return out
model.generate = timed_generate

class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        timing["step_start"].append(time.perf_counter())
    def on_step_end(self, args, state, control, **kw):
        timing["step_end"].append(time.perf_counter())

cfg = GRPOConfig(
    output_dir=out_dir, per_device_train_batch_size=64, num_generations=8, max_completion_length=8,
    learning_rate=5e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, loss_type="dapo",
    beta=0.0, bf16=False, use_cpu=True, max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
    steps_per_generation=1, num_iterations=1, temperature=1.0, seed=1234, dataloader_num_workers=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok)
trainer.add_callback(Clock())
trainer.train()
rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
print("TRL_JSON " + json.dumps({"timing": timing, "rewards": rewards}))
"""


def run_trl(model_dir: Path, out: Path, steps: int) -> dict:
    start = time.time()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-c", TRL_WORKER, str(model_dir), str(out), str(steps), str(start), str(PROMPTS)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"TRL failed:\n{proc.stderr[-4000:]}")
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("TRL_JSON "))[9:])
    t = result["timing"]
    steps_s = [b - a for a, b in zip(t["step_start"], t["step_end"])]
    parts = [{"generate": g, "train": s - g, "sync": 0.0} for g, s in zip(t["generate"], steps_s)]
    return _summary(parts, result["rewards"], proc_wall=time.time() - start)


def _table(results: dict) -> str:
    lines = [
        f"{'size':<7} {'arm':<5} {'s/step':>8} {'generate':>9} {'train':>8} {'sync':>7} {'start-up':>9} "
        f"{'ours/TRL':>9} {'reward gain':>12}"
    ]
    for size, arms in results.items():
        for name, r in arms.items():
            ratio = arms["ours"]["s_per_step"] / arms["trl"]["s_per_step"] if name == "ours" else 1.0
            gain = r["reward_gain"]
            lines.append(
                f"{size:<7} {name:<5} {r['s_per_step']:>8.3f} {r['generate_s']:>9.3f} {r['train_s']:>8.3f} "
                f"{r['sync_s']:>7.3f} {r['startup_s']:>9.2f} {ratio:>8.2f}x {gain if gain is not None else float('nan'):>12.3f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,medium")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="runs/bench_rl_vs_trl")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        print("error: TRL is not installed (pip install -e '.[trl]')", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    results = {}
    for size in args.sizes.split(","):
        model_dir = build_model(out / size / "model", size)
        results[size] = {
            "ours": run_ours(model_dir, out / size / f"ours_{time.time_ns()}", args.steps),
            "trl": run_trl(model_dir, out / size / "trl", args.steps),
        }
    print(_table(results))
    if args.json:
        print(json.dumps({"steps": args.steps, "sizes": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
