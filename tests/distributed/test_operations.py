"""Operations on real torchrun process groups: exact resume after kill -9, atomic checkpoints,
preemption signals, refused layout changes, wandb offline logging, non-finite loss."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from backend.distributed.launch import torchrun_command
from tests.conftest import REPO, TINY
from tests.helpers.wandb_reader import history

# Every metrics.jsonl row holds at least these keys (the contract in docs/reference/metrics.md).
REQUIRED_KEYS = (
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "padded_tokens",
    "padding_efficiency",
    "num_microbatches",
    "oversize_singletons",
    "step_time_s",
    "tokens_per_s",
    "peak_memory_bytes",
)

pytestmark = pytest.mark.distributed

# Big enough that a step takes a noticeable time, so a kill lands where the test aims.
BASE = ["model.hidden_size=128", "train.global_batch_size=32", "train.train_iters=6", "scheduler.warmup_iters=2"]


def command(run_dir: Path, cache: str, overrides: list[str], nproc: int, max_restarts: int = 0) -> list[str]:
    launcher = torchrun_command(nproc, max_restarts=max_restarts)
    return [
        *launcher,
        "-m",
        "backend.train",
        TINY,
        *BASE,
        f"data.cache_dir={cache}",
        f"logger.run_dir={run_dir}",
        *overrides,
    ]


def start(
    run_dir: Path, cache: str, overrides: list[str] = (), nproc: int = 2, torchrun: bool = True, max_restarts: int = 0
) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / f"launch_{time.monotonic_ns()}.log", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = command(run_dir, cache, list(overrides), nproc, max_restarts)
    if not torchrun:  # one process, no launcher: python -m backend.train ...
        cmd = [sys.executable, *cmd[cmd.index("-m", 3) :]]
    return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_all(proc)
        raise


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(proc: subprocess.Popen) -> None:
    """kill -9 the launcher and every worker at once, as a node failure or Slurm's cgroup would."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(predicate, timeout: float = 240, poll: float = 0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := predicate():
            return value
        time.sleep(poll)
    raise AssertionError("timed out waiting for the run")


def logs(run_dir: Path) -> str:
    return "\n".join(p.read_text() for p in sorted(run_dir.glob("launch_*.log")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, embedded_cache):
    """Six uninterrupted steps (a checkpoint only at the end)."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert finish(start(run_dir, embedded_cache, ["checkpoint.interval=0"])) == 0, logs(run_dir)
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    return run_dir, rows


def same_steps(rows_a: list[dict], rows_b: list[dict], steps) -> None:
    a = {r["step"]: r for r in rows_a}
    b = {r["step"]: r for r in rows_b}
    for s in steps:
        assert (a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]), f"step {s} differs"


def test_kill9_during_step5_then_resume_is_bitwise_identical(tmp_path, embedded_cache, reference):
    proc = start(tmp_path, embedded_cache, ["checkpoint.interval=2"])
    wait_for(lambda: (tmp_path / "checkpoints" / "step_00000004" / "meta.json").exists() or proc.poll() is not None)
    kill_all(proc)
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3, 4], "the kill must land during step 5"
    assert finish(start(tmp_path, embedded_cache, ["checkpoint.interval=2"])) == 0, logs(tmp_path)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    same_steps(reference[1], rows, [1, 2, 3, 4, 5, 6])


def test_a_rank_killed_mid_step_restarts_the_group_from_the_last_checkpoint(tmp_path, embedded_cache, reference):
    """torchrun --max-restarts 1, rank 1 SIGKILLed during step 5 (after the step-4 checkpoint):
    torchrun stops rank 0, starts a new group, and that group resumes from step 4 and finishes;
    steps 5 and 6 equal the uninterrupted run's bitwise."""
    proc = start(tmp_path, embedded_cache, ["checkpoint.interval=2"], max_restarts=1)
    wait_for(lambda: (tmp_path / "checkpoints" / "step_00000004" / "meta.json").exists() or proc.poll() is not None)
    world = json.loads((tmp_path / "world.json").read_text())
    os.kill(next(w["pid"] for w in world if w["rank"] == 1), signal.SIGKILL)
    assert finish(proc) == 0, logs(tmp_path)
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_00000004'}" in logs(tmp_path)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    same_steps(reference[1], rows, [1, 2, 3, 4, 5, 6])


def test_kill9_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path_factory, embedded_cache, reference):
    for attempt in range(3):
        run_dir = tmp_path_factory.mktemp(f"ckpt_kill{attempt}")
        ckpt = run_dir / "checkpoints"
        proc = start(run_dir, embedded_cache, ["checkpoint.interval=1", "checkpoint.keep_last=0"])

        def writing(ckpt=ckpt, proc=proc):
            tmp = sorted(ckpt.glob(".tmp_step_*")) if ckpt.exists() else []
            return [t for t in tmp if int(t.name[-8:]) >= 3] or proc.poll() is not None

        found = wait_for(writing, poll=0.001)
        kill_all(proc)
        if found is True:
            continue
        step = int(found[0].name[-8:])
        if (ckpt / f"step_{step:08d}").exists():
            continue  # the rename won the race: the kill came after the commit point; try again
        complete = sorted(p.name for p in ckpt.glob("step_*"))
        assert complete[-1] == f"step_{step - 1:08d}", complete
        assert finish(start(run_dir, embedded_cache, ["checkpoint.interval=1"])) == 0, logs(run_dir)
        assert f"resumed from {ckpt / complete[-1]}" in logs(run_dir)
        rows = metrics(run_dir)
        assert rows[-1]["step"] == 6
        same_steps(reference[1], rows, range(step, 7))
        return
    pytest.fail("three attempts never killed the run in the middle of a checkpoint write")


