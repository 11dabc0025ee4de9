"""Help texts that tell the truth, a byte-tokenizer export that says it wrote no tokenizer, weights
written with an ordinary file mode, and a torchrun hint where the world size is the problem."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from backend.config import ConfigError, load_config, validate
from tests.conftest import REPO


def test_backend_train_without_arguments_asks_only_for_the_config():
    out = subprocess.run([sys.executable, "-m", "backend.train"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "required: config" in out.stderr and "overrides" not in out.stderr.splitlines()[-1]


@pytest.mark.parametrize("tool", ["compute_logprobs.py", "export_hf.py"])
def test_tool_usage_examples_keep_their_line_breaks(tool):
    out = subprocess.run([sys.executable, f"tools/{tool}", "--help"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0
    example = next(line for line in out.stdout.splitlines() if line.strip().startswith("python tools/"))
    assert example.rstrip().endswith("\\")  # the continuation is shown, not swallowed
    assert "         [--" not in example
    assert "right-padded," not in out.stdout or "packed" in out.stdout


def test_byte_tokenizer_export_says_it_writes_no_tokenizer():
    from backend.checkpoint.hf_export import _tokenizer_source, tokenizer_note

    cfg = load_config(None, ["data.tokenizer=byte"])
    assert _tokenizer_source(cfg) is None
    note = tokenizer_note(cfg, "out")
    assert note.startswith("out: no tokenizer files written: data.tokenizer=byte")
    assert "model.hf_checkpoint" in note


def test_exported_weights_get_an_ordinary_file_mode(tmp_path):
    from backend.model.hf.safetensors_io import write_sharded

    umask = os.umask(0o022)
    try:
        files = write_sharded({"a": torch.zeros(4), "b": torch.ones(4)}.items(), tmp_path, 1 << 30)
    finally:
        os.umask(umask)
    assert [oct(f.stat().st_mode & 0o777) for f in files] == ["0o644"]


def test_cp_on_one_process_hints_at_torchrun():
    with pytest.raises(ConfigError, match=r"launch with torchrun --nproc-per-node 2"):
        validate(load_config(None, ["parallel.context_parallel_size=2"]), world_size=1)
