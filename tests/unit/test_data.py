"""Datasets, tokenizers, sampler, over-length policy and collation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.batching import Microbatch, plan_dynamic
from backend.data.collate import collate, cp_shard, cp_unshard
from backend.data.indexed import IndexedTokenDataset
from backend.data.iterator import DataIterator
from backend.data.jsonl import DataFormatError, InMemoryDataset, read_jsonl
from backend.data.overlong import LengthLimitedDataset, OverlongError
from backend.data.sample import Sample
from backend.data.sampler import WindowSampler
from backend.data.tokenizers import ByteTokenizer, HFTokenizer

REPO = Path(__file__).resolve().parents[2]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_to_bin_idx_round_trip_token_for_token(tmp_path):
    rows = [
        {"text": "héllo world"},
        {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "loss_weight": [0.0, 0.0, 0.5, -1.25]},
        {"text": "x" * 300},
    ]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    out = subprocess.run(
        [
            sys.executable,
            "tools/preprocess_data.py",
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "out/d"),
            "--tokenizer",
            "byte",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    expected = list(read_jsonl(src, ByteTokenizer()))
    ds = IndexedTokenDataset(tmp_path / "out/d")
    assert len(ds) == 3 and ds.lengths.tolist() == [len("héllo world".encode()), 4, 300]
    for i, s in enumerate(expected):
        got = ds[i]
        assert np.array_equal(got.tokens, s.tokens)
    assert ds[1].loss_mask.tolist() == [0, 0, 1, 1] and ds[0].loss_mask.tolist() == [1] * 12
    assert np.allclose(ds[1].loss_weight, [0.0, 0.0, 0.5, -1.25])
    assert ds.loss_token_counts.tolist() == [11, 2, 299]
    assert ds.has_loss_weight


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"body": "x"}', "no 'text', 'input_ids' or 'messages' field"),
        ('{"text": 5}', "'text' must be a string"),
        ('{"text": ""}', "has no tokens"),
        ('{"input_ids": [1, "a"]}', "'input_ids' must be a list of integers"),
        ('{"input_ids": [1, 999]}', "outside [0, 256)"),
        ('{"input_ids": [1, 2], "loss_mask": [1]}', "'loss_mask' needs 2 entries"),
        ('{"input_ids": [1, 2], "loss_weight": [1, NaN]}', "'loss_weight' needs 2 finite numbers"),
    ],
)
def test_malformed_jsonl_names_file_and_line(tmp_path, line, needle):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, "", line])
    with pytest.raises(DataFormatError) as err:
        list(read_jsonl(src, ByteTokenizer()))
    assert str(err.value).startswith(f"{src}:3:") and needle in str(err.value)


def test_preprocess_reports_malformed_line_and_writes_nothing(tmp_path):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, "{oops"])
    out = subprocess.run(
        [sys.executable, "tools/preprocess_data.py", "--input", str(src), "--output-prefix", str(tmp_path / "o")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and f"{src}:2:" in out.stderr
    assert not list(tmp_path.glob("o*"))


def test_hf_tokenizer_json_from_a_local_path(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat"], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path)
    ids = hf.encode("the cat sat")
    assert len(ids) == 3 and hf.decode(ids) == "the cat sat" and hf.vocab_size == 6
    with pytest.raises(FileNotFoundError, match="data.tokenizer"):
        HFTokenizer(tmp_path / "missing")


def test_embedded_dataset_builds_offline(tmp_path):
    from backend.data.embedded import build_embedded

    prefix = build_embedded(tmp_path)
    ds = IndexedTokenDataset(prefix)
    assert len(ds) > 1000
    assert np.percentile(ds.lengths, 90) > 4 * np.percentile(ds.lengths, 50), "long-tailed lengths"
    text = bytes(ds[0].tokens.astype(np.uint8)).decode("utf-8", errors="replace")
    assert text.strip()
    assert build_embedded(tmp_path) == prefix  # cached: built once


def test_sampler_restore_continues_the_identical_stream():
    a = WindowSampler(10, 4, seed=3)
    first = [a.next_window() for _ in range(2)]
    state = a.state_dict()
    rest = [a.next_window() for _ in range(5)]
    b = WindowSampler(10, 4, seed=3)
    b.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(rest, [b.next_window() for _ in range(5)]))
    stream = np.concatenate(first + rest)
    assert sorted(stream[:10].tolist()) == list(range(10)), "the first epoch is a permutation"
    assert sorted(stream[10:20].tolist()) == list(range(10))
    with pytest.raises(ValueError, match="global_batch_size"):
        WindowSampler(10, 5, seed=3).load_state_dict(state)


def test_overlong_policies_count_what_they_do():
    samples = [Sample(tokens=np.arange(n)) for n in (3, 9, 5, 12)]
    base = InMemoryDataset(samples, "mem")
    with pytest.raises(OverlongError, match="sample 1 has 9 tokens, over data.max_seq_length=6 .2 sample"):
        LengthLimitedDataset(base, 6, "error")
    cut = LengthLimitedDataset(base, 6, "truncate")
    assert cut.lengths.tolist() == [3, 6, 5, 6] and len(cut[3].tokens) == 6
    assert cut.report.truncated == 2 and cut.report.truncated_tokens == 9
    assert cut.loss_token_counts.tolist() == [2, 5, 4, 5]
    drop = LengthLimitedDataset(base, 6, "drop")
    assert drop.lengths.tolist() == [3, 5] and drop.report.dropped == 2
    assert np.array_equal(drop[1].tokens, np.arange(5))


def test_collate_pads_right_shifts_labels_and_masks():
    s0 = Sample(
        tokens=np.array([1, 2, 3]), loss_mask=np.array([0, 1, 1], np.uint8), loss_weight=np.array([9, 2, 3], np.float32)
    )
    s1 = Sample(tokens=np.array([4, 5, 6, 7, 8]))
    mb = Microbatch(indices=(0, 1), padded_len=6, cost=12, tokens=8)
    t = collate([s0, s1], [10, 11], mb)
    assert t.tokens.tolist() == [[1, 2, 3, 0, 0, 0], [4, 5, 6, 7, 8, 0]]
    assert t.labels.tolist() == [[2, 3, 0, 0, 0, 0], [5, 6, 7, 8, 0, 0]]
    assert t.loss_mask.tolist() == [[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert t.loss_weight.tolist() == [[2, 3, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]]
    assert t.valid.tolist() == [[True] * 3 + [False] * 3, [True] * 5 + [False]]
    assert t.sample_ids.tolist() == [10, 11] and t.num_loss_tokens == 6


def test_cp_shard_keeps_chunks_i_and_mirror_and_unshards():
    x = torch.arange(16).reshape(1, 16)
    parts = [cp_shard(x, r, 4) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[1].tolist() == [[2, 3, 12, 13]]
    assert torch.equal(cp_unshard(parts), x)
    with pytest.raises(ValueError, match="multiple of 2\\*cp_size=4"):
        cp_shard(torch.zeros(1, 6), 0, 2)


def test_iterator_empty_microbatches_are_zero_length_and_loss_normaliser_is_global():
    samples = [Sample(tokens=np.arange(n) % 7) for n in (4, 6)]
    ds = InMemoryDataset(samples, "mem")
    planner = lambda lengths: plan_dynamic(lengths, dp_size=4, max_tokens_per_gpu=64)  # noqa: E731
    seen = []
    for dp_rank in range(4):
        it = DataIterator(ds, WindowSampler(2, 2, seed=0), planner, dp_rank=dp_rank, cp_rank=0, cp_size=1)
        step = next(it)
        assert step.global_loss_tokens == 3 + 5
        assert step.num_microbatches == 1
        mb = step.microbatches[0]
        if mb.is_empty:
            assert mb.tokens.shape == (0, 0) and mb.num_loss_tokens == 0
        seen += mb.sample_ids.tolist()
    assert sorted(seen) == [0, 1]


def test_cut_at_lines_keeps_all_the_text_in_documents_that_fit():
    from backend.data.embedded import cut_at_lines

    doc = b"def f():\n" + b"    x = 1\n" * 30 + b"    " + b"y" * 50 + b"\n"
    pieces = cut_at_lines(doc, 32)
    assert b"".join(pieces) == doc and all(0 < len(p) <= 32 for p in pieces)
    assert all(p.endswith(b"\n") for p in pieces[:-3])  # cut between lines (one long line is cut inside)
    assert cut_at_lines(b"short\n", 32) == [b"short\n"]
