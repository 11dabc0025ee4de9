"""``PolicyWorker`` against the CLI and the tools, at dp 1 and dp 2 (packed), real gloo ranks:

- ``train_step(rows)`` is the CLI's step on the same rows, bitwise (loss, grad norm, weights);
- ``logprobs(rows)`` equals ``tools/compute_logprobs.py`` on the same weights;
- ``hf_weights()`` equals the files ``tools/export_hf.py`` writes, bitwise (fp32 and bf16);
- a worker's checkpoint resumes in ``from_config`` (step and caller state back).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from backend.bench.rl_rows import rl_rows, write_rows
from tests.conftest import REPO, TINY

from .harness import run_ranks

pytestmark = pytest.mark.distributed

ROWS = 12
COMMON = [
    "data.max_seq_length=128",
    f"train.global_batch_size={ROWS}",
    "loss.type=policy",
    "loss.kl_coef=0.05",
    "loss.entropy_coef=0.01",
    "loss.ratio_clip_high=0.28",
    "train.dynamic_batch_enable=true",
    "train.max_tokens_per_gpu=256",
    "train.forward_max_tokens_per_gpu=128",
    "scheduler.warmup_iters=0",
    "optimizer.lr=0.01",
    f"rl.prompts={REPO / 'configs/grpo_demo/prompts.jsonl'}",
    f"rl.reward={REPO / 'configs/grpo_demo/reward.py'}:reward",
    "rl.prompts_per_step=5",
    "rl.samples_per_prompt=3",
    "rl.max_new_tokens=6",
]
LAYOUTS = {1: "padded", 2: "packed"}


def _params(model) -> torch.Tensor:
    return torch.cat(
        [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1) for p in model.parameters()]
    )


def _rank(rank: int, world: int, tmp: str, rows_path: str) -> dict | None:
    from pathlib import Path

    from backend.config import load_config, validate
    from backend.data.sampler import WindowSampler
    from backend.distributed.setup import init_distributed
    from backend.logging.metrics import read_metrics
    from backend.rl import PolicyWorker
    from backend.train.trainer import Trainer

    layout = [f"train.dynamic_batch_layout={LAYOUTS[world]}"]
    cli_dir, worker_dir = Path(tmp) / "cli", Path(tmp) / "worker"
    overrides = [*COMMON, *layout, f"data.path={rows_path}", "train.train_iters=1"]
    env = init_distributed(1)
    trainer = Trainer(validate(load_config(TINY, [*overrides, f"logger.run_dir={cli_dir}"]), world), env)
    trainer.train()
    trainer.metrics.close()
    cli_row = read_metrics(cli_dir / "metrics.jsonl")[0][0] if rank == 0 else None
    cli_params = _params(trainer.model)

    rows = [json.loads(line) for line in Path(rows_path).read_text().splitlines()]
    # the CLI's window order (its sampler's permutation): the same microbatches, so bitwise sums
    order = WindowSampler(len(rows), ROWS, trainer.cfg.train.seed).next_window()
    for lock in trainer.locks:
        lock.release()
    worker = PolicyWorker.from_config(TINY, [*overrides, f"logger.run_dir={worker_dir}"], env=env)
    as_arrays = [{k: (np.asarray(v, dtype=float) if k.endswith("logprobs") else v) for k, v in r.items()} for r in rows]
    out = worker.train_step([as_arrays[i] for i in order])
    same_params = torch.equal(cli_params, _params(worker.trainer.model))
    logprobs = worker.logprobs(rows)
    # rows refused on one rank only: every rank raises (none waits forever in a collective)
    bad = [dict(r) for r in rows]
    if rank == world - 1:
        bad[3]["loss_mask"] = [2] * len(bad[3]["input_ids"])
    try:
        worker.logprobs(bad)
        refused = None
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    hf = {name: t.clone() for name, t in worker.hf_weights()}
    hf_bf16 = {name: t.clone() for name, t in worker.hf_weights(torch.bfloat16)}
    meta = worker.weight_metadata()
    state = {
        "prompts": {
            "sampler": {"consumed": 5, "seed": 1234, "num_samples": 64, "global_batch_size": 5, "shuffle": True}
        }
    }
    step_dir = worker.save({**state, "note": [1, 2]})  # the loop's prompt stream, and a note of the caller's own
    worker.close()
    again = PolicyWorker.from_config(TINY, [*overrides, f"logger.run_dir={worker_dir}", "train.train_iters=2"], env=env)
    resumed = (
        again.step,
        again.resumed_state,
        torch.equal(_params(again.trainer.model), _params(worker.trainer.model)),
    )
    # The GRPO loop's rollouts: prompts split over the ranks, gathered, every rank the same rows.
    from backend.generators.hf import HFGenerator
    from backend.rl.loop import GRPOLoop

    rollouts, _ = GRPOLoop(again, HFGenerator.from_worker(again)).rollouts(step=2)
    again.close()
    if rank:
        return None
    return dict(
        cli=cli_row,
        worker=out,
        same_params=same_params,
        logprobs=logprobs,
        hf=hf,
        hf_bf16=hf_bf16,
        meta=meta,
        step_dir=str(step_dir),
        resumed=resumed,
        mbs=out["num_microbatches"],
        rollouts=rollouts,
        refused=refused,
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_worker")
    rows = write_rows(tmp / "rows.jsonl", rl_rows(ROWS, seed=11, max_len=90))
    out = {}
    for world in (1, 2):
        (tmp / f"dp{world}").mkdir()
        out[world] = run_ranks(_rank, world, tmp / f"dp{world}", str(tmp / f"dp{world}"), str(rows), timeout=400)[0]
    return rows, out


@pytest.mark.parametrize("world", [1, 2])
def test_train_step_is_the_cli_step_bitwise(results, world):
    r = results[1][world]
    for key in ("loss", "grad_norm", "pg_loss", "kl", "entropy", "clipfrac", "tokens", "num_microbatches"):
        assert r["worker"][key] == r["cli"][key], key
    assert r["same_params"]
    assert r["worker"]["clipfrac"] > 0  # not vacuous


def _tool(args: list[str], world: int = 1) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("world", [1, 2])
def test_logprobs_equal_the_compute_logprobs_tool(results, tmp_path, world):
    """The tool (one process, padded) on the worker's checkpoint: bitwise the dp 1 worker's
    values (same plan); the dp 2 packed worker's within FP32 rounding of another plan."""
    rows, by_world = results
    r = by_world[world]
    out = tmp_path / "merged.jsonl"
    overrides = [*COMMON, f"data.path={rows}", "train.dynamic_batch_layout=padded"]
    _tool(
        ["tools/compute_logprobs.py", TINY, *overrides, "--input", str(rows), "--output", str(out)]
        + ["--checkpoint", r["step_dir"], "--merge-as", "old_logprobs"]
    )
    tool = [json.loads(line)["old_logprobs"] for line in out.read_text().splitlines()]
    assert len(tool) == len(r["logprobs"]) == ROWS
    for mine, theirs in zip(r["logprobs"], tool):
        assert np.isnan(mine[0]) and theirs[0] is None and len(mine) == len(theirs)
        theirs = np.asarray(theirs[1:], dtype=np.float32)
        if world == 1:
            assert np.array_equal(mine[1:], theirs)  # same weights, same plan: bitwise
        else:
            assert np.max(np.abs(mine[1:] - theirs)) <= 1e-6 * np.max(np.abs(theirs))


