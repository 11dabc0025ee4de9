"""tools/show_data.py, piped: the trained tokens of a chat row between markers, the per-token fields
of an RL row, the first window's plan; through the trainer's data path, no model built."""

from __future__ import annotations

import json
import re

from backend.bench.rl_rows import rl_rows, write_rows
from tests.conftest import TINY
from tests.helpers.hf_tiny import save_tiny_tokenizer
from tools.show_data import main as show

CHAT = [
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "hello"},
]


def test_a_chat_row_shows_its_trained_turns_between_markers(tmp_path, capsys):
    tok = save_tiny_tokenizer(tmp_path / "tok")  # ChatML
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": CHAT}) + "\n")
    assert show([TINY, f"data.path={rows}", f"data.tokenizer={tok}", "--rows", "1", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "1 samples" in out or "1 sample" in out
    body = out.split("--- sample 0", 1)[1]
    assert re.findall(r"\[\[(.*?)\]\]", body, flags=re.S) == ["four<|im_end|>\n", "hello<|im_end|>\n"]
    assert "<|im_start|>user\nwhat is two plus two<|im_end|>\n<|im_start|>assistant\n[[four" in out
    assert "first window: " in out and "rank 0 mb 0:" in out


def test_an_rl_row_shows_its_per_token_fields(tmp_path, capsys):
    rows = write_rows(tmp_path / "rl.jsonl", rl_rows(4, seed=1, max_len=40))
    assert show([TINY, f"data.path={rows}", "loss.type=policy", "data.max_seq_length=64", "--index", "2"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("pos\t"))
    assert header.split("\t") == ["pos", "id", "piece", "loss_mask", "advantages", "old_logprobs"]
    sample = json.loads(rows.read_text().splitlines()[2])
    table = [line.split("\t") for line in out.splitlines() if re.match(r"^\d+\t", line)]
    assert [int(r[1]) for r in table] == sample["input_ids"]
    assert [int(r[3]) for r in table] == sample["loss_mask"]
    assert all(float(r[4]) == float(f"{sample['advantages']:.4g}") for r in table)


def test_a_bad_index_is_a_clear_error(tmp_path, capsys):
    rows = write_rows(tmp_path / "rl.jsonl", rl_rows(2, seed=1, max_len=40))
    assert show([TINY, f"data.path={rows}", "loss.type=policy", "data.max_seq_length=64", "--index", "9"]) == 2
    assert "--index 9: the data set has samples 0..1" in capsys.readouterr().err
