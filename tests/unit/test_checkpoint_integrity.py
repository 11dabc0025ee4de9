"""Checkpoint digests: every file of a step is hashed at save (xxh3_128 in meta.json) and checked
on load. A byte flipped in the middle of a tensor's data is refused, naming the step, the file and
both digests: resume falls back to the previous step, the tools exit 2 with one line. A missing
file and a malformed digest entry are refused too; a checkpoint written before digests loads."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from backend.checkpoint.integrity import CheckpointIntegrityError, file_digest, step_files
from backend.checkpoint.store import load_model_weights
from backend.config import load_config, validate
from backend.train.trainer import Trainer
from tests.conftest import REPO, TINY
from tests.helpers.in_process import train_in_process
from tests.helpers.subprocess_env import subprocess_env

STEP1, STEP2 = "step_00000001", "step_00000002"


@pytest.fixture
def run(world, tmp_path, embedded_cache):
    """A tiny run's directory with checkpoints of steps 1 and 2."""
    run_dir = tmp_path / "run"
    train_in_process(world, run_dir, ["train.train_iters=2", "checkpoint.interval=1"])
    return run_dir


def _resume(world, run_dir, caplog) -> tuple[int, str]:
    cfg = validate(load_config(TINY, [f"logger.run_dir={run_dir}", "train.train_iters=3", "logger.log_interval=1000"]))
    with caplog.at_level(logging.INFO):
        trainer = Trainer(cfg, world)
    trainer.metrics.close()
    for lock in trainer.locks:
        lock.release()
    return trainer.step, " ".join(r.getMessage() for r in caplog.records)


def _flip_a_byte_inside_the_largest_shard(step_dir):
    shard = max((p for p in step_dir.glob("*.distcp")), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # the middle of the tensors' data
    shard.write_bytes(bytes(data))
    return shard


def test_every_file_has_its_digest(run):
    meta = json.loads((run / "checkpoints" / STEP2 / "meta.json").read_text())
    step_dir = run / "checkpoints" / STEP2
    assert meta["digests"]["algorithm"] == "xxh3_128"
    assert sorted(meta["digests"]["files"]) == step_files(step_dir) and ".metadata" in meta["digests"]["files"]
    assert all(file_digest(step_dir / n) == d for n, d in meta["digests"]["files"].items())


def test_a_flipped_byte_is_refused_and_resume_falls_back(world, run, caplog, tmp_path):
    shard = _flip_a_byte_inside_the_largest_shard(run / "checkpoints" / STEP2)
    step, logs = _resume(world, run, caplog)
    assert step == 1, "resumed from the damaged checkpoint"
    assert f"cannot resume from {run / 'checkpoints' / STEP2}" in logs and f"{shard}: xxh3_128 digest" in logs
    assert "was written" in logs and "trying the previous checkpoint" in logs
    # the export tool refuses it in one line, exit 2
    out = subprocess.run(
        [sys.executable, "tools/export_hf.py", str(run / "checkpoints" / STEP2), "--output", str(tmp_path / "hf")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "damaged" in last and shard.name in last and "Traceback" not in out.stderr
    # the verifier names the damaged step and passes the good one
    from backend.commands.verify_checkpoint import main as verify

    assert verify([str(run)]) == 1
    assert verify([str(run / "checkpoints" / STEP1)]) == 0
    out = subprocess.run(  # the same command by its path, as the users call it
        [sys.executable, "tools/verify_checkpoint.py", str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert out.returncode == 1 and STEP2 in out.stdout + out.stderr, out.stdout + out.stderr
    assert verify([str(tmp_path / "nothing")]) == 2


def test_a_missing_file_and_a_malformed_digest_are_refused(world, run, caplog):
    step2 = run / "checkpoints" / STEP2
    (step2 / "rng_rank0.pt").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"rng_rank0.pt: missing \(expected xxh3_128 "):
        load_model_weights(Trainer.__new__(Trainer), step2)  # refused before any tensor is read
    meta_file = run / "checkpoints" / STEP1 / "meta.json"
    meta = json.loads(meta_file.read_text())
    meta["digests"]["files"][".metadata"] = "not a digest"
    meta_file.write_text(json.dumps(meta))
    from backend.checkpoint.resume import NoUsableCheckpointError

    with pytest.raises(NoUsableCheckpointError) as e:  # neither step is usable: named, nothing trained
        _resume(world, run, caplog)
    assert "has digests that are not" in str(e.value) and "rng_rank0.pt: missing" in str(e.value)


def test_a_checkpoint_without_digests_loads_with_a_notice(world, run, caplog):
    meta_file = run / "checkpoints" / STEP2 / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["digests"]
    meta_file.write_text(json.dumps(meta))
    step, logs = _resume(world, run, caplog)
    assert step == 2 and "written before checkpoints carried digests" in logs