def test_hf_weights_equal_the_exported_files_bitwise(results, tmp_path):
    from safetensors.torch import load_file

    r = results[1][2]  # trained at dp 2, exported by the tool in a world of one
    for dtype, stream in (("fp32", r["hf"]), ("bf16", r["hf_bf16"])):
        out = tmp_path / dtype
        _tool(["tools/export_hf.py", r["step_dir"], "--output", str(out), "--dtype", dtype])
        files = {}
        for f in sorted(out.glob("*.safetensors")):
            files.update(load_file(f))
        assert list(stream) == [name for name, _, _ in r["meta"]]
        assert set(files) == set(stream)
        for name, tensor in stream.items():
            assert files[name].dtype == tensor.dtype and torch.equal(files[name], tensor), name
    assert [(n, d, s) for n, d, s in r["meta"]] == [(n, t.dtype, tuple(t.shape)) for n, t in r["hf"].items()]


@pytest.mark.parametrize("world", [1, 2])
def test_a_worker_checkpoint_resumes_with_the_callers_state(results, world):
    step, state, same = results[1][world]["resumed"]
    assert step == 1 and state["note"] == [1, 2] and state["prompts"]["sampler"]["consumed"] == 5 and same


def test_the_loops_rollouts_do_not_depend_on_the_number_of_ranks(results):
    """Five prompts over two ranks (3 + 2), gathered: the same rows, in the same order, as one rank
    (each prompt's sampling seed depends on the seed, the step and its place only)."""
    one, two = results[1][1]["rollouts"], results[1][2]["rollouts"]
    assert len(one) == len(two) == 15
    for a, b in zip(one, two):
        assert {k: a[k] for k in ("input_ids", "loss_mask", "advantages")} == {
            k: b[k] for k in ("input_ids", "loss_mask", "advantages")
        }
        # the sampler's numbers: weights trained at dp 1 and dp 2 differ by FP32 rounding only, and
        # each rank prefills its own prompts, left-padded to its own longest (measured 2.0e-5 on
        # log-probabilities near -5: 4e-6 relative)
        diff = np.nanmax(np.abs(np.asarray(a["rollout_logprobs"]) - np.asarray(b["rollout_logprobs"])))
        assert diff <= 5e-5, diff
    assert len({tuple(r["input_ids"]) for r in one}) > 5  # real samples, not one repeated


@pytest.mark.parametrize("world", [1, 2])
def test_rows_refused_on_one_rank_raise_on_every_rank(results, world):
    refused = results[1][world]["refused"]  # rank 0's view: the bad rows were on the last rank
    assert refused is not None and "rows[3]" in refused and "loss_mask" in refused, refused
    if world == 2:
        assert "refused on rank 1" in refused
