"""What both RL benchmarks share (``tools/bench/bench_rl_vs_trl.py``,
``tools/bench/profile_rl_step.py``): random Hugging Face Qwen3 models of named shapes with a
byte-level BPE tokenizer trained on the task's prompts, the GRPO demo's task, TRL's
``GRPOTrainer`` on it (``run_trl``), a run's step summary, and operators grouped by kind.
"""

from __future__ import annotations

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
REWARD = f"{REPO / 'configs' / 'grpo_demo' / 'reward.py'}:reward"


def parse_size(text: str) -> tuple[str, dict]:
    """``NAME=LAYERS,HIDDEN,FFN,HEADS,KV_HEADS`` -> (name, Qwen3 config fields)."""
    name, _, numbers = text.partition("=")
    values = [int(x) for x in numbers.split(",")]
    if not name or len(values) != 5:
        raise ValueError(f"--size {text!r}: expected NAME=LAYERS,HIDDEN,FFN,HEADS,KV_HEADS")
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    return name, dict(zip(keys, values))


def build_model(out: Path, shape: dict, prompts: Path = PROMPTS, seed: int = 0) -> Path:
    """A random Qwen3 of ``shape`` with a byte-level BPE tokenizer trained on the prompts (its
    vocabulary sizes the model), initialised from ``seed``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    texts = [r["prompt"] + " " + " ".join(str(v) for k, v in r.items() if k != "prompt") for r in rows]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    cfg = transformers.Qwen3Config(
        vocab_size=len(fast),
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out


OP_GROUPS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("norm_activation", ("rms_norm", "silu", "aten::pow", "aten::rsqrt", "aten::mean")),
    ("optimizer", ("Optimizer.step", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt")),
    ("sampling", ("aten::rand", "exponential", "multinomial", "searchsorted", "cumsum", "log_softmax")),
    ("copies", ("aten::copy_", "aten::cat", "aten::index", "aten::clone", "aten::contiguous", "aten::_to_copy")),
    ("collectives", ("c10d::", "gloo", "all_gather", "reduce_scatter", "all_reduce")),
    ("autograd_engine", ("autograd::engine", "Backward")),
    (
        "views_alloc",
        (
            "aten::empty",
            "aten::view",
            "as_strided",
            "transpose",
            "aten::slice",
            "aten::select",
            "aten::reshape",
            "aten::permute",
            "aten::expand",
            "aten::unsqueeze",
            "aten::squeeze",
            "aten::t",
            "aten::detach",
            "aten::alias",
            "aten::zeros",
            "aten::ones",
            "aten::full",
            "aten::fill_",
            "aten::zero_",
        ),
    ),
    (
        "elementwise",
        (
            "aten::add",
            "aten::mul",
            "aten::div",
            "aten::sub",
            "aten::neg",
            "aten::exp",
            "aten::log",
            "aten::where",
            "aten::masked_fill",
            "aten::sum",
            "aten::max",
            "aten::gather",
            "aten::eq",
            "aten::ne",
            "aten::lt",
            "aten::ge",
            "aten::isin",
            "aten::any",
            "aten::all",
            "aten::clamp",
        ),
    ),
)


def op_groups(averages, steps: int) -> dict:
    """Self CPU seconds a step by operator group (a name matching none is "other")."""
    out = {name: 0.0 for name, _ in OP_GROUPS} | {"other": 0.0}
    for event in averages:
        group = next((g for g, keys in OP_GROUPS if any(k in event.key for k in keys)), "other")
        out[group] += event.self_cpu_time_total / 1e6 / steps
    return out


def summary(parts: list[dict], rewards: list[float], proc_wall: float) -> dict:
    """Medians over the steps after the first; start-up is the process's wall time less its steps
    (imports, model build or load, the first weight sync, teardown), the same rule for both arms."""
    warm = parts[1:] or parts
    return {
        "s_per_step": statistics.median(p["step"] for p in warm),
        "step_s": [p["step"] for p in parts],
        "generate_s": statistics.median(p["generate"] for p in warm),
        "rest_s": statistics.median(p["rest"] for p in warm),
        "sync_s": statistics.median(p["sync"] for p in warm),
        "startup_s": proc_wall - sum(p["step"] for p in parts),
        "rewards": rewards,
        "reward_gain": (statistics.mean(rewards[-3:]) - statistics.mean(rewards[:3])) if len(rewards) >= 6 else None,
    }


TRL_WORKER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from backend.rl.reward import load_reward

model_dir, out_dir, steps, prompts, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
seed, per_step, samples, new_tokens, ops = (int(x) for x in sys.argv[6:11])
rows = [json.loads(l) for l in open(prompts) if l.strip()]
data = Dataset.from_list(rows)
fn = load_reward(spec)

def reward(prompts, completions, **columns):  # the same function our loop calls, on the same row
    names = [k for k in rows[0] if k != "prompt"]
    return [float(fn(p, c, {"prompt": p, **{k: columns[k][i] for k in names}})) for i, (p, c) in enumerate(zip(prompts, completions))]

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

profiler = None
class Clock(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        global profiler
        if ops and state.global_step == 1:  # the steps after the first, under the profiler (not timed)
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        timing["step_start"].append(time.perf_counter())
    def on_step_end(self, args, state, control, **kw):
        timing["step_end"].append(time.perf_counter())

cfg = GRPOConfig(
    output_dir=out_dir, per_device_train_batch_size=per_step * samples, num_generations=samples,
    max_completion_length=new_tokens, learning_rate=5e-3, lr_scheduler_type="constant", weight_decay=0.0,
    max_grad_norm=1.0, loss_type="dapo", beta=0.0, bf16=False, use_cpu=True, max_steps=steps, logging_steps=1,
    report_to=[], save_strategy="no", steps_per_generation=1, num_iterations=1, temperature=1.0, seed=seed,
    dataloader_num_workers=0,
)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=data, processing_class=tok)
trainer.add_callback(Clock())
trainer.train()
rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
result = {"timing": timing, "rewards": rewards}
if profiler is not None:
    from backend.bench.rl_task import op_groups
    profiler.__exit__(None, None, None)
    result["ops"] = op_groups(profiler.key_averages(), steps - 1)
print("TRL_JSON " + json.dumps(result))
"""


def run_trl(model_dir: Path, out: Path, args, seed: int, *, ops: bool = False) -> dict:
    """TRL's GRPOTrainer on ``model_dir`` in a fresh process on one thread (``args``: steps, prompts,
    reward, prompts_per_step, samples, new_tokens); with ``ops`` its operators by group
    (``op_groups``) over the steps after the first, under ``torch.profiler`` (then not a timing)."""
    start = time.time()
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(REPO)
    )
    numbers = [seed, args.prompts_per_step, args.samples, args.new_tokens, int(ops)]
    cmd = [sys.executable, "-c", TRL_WORKER, str(model_dir), str(out), str(args.steps), str(args.prompts), args.reward]
    proc = subprocess.run([*cmd, *map(str, numbers)], cwd=REPO, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"TRL failed:\n{proc.stderr[-4000:]}")
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("TRL_JSON "))[9:])
    t = result["timing"]
    steps_s = [b - a for a, b in zip(t["step_start"], t["step_end"])]
    parts = [{"step": s, "generate": g, "rest": s - g, "sync": 0.0} for g, s in zip(t["generate"], steps_s)]
    return {
        **summary(parts, result["rewards"], proc_wall=time.time() - start),
        **({"ops": result["ops"]} if ops else {}),
    }
