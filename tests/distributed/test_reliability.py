"""Nothing runs code, nothing is lost, nothing is silent: each hostile case as a user meets it,
through the real command line (one process, no launcher, to keep each case to a few seconds)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY
from tests.distributed.test_operations import finish, logs, metrics, start, wait_for

pytestmark = pytest.mark.distributed

SHORT = ["train.train_iters=2", "checkpoint.interval=0"]


def one(run_dir: Path, cache: str, overrides: list[str]) -> subprocess.Popen:
    return start(run_dir, cache, overrides, nproc=1, torchrun=False)


def steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in metrics(run_dir)]


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_metadata_payload_never_runs(tmp_path, embedded_cache):
    run = tmp_path / "run"
    assert finish(one(run, embedded_cache, SHORT)) == 0, logs(run)
    metadata = run / "checkpoints" / "step_00000002" / ".metadata"
    marker = tmp_path / "PWNED"
    metadata.write_bytes(pickle.dumps(_Payload(marker)))
    assert finish(one(run, embedded_cache, ["train.train_iters=3", "checkpoint.interval=0"])) == 2
    assert not marker.exists(), "the checkpoint ran code"
    assert f"{metadata}" in logs(run) and "error:" in logs(run)


def test_a_second_run_on_the_same_directory_is_refused_and_the_first_is_untouched(tmp_path, embedded_cache):
    run = tmp_path / "run"
    first = one(run, embedded_cache, ["train.train_iters=500", "checkpoint.interval=0"])
    wait_for(lambda: len(metrics(run)) >= 1 or first.poll() is not None)
    config_before = (run / "config.yaml").read_text()
    second = one(run, embedded_cache, ["train.train_iters=500", "optimizer.lr=0.1"])
    assert finish(second) == 2
    assert first.poll() is None, "the first run must still be running, untouched"
    assert f"already in use by another run (pid {first.pid} on host" in logs(run)
    first.send_signal(signal.SIGTERM)  # stop the first run cleanly: it saves where it is
    assert finish(first) == 0, logs(run)
    done = steps(run)
    assert done == list(range(1, len(done) + 1))  # one run's rows, each step once
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [f"step_{done[-1]:08d}"]
    assert (run / "config.yaml").read_text() == config_before


def test_resume_applies_a_new_lr_and_refuses_a_model_change(tmp_path, embedded_cache):
    from backend.train.optim import lr_at

    run = tmp_path / "run"
    base = ["scheduler.warmup_iters=0", "optimizer.min_lr=0.0", "checkpoint.interval=0"]
    assert finish(one(run, embedded_cache, [*base, "train.train_iters=2", "optimizer.lr=0.001"])) == 0, logs(run)
    refused = one(run, embedded_cache, [*base, "train.train_iters=3", "model.hidden_size=96"])
    assert finish(refused) == 2
    assert "model.hidden_size: 128 -> 96" in logs(run)
    assert finish(one(run, embedded_cache, [*base, "train.train_iters=3", "optimizer.lr=0.01"])) == 0, logs(run)
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["lr"] == pytest.approx(lr_at(2, lr=0.01, min_lr=0.0, warmup=0, total=3), rel=1e-12)
    assert "optimizer.lr: 0.001 -> 0.01" in logs(run)


def test_a_window_without_loss_tokens_is_an_error_and_no_update(tmp_path):
    data = tmp_path / "masked.jsonl"
    rows = [{"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 0, 0]} for _ in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    overrides = [f"data.path={data}", "train.global_batch_size=4", "train.max_tokens_per_gpu=64", *SHORT]
    assert finish(one(run, "unused", overrides)) == 2
    text = logs(run)
    assert "step 1" in text and "hold no loss tokens" in text and str(data) in text
    assert not (run / "checkpoints").exists() and steps(run) == []


def test_ctrl_c_saves_and_a_restart_logs_each_step_once(tmp_path, embedded_cache):
    run = tmp_path / "run"
    proc = one(run, embedded_cache, ["train.train_iters=50", "checkpoint.interval=0"])
    wait_for(lambda: len(metrics(run)) >= 2 or proc.poll() is not None)
    proc.send_signal(signal.SIGINT)  # after step 2: the step boundary it reaches next saves (2, 3 or later)
    assert finish(proc) == 130, logs(run)
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert len(saved) == 1, saved
    n = int(saved[0].removeprefix("step_"))
    assert n >= 2 and steps(run) == list(range(1, n + 1)), logs(run)
    with (run / "metrics.jsonl").open("a") as f:  # a crash mid-write after the checkpoint
        f.write(f'{{"step": {n + 1}, "loss": 1.0}}\n{{"step": {n + 2}, "lo')
    assert finish(one(run, embedded_cache, [f"train.train_iters={n + 2}", "checkpoint.interval=0"])) == 0, logs(run)
    assert steps(run) == list(range(1, n + 3))


@pytest.mark.parametrize("damage", ["truncated_distcp", "corrupt_meta"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, embedded_cache, damage):
    run = tmp_path / "run"
    overrides = ["train.train_iters=4", "checkpoint.interval=2", "checkpoint.keep_last=0"]
    assert finish(one(run, embedded_cache, overrides)) == 0, logs(run)
    newest = run / "checkpoints" / "step_00000004"
    if damage == "truncated_distcp":
        shard = sorted(newest.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        (newest / "meta.json").write_text("{not json")
    assert finish(one(run, embedded_cache, ["train.train_iters=5", "checkpoint.interval=0"])) == 0, logs(run)
    text = logs(run)
    assert f"cannot resume from {newest}" in text
    assert f"resumed from {run / 'checkpoints' / 'step_00000002'}" in text
    assert steps(run) == [1, 2, 3, 4, 5]


def test_oversampling_is_a_warning_and_a_metric(tmp_path):
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample number {i}"}) + "\n" for i in range(5)))
    run = tmp_path / "run"
    overrides = [f"data.path={data}", "train.global_batch_size=16", "train.max_tokens_per_gpu=256", *SHORT]
    assert finish(one(run, "unused", overrides)) == 0, logs(run)
    assert "each window trains every sample about 3.2 times" in logs(run)
    assert metrics(run)[0]["oversampling_factor"] == pytest.approx(3.2)


def test_no_fsdp_view_warning_on_a_one_row_microbatch():
    """megatron-core returns a view for one-row microbatches; the FSDP wrapper must own it."""
    code = (
        "import warnings, torch; warnings.simplefilter('always');"
        "from backend.config import load_config; from backend.distributed.setup import init_distributed;"
        "from backend.model.forward import token_losses; from backend.model.factory import build_model;"
        "import backend.distributed.fsdp as fsdp; fsdp.uses_fsdp = lambda env, *, bf16: True;"  # as over ranks
        "env = init_distributed(1); cfg = load_config(None, ['model.hidden_size=64', 'model.num_layers=1']);"
        "m = build_model(cfg, env, tokenizer_vocab=256).model;"
        "t = torch.randint(0, 256, (1, 16)); p = torch.arange(16)[None];"
        "assert isinstance(m, fsdp.FSDPModule);"
        "token_losses(m, t, t, p, torch.ones(1, 16, dtype=torch.bool)).sum().backward(); print('ran')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and "ran" in out.stdout, out.stderr[-3000:]
    assert "returned a view tensor" not in out.stderr


def _bad_data(tmp_path: Path, case: str) -> tuple[list[str], str, str]:
    """(overrides, the file the message must name, a fragment of the message)."""
    jsonl = tmp_path / "data.jsonl"
    if case == "invalid_utf8":
        jsonl.write_bytes(b'{"text": "fine"}\n{"text": "\xff\xfe"}\n')
        return [f"data.path={jsonl}"], f"{jsonl}:2", "UTF-8"
    if case == "huge_id":
        jsonl.write_text('{"input_ids": [1, 2]}\n{"input_ids": [1, ' + str(10**30) + "]}\n")
        return [f"data.path={jsonl}"], f"{jsonl}:2", "input_ids"
    if case == "empty_jsonl":
        jsonl.write_text("\n\n")
        return [f"data.path={jsonl}"], str(jsonl), "no samples"
    if case == "bad_tokenizer":
        tok = tmp_path / "tokenizer.json"
        tok.write_text("{ this is not json")
        jsonl.write_text('{"text": "hello"}\n')
        return [f"data.path={jsonl}", f"data.tokenizer={tok}"], str(tok), "data.tokenizer"
    prefix = tmp_path / "docs"
    subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(_docs(tmp_path)),
         "--output-prefix", str(prefix), "--tokenizer", "byte"],
        check=True, capture_output=True, cwd=REPO,
    )  # fmt: skip
    if case == "truncated_idx":
        idx = Path(f"{prefix}.idx")
        idx.write_bytes(idx.read_bytes()[:20])
        return [f"data.path={prefix}"], str(idx), ""
    binf = Path(f"{prefix}.bin")  # short_bin
    binf.write_bytes(binf.read_bytes()[:10])
    return [f"data.path={prefix}"], str(binf), ""


def _docs(tmp_path: Path) -> Path:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": "document " * (i + 3)}) + "\n" for i in range(8)))
    return src


@pytest.mark.parametrize(
    "case", ["invalid_utf8", "huge_id", "empty_jsonl", "bad_tokenizer", "truncated_idx", "short_bin"]
)
def test_data_errors_exit_2_with_one_line_naming_the_file(tmp_path, case):
    overrides, names, fragment = _bad_data(tmp_path, case)
    cmd = [sys.executable, "-m", "backend.train", TINY, *overrides, "train.global_batch_size=2",
           f"logger.run_dir={tmp_path / 'run'}", *SHORT]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("BACKEND_DEBUG", None)
    start_time = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and names in errors[0] and fragment in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start_time < 120
