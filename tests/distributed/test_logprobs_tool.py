"""tools/compute_logprobs.py: a trained checkpoint's per-token log-probabilities, in input order;
it and tools/export_hf.py refuse a checkpoint of another model in one line (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from backend.distributed.launch import torchrun_command
from tests.conftest import REPO, TINY

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_cache):
    """A one-step run of the tiny config (hidden 64): its directory and the overrides that reach it."""
    run = tmp_path_factory.mktemp("logprobs_run") / "run"
    common = [f"data.cache_dir={embedded_cache}", f"logger.run_dir={run}"]
    train = subprocess.run(
        [sys.executable, "-m", "backend.train", TINY, *common, "train.train_iters=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    return run, common


def test_logprobs_tool_matches_across_layouts_and_keeps_order(tmp_path, trained):
    run, common = trained
    env = dict(os.environ, OMP_NUM_THREADS="1")
    samples = tmp_path / "samples.jsonl"
    texts = ["def f(x):\n    return x + 1\n", "a", "import os\nprint(os.getcwd())\n" * 3]
    samples.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    outs = []
    for nproc in (1, 2):
        out = tmp_path / f"lp{nproc}.jsonl"
        cmd = torchrun_command(
            nproc,
            "tools/compute_logprobs.py",
            TINY,
            *common,
            "train.forward_max_tokens_per_gpu=64",
            "--input",
            str(samples),
            "--output",
            str(out),
        )
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "step_00000001" in proc.stdout
        outs.append([json.loads(line) for line in out.read_text().splitlines()])
    for rows in outs:
        assert [r["index"] for r in rows] == [0, 1, 2]
        assert [len(r["logprobs"]) for r in rows] == [len(t.encode()) - 1 for t in texts]
        assert all(x <= 0 for r in rows for x in r["logprobs"])
    for a, b in zip(outs[0], outs[1]):
        assert max((abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])), default=0.0) <= 1e-5


@pytest.mark.parametrize("tool", ["compute_logprobs", "export_hf"])
def test_a_checkpoint_of_another_shape_is_one_error_line(tmp_path, trained, tool):
    """A 64-wide model's checkpoint read for a 128-wide config: ``error: PATH: NAME has shape ...``,
    exit 2, no traceback, before any tensor is read."""
    run, common = trained
    step = run / "checkpoints" / "step_00000001"
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"text": "abc"}) + "\n")
    if tool == "compute_logprobs":
        cmd = [sys.executable, "tools/compute_logprobs.py", TINY, *common, "model.hidden_size=128"]
        cmd += ["train.forward_max_tokens_per_gpu=64", "--input", str(samples), "--output", str(tmp_path / "o")]
    else:
        cmd = [sys.executable, "tools/export_hf.py", str(step), "model.hidden_size=128"]
        cmd += ["--output", str(tmp_path / "hf")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert str(step) in errors[0] and "has shape [" in errors[0] and "64" in errors[0] and "128" in errors[0]


class _Touch:
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch '{self.path}'",))


@pytest.mark.parametrize("tool", ["compute_logprobs", "export_hf"])
def test_a_planted_metadata_payload_is_one_error_line_and_never_runs(tmp_path, trained, tool):
    """The checkpoint's .metadata replaced by a pickle whose loading would run a command: both
    tools refuse it in one ``error:`` line naming the file (exit 2), and the command never runs."""
    import pickle
    import shutil

    run, common = trained
    step = tmp_path / "planted" / "step_00000001"
    shutil.copytree(run / "checkpoints" / "step_00000001", step)
    shutil.copy(run / "config.yaml", tmp_path / "planted" / "config.yaml")
    marker = tmp_path / "MARKER"
    (step / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    # The attacker writes the digests too (meta.json is theirs): the safe reader behind them refuses.
    from backend.checkpoint.integrity import file_digest

    meta = json.loads((step / "meta.json").read_text())
    meta["digests"]["files"][".metadata"] = file_digest(step / ".metadata")
    (step / "meta.json").write_text(json.dumps(meta))
    samples = tmp_path / "samples.jsonl"
    samples.write_text(json.dumps({"text": "abc"}) + "\n")
    if tool == "compute_logprobs":
        cmd = [sys.executable, "tools/compute_logprobs.py", TINY, *common, "train.forward_max_tokens_per_gpu=64"]
        cmd += ["--input", str(samples), "--output", str(tmp_path / "o"), "--checkpoint", str(step)]
    else:
        cmd = [sys.executable, "tools/export_hf.py", str(step), "--config", str(tmp_path / "planted" / "config.yaml")]
        cmd += ["--output", str(tmp_path / "hf")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not marker.exists()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{step}/.metadata" in errors[0] and "refusing" in errors[0], proc.stderr[-2000:]


def test_merge_as_writes_training_rows_a_policy_run_reads(tmp_path, embedded_cache):
    """--merge-as ref_logprobs: the input rows come back with the field added (entry 0 null), and a
    policy run with kl_coef reads them as data."""
    from backend.bench.rl_rows import rl_rows, write_rows
    from backend.config import load_config
    from backend.data.build import build_dataset
    from backend.data.row_fields import row_fields

    rows = rl_rows(5, seed=2, max_len=40)
    for row in rows:
        del row["ref_logprobs"]
    source = write_rows(tmp_path / "rollouts.jsonl", rows)
    out = tmp_path / "with_ref.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "tools/compute_logprobs.py", TINY, f"data.cache_dir={embedded_cache}"]
    cmd += ["train.forward_max_tokens_per_gpu=64", "--input", str(source), "--output", str(out)]
    cmd += ["--merge-as", "ref_logprobs"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = [json.loads(line) for line in out.read_text().splitlines()]
    assert [{k: v for k, v in m.items() if k != "ref_logprobs"} for m in merged] == rows
    for m in merged:
        assert m["ref_logprobs"][0] is None and len(m["ref_logprobs"]) == len(m["input_ids"])
        assert all(x <= 0 for x in m["ref_logprobs"][1:])
    overrides = [f"data.path={out}", "loss.type=policy", "loss.kl_coef=0.1"]
    cfg = load_config(TINY, overrides)
    dataset, _ = build_dataset(cfg.data, row_fields(cfg.loss))
    assert dataset[0].ref_logprobs is not None and dataset.ignored_fields == {"id": 5}
