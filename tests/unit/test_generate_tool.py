"""``tools/generate.py``: sampling from a training checkpoint gives what sampling from its export
gives (the same seed, the same text), a chat model's prompts get its template, and careless
inputs are one error line."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, TINY


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _responses(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_a_checkpoint_samples_what_its_export_samples(tmp_path):
    run = tmp_path / "run"
    train = _run(
        "-m",
        "backend.train",
        str(TINY),
        f"logger.run_dir={run}",
        "train.train_iters=1",
        "checkpoint.interval=1",
        "logger.log_interval=1000",
    )
    assert train.returncode == 0, train.stderr
    flags = ["--prompt", "def f(", "--prompt", "import", "-n", "2", "--max-new-tokens", "12", "--seed", "5", "--json"]
    ours = _responses(_run("tools/generate.py", str(run), *flags))  # the run directory: its newest step
    assert [r["prompt"] for r in ours] == ["def f(", "import"]
    assert all(len(r["responses"]) == 2 for r in ours)
    exported = tmp_path / "hf"
    assert _run("tools/export_hf.py", str(run), "--output", str(exported), "--dtype", "fp32").returncode == 0
    assert _responses(_run("tools/generate.py", str(exported), *flags)) == ours
    other_seed = _responses(_run("tools/generate.py", str(run), *flags[:-2], "6", "--json"))
    assert other_seed != ours


def test_a_chat_model_gets_its_template_and_careless_inputs_one_line(tiny_hf, tmp_path):
    hf_dir, _ = tiny_hf["qwen3"]
    out = _responses(_run("tools/generate.py", str(hf_dir), "--prompt", "hello", "--max-new-tokens", "4", "--json"))
    assert "<|im_start|>user\nhello<|im_end|>" in out[0]["prompt"]  # the chat template, with a generation prompt
    raw = _responses(
        _run("tools/generate.py", str(hf_dir), "--prompt", "hello", "--raw", "--json", "--max-new-tokens", "2")
    )
    assert raw[0]["prompt"] == "hello"
    for args, expected in [
        ([str(tmp_path / "nowhere"), "--prompt", "x"], "no such directory"),
        ([str(hf_dir)], "no prompts: give --prompt TEXT or --prompts FILE"),
        ([str(hf_dir), "--prompt", "x", "--temperature", "0"], "--temperature 0.0: must be > 0"),
    ]:
        bad = _run("tools/generate.py", *args)
        assert bad.returncode == 2 and expected in bad.stderr.strip().splitlines()[-1], bad.stderr
        assert "Traceback" not in bad.stderr
