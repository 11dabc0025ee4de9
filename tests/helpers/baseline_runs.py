"""Run the same jobs with one source tree and print their numbers as JSON (one object).

``python baseline_runs.py OUT.json WORKDIR [--pinned=kernels,sampler]`` with the working directory and ``PYTHONPATH`` at the
tree to measure: the quickstart's first 3 steps (loss, grad norm, valid loss), a packed dp 2 run
of the tiny test config, 6 steps of the GRPO demo (its reward first moves at step 4) (rewards and losses) and a policy worker's
log-probabilities of fixed rows. Every job is a subprocess of that tree, so a test can run the
script against an earlier commit and the current one and compare the numbers exactly (floats are
written with ``repr``: equal strings are equal bits). ``--pinned=WHAT`` runs every job through
``pinned_kernels.py`` with ``PINNED=WHAT`` (the paths from before the RL step's fast paths).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]  # the current tree: the configs every run reads
KEYS = ("loss", "grad_norm", "tokens", "num_microbatches", "reward_mean", "pg_loss", "entropy", "valid_loss")

LOGPROBS = r"""
import json, sys
import numpy as np
from backend.rl import PolicyWorker
rows = [{"input_ids": [(7 * i + 3 * j) % 200 + 1 for j in range(8 + 3 * i)], "loss_mask": [0] * 4 + [1] * (4 + 3 * i),
         "advantages": 0.5} for i in range(6)]
with PolicyWorker.from_config(sys.argv[1], sys.argv[2:]) as worker:
    row = worker.train_step(rows)
    out = {"loss": repr(row["loss"]), "grad_norm": repr(row["grad_norm"]),
           "logprobs": [[repr(float(x)) for x in lp[1:]] for lp in worker.logprobs(rows)]}
print("RESULT " + json.dumps(out))
"""


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: repr(r[k]) for k in KEYS if k in r} | {"step": r.get("step"), "event": r.get("event")} for r in rows]


def _run(cmd: list[str], env: dict) -> str:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done.stdout


PINNER = Path(__file__).resolve().with_name("pinned_kernels.py")


def main(out_path: str, workdir: str, pinned: str = "") -> None:
    work = Path(workdir)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    if pinned:
        env["PINNED"] = pinned
    cache = f"data.cache_dir={work / 'data_cache'}"
    py = sys.executable
    module = [py, str(PINNER)] if pinned else [py, "-m"]  # + the module to run
    results = {}

    run = work / "quickstart"
    _run(
        [
            *module,
            "backend.train",
            str(HERE / "configs/quickstart.yaml"),
            "train.train_iters=3",
            "train.eval_interval=3",
            "logger.log_interval=1",
            f"logger.run_dir={run}",
            cache,
        ],
        env,
    )
    results["quickstart"] = _rows(run / "metrics.jsonl")

    run = work / "packed_dp2"
    _run(
        [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            *(["--no-python", py, str(PINNER)] if pinned else ["-m"]),
            "backend.train",
            str(HERE / "tests/configs/tiny.yaml"),
            "train.dynamic_batch_layout=packed",
            f"logger.run_dir={run}",
            cache,
        ],
        env,
    )
    results["packed_dp2"] = _rows(run / "metrics.jsonl")

    demo = [
        f"rl.prompts={HERE / 'configs/grpo_demo/prompts.jsonl'}",
        f"rl.reward={HERE / 'configs/grpo_demo/reward.py'}:reward",
    ]
    run = work / "grpo"
    _run(
        [
            *module,
            "backend.rl",
            str(HERE / "configs/grpo_demo.yaml"),
            "train.train_iters=6",
            f"logger.run_dir={run}",
            *demo,
        ],
        env,
    )
    results["grpo"] = _rows(run / "metrics.jsonl")

    pin = f"import sys; sys.path.insert(0, {str(PINNER.parent)!r}); from pinned_kernels import pin; pin()\n"
    out = _run(
        [
            py,
            "-c",
            (pin if pinned else "") + LOGPROBS,
            str(HERE / "configs/grpo_demo.yaml"),
            f"logger.run_dir={work / 'worker'}",
            *demo,
        ],
        env,
    )
    results["worker"] = json.loads(out.split("RESULT ", 1)[1])
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    flags = [a.removeprefix("--pinned=") for a in sys.argv[3:] if a.startswith("--pinned=")]
    main(sys.argv[1], sys.argv[2], pinned=flags[0] if flags else "")
