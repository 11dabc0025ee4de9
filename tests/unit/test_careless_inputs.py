"""What a new user types carelessly gets one clear line (or the right behaviour): every misspelled
key at once with a suggestion, a quoted "no" where true/false belongs, a warm-up longer than the
run, JSON lines that end too early, a ``.bin``-only or Hub-id checkpoint, a run directory given
to the exporter."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from backend.config import ConfigError, load_config
from backend.data.errors import DataFormatError
from backend.data.jsonl import jsonl_rows
from tests.conftest import REPO


def test_every_misspelled_key_is_named_at_once_with_a_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.train_iter=5", "model.hiden_size=3", "train.lr=1", "foo.bar=2"])
    text = str(e.value)
    assert "unknown config key 'train.train_iter' (did you mean 'train.train_iters'?)" in text
    assert "unknown config key 'model.hiden_size' (did you mean 'model.hidden_size'?)" in text
    assert "unknown config key 'train.lr' (did you mean 'optimizer.lr'?)" in text  # the key in another section
    assert "unknown config key 'foo' (allowed keys in '<top level>': model, parallel" in text


def test_every_bad_value_is_named_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.train_iters=abc", "optimizer.lr=x", "train.seed=1"])
    text = str(e.value)
    assert "bad value for 'train.train_iters'" in text and "bad value for 'optimizer.lr'" in text


def test_a_quoted_string_for_a_true_false_key_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('train:\n  dynamic_batch_enable: "no"\n')
    with pytest.raises(
        ConfigError,
        match=r"bad.yaml: bad value for 'train.dynamic_batch_enable': 'no' is a string; write true or false",
    ):
        load_config(bad)
    assert load_config(None, ["train.dynamic_batch_enable=no"]).train.dynamic_batch_enable is False  # YAML's no


def test_a_warm_up_longer_than_the_run_is_said(caplog):
    with caplog.at_level(logging.WARNING):
        load_config(None, ["scheduler.warmup_iters=50", "train.train_iters=20"])
    assert "scheduler.warmup_iters=50 is longer than the run (train.train_iters=20)" in caplog.text
    assert "stops at 0.4 of optimizer.lr" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_config(None, ["scheduler.warmup_iters=20", "train.train_iters=20"])
    assert "warmup_iters" not in caplog.text


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"text": "abc\n', "a string opened at column 10 is never closed (a missing '\"')"),
        ('{"text": "abc"\n', "the line ends before the JSON value does (a missing closing '}' or ']')"),
        ('{"text": "abc",, "x": 1}\n', "Expecting property name enclosed in double quotes at column 16"),
    ],
)
def test_json_errors_say_what_is_wrong(tmp_path, line, expected):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n' + line)
    with pytest.raises(DataFormatError) as e:
        list(jsonl_rows(path))
    assert str(e.value) == f"{path}:2: not valid JSON: {expected}"


def test_a_bin_only_checkpoint_is_one_line_from_print_config(tiny_hf, tmp_path):
    import shutil

    src, _ = tiny_hf["qwen3"]
    d = tmp_path / "bin_only"
    shutil.copytree(src, d)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"safetensors only: never unpickles .bin \(pytorch_model.bin\)"):
        load_config(None, [f"model.hf_checkpoint={d}"])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "backend.train",
            "configs/finetune_hf.yaml",
            f"model.hf_checkpoint={d}",
            "--print-config",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: model.hf_checkpoint=")
    assert "Traceback" not in out.stderr


def test_a_hub_id_says_to_download_it():
    with pytest.raises(ConfigError, match=r"no such directory; it looks like a Hugging Face Hub id: download it"):
        load_config(None, ["model.hf_checkpoint=Qwen/Qwen3-0.6B"])
    with pytest.raises(ConfigError, match=r"no such directory$"):
        load_config(None, ["model.hf_checkpoint=./not/here/at/all"])


def _step(root, step: int):
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"step": step}))
    return d


def test_the_exporter_takes_a_run_directory_and_exports_its_newest_step(tmp_path):
    from backend.commands.export_hf import locate
    from backend.errors import UserError

    run = tmp_path / "run"
    _step(run / "checkpoints", 10)
    newest = _step(run / "checkpoints", 20)
    (run / "checkpoints" / ".tmp_step_00000030").mkdir()  # an unfinished save is passed over
    (run / "config.yaml").write_text("train:\n  train_iters: 20\n")
    assert locate(run) == (newest, run / "config.yaml")
    assert locate(run / "checkpoints") == (newest, run / "config.yaml")
    assert locate(newest) == (newest, run / "config.yaml")
    elsewhere = tmp_path / "ckpts"  # checkpoint.dir set in the run's config
    moved = _step(elsewhere, 5)
    (run / "config.yaml").write_text(f"checkpoint:\n  dir: {elsewhere}\n")
    assert locate(run)[0] == moved
    with pytest.raises(UserError, match=r"missing: no such directory"):
        locate(tmp_path / "missing")
    with pytest.raises(UserError, match=r"no complete checkpoint"):
        locate(tmp_path / "ckpts" / "..")


def test_the_exporter_names_a_missing_step_in_one_line(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "tools/export_hf.py",
            str(tmp_path / "run" / "step_00000099"),
            "--output",
            str(tmp_path / "x"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: {tmp_path / 'run' / 'step_00000099'}: no such directory (give a run " + (
        "directory, its checkpoints/ or a step_* in it)"
    )


@pytest.mark.parametrize(
    ("command", "overrides", "expected"),
    [
        ("backend.train", ["data.path=missing.jsonl"], "error: data.path: no such file missing.jsonl"),
        ("backend.rl", ["rl.prompts=missing.jsonl"], "error: rl.prompts: no such file 'missing.jsonl'"),
        ("backend.rl", ["rl.reward=configs/grpo_demo/reward.py"], "expected 'module:function' or"),
    ],
)
def test_print_config_runs_the_file_checks_a_start_runs(command, overrides, expected):
    config = "configs/quickstart.yaml" if command == "backend.train" else "configs/grpo_demo.yaml"
    out = subprocess.run(
        [sys.executable, "-m", command, config, *overrides, "--print-config"], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 2
    assert expected in out.stderr.strip().splitlines()[-1] and "Traceback" not in out.stderr


def test_the_rl_summary_and_resume_follow_the_rows_the_loop_trains():
    from types import SimpleNamespace

    from backend.checkpoint.resume_policy import diff_resume_config
    from backend.train.engine import Engine
    from backend.train.trainer import Trainer

    cfg = load_config(REPO / "configs" / "grpo_demo.yaml", ["rl.prompts_per_step=2"])  # 16 rows a step
    rows = cfg.rl.prompts_per_step * cfg.rl.samples_per_prompt
    assert rows != cfg.train.global_batch_size
    assert Engine.samples_per_step(SimpleNamespace(cfg=cfg)) == rows  # rows in memory: the loop's window
    assert Trainer.samples_per_step(SimpleNamespace(cfg=cfg)) == cfg.train.global_batch_size
    old, new = {"train": {"global_batch_size": 64}}, {"train": {"global_batch_size": 32}}
    assert diff_resume_config(old, new).refused  # a data-stream run: another stream
    diff = diff_resume_config(old, new, unread=Engine.unread_keys(None))
    assert not diff.refused and diff.reasons["train.global_batch_size"] == "not read by this run's driver"


def _start(run_dir) -> subprocess.CompletedProcess:
    """A training start that fails on its data (after the run directory is held)."""
    cmd = [sys.executable, "-m", "backend.train", "configs/quickstart.yaml", "data.path=nope.idx"]
    return subprocess.run([*cmd, f"logger.run_dir={run_dir}"], cwd=REPO, capture_output=True, text=True)


def test_a_failed_start_leaves_no_run_directory(tmp_path):
    run = tmp_path / "new" / "run"
    out = _start(run)
    assert out.returncode == 2 and "data.path='nope.idx'" in out.stderr.strip().splitlines()[-1]
    assert not run.exists()  # it held only its lock file
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    out = _start(kept)
    assert out.returncode == 2 and (kept / "notes.txt").read_text() == "mine"  # not ours to remove


def test_small_messages_say_what_to_do(tmp_path):
    from backend.data.chat import ChatTemplateError, _template_source

    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json has no 'chat_template' and there is no chat"):
        _template_source(tmp_path)
    with pytest.raises(ConfigError, match=r"'rl.reward' is empty; give it a value"):
        load_config(None, ["rl.reward="])
    help_text = subprocess.run(
        [sys.executable, "-m", "backend.train", "--help"], cwd=REPO, capture_output=True, text=True
    ).stdout
    assert help_text.startswith("usage: python -m backend.train ")