def test_sigterm_saves_the_step_and_exits_zero(tmp_path, embedded_cache):
    proc = start(tmp_path, embedded_cache, ["checkpoint.interval=0"], nproc=1, torchrun=False)
    wait_for(lambda: len(metrics(tmp_path)) >= 2 or proc.poll() is not None)
    assert len(metrics(tmp_path)) == 2
    proc.send_signal(signal.SIGTERM)  # after step 2: the step boundary it reaches next saves (2 or 3)
    assert finish(proc) == 0, logs(tmp_path)
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and saved[0] in ("step_00000002", "step_00000003"), saved
    n = int(saved[0].removeprefix("step_"))
    assert [r["step"] for r in metrics(tmp_path)] == list(range(1, n + 1))
    assert f"stop signal (SIGTERM) received: saved step {n}" in logs(tmp_path)


def test_sigusr1_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, embedded_cache):
    proc = start(tmp_path, embedded_cache, ["checkpoint.interval=0"], nproc=2)
    wait_for(lambda: len(metrics(tmp_path)) >= 1 or proc.poll() is not None)
    world = json.loads((tmp_path / "world.json").read_text())
    os.kill(world[1]["pid"], signal.SIGUSR1)  # rank 1 only
    assert finish(proc) == 0, logs(tmp_path)
    steps = [r["step"] for r in metrics(tmp_path)]
    assert 1 <= steps[-1] < 6
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [f"step_{steps[-1]:08d}"]


def test_resume_with_a_different_dp_size_is_refused(embedded_cache, reference):
    run_dir = reference[0]
    proc = start(run_dir, embedded_cache, ["train.train_iters=8"], nproc=1)
    assert finish(proc) != 0
    assert "written with data-parallel size 2" in logs(run_dir) and "checkpoint.allow_dp_change" in logs(run_dir)


def test_wandb_offline_run_holds_every_metric_and_resumes_the_same_run(tmp_path, embedded_cache):
    wandb = ["logger.wandb.enable=true", "logger.wandb.mode=offline", "train.train_iters=3", "checkpoint.interval=0"]
    assert finish(start(tmp_path, embedded_cache, wandb, nproc=1)) == 0, logs(tmp_path)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    rows = history(runs[0])
    assert [r["_step"] for r in rows] == [1, 2, 3]
    diagnostics = ("padding_efficiency_min_rank", "rank_imbalance", "distinct_shapes", "empty_microbatches")
    for row in rows:
        assert set(REQUIRED_KEYS) - {"step"} <= row.keys() and set(diagnostics) <= row.keys()
    assert finish(start(tmp_path, embedded_cache, [*wandb, "train.train_iters=4"], nproc=1)) == 0, logs(tmp_path)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and runs[0].name == runs[1].name, "the resumed run continues the same wandb run id"
    assert [r["_step"] for r in history(runs[1])] == [4]


def test_non_finite_loss_stops_before_the_update_naming_the_step(tmp_path):
    data = tmp_path / "huge.jsonl"
    data.write_text(
        json.dumps({"input_ids": [1, 2, 3, 4], "loss_weight": [1e38] * 4}) + "\n" + json.dumps({"text": "ok ok"}) + "\n"
    )
    overrides = [f"data.path={data}", "train.global_batch_size=2", "train.max_tokens_per_gpu=64"]
    proc = start(tmp_path / "run", "unused", overrides, nproc=1)
    assert finish(proc) != 0
    assert "step 1: non-finite loss" in logs(tmp_path / "run")
