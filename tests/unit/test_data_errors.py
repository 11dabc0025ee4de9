"""Data errors: each is a DataError (a UserError) whose one-line message names the file, the line or
sample where there is one, and the config key to change."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backend.data.build import build_dataset
from backend.data.errors import DataError, DataFileError, DataFormatError, OverlongError, TokenizerError
from backend.data.indexed import IndexedTokenDataset, check_indexed_files, write_indexed
from backend.data.jsonl import InMemoryDataset, read_jsonl
from backend.data.overlong import LengthLimitedDataset
from backend.data.sample import Sample
from backend.data.sampler import WindowSampler, oversampling_factor
from backend.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer
from backend.errors import UserError


def data_cfg(path, **kw) -> SimpleNamespace:
    base = dict(path=str(path), tokenizer="byte", json_key="text", max_seq_length=64, overlong="error", cache_dir="")
    return SimpleNamespace(**{**base, **kw})


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_the_error_classes_are_user_errors_and_value_errors():
    for cls in (DataFormatError, DataFileError, OverlongError, TokenizerError):
        assert issubclass(cls, DataError) and issubclass(cls, UserError) and issubclass(cls, ValueError)


def test_invalid_utf8_names_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9 \xff"}\n')
    with pytest.raises(DataFormatError) as err:
        list(read_jsonl(src, ByteTokenizer()))
    msg = one_line(err)
    assert msg.startswith(f"{src}:3: not valid UTF-8") and "data.path" in msg


def test_a_byte_order_mark_on_the_first_line_is_accepted(tmp_path):
    src = tmp_path / "bom.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"text": "ab"}\n')
    assert [s.tokens.tolist() for s in read_jsonl(src, ByteTokenizer())] == [[97, 98]]


@pytest.mark.parametrize("field", ["input_ids", "loss_mask"])
def test_an_id_of_ten_to_the_thirty_names_file_and_line_not_overflow(tmp_path, field):
    row = {"input_ids": [1, 2, 10**30]} if field == "input_ids" else {"input_ids": [1, 2], "loss_mask": [1, 10**30]}
    src = tmp_path / "big.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataFormatError) as err:
        list(read_jsonl(src, ByteTokenizer()))
    msg = one_line(err)
    assert msg.startswith(f"{src}:2: '{field}' holds {10**30}")
    if field == "input_ids":
        assert "data.tokenizer=byte" in msg


def test_a_huge_integer_loss_weight_is_a_format_error(tmp_path):
    src = tmp_path / "w.jsonl"
    src.write_text(json.dumps({"input_ids": [1, 2], "loss_weight": [1, 10**400]}) + "\n")
    with pytest.raises(DataFormatError, match=r":1: 'loss_weight' needs 2 finite numbers"):
        list(read_jsonl(src, ByteTokenizer()))


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": 5', '{"version": "1.0"}', "not json at all"])
def test_malformed_tokenizer_json_names_the_file_and_data_tokenizer(tmp_path, content):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    for make in (HFTokenizer, build_tokenizer):
        with pytest.raises(TokenizerError) as err:
            make(str(path))
        msg = one_line(err)
        assert msg.startswith(f"{path}: not a valid Hugging Face tokenizer.json") and "data.tokenizer" in msg


def test_a_missing_tokenizer_is_still_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.tokenizer") as err:
        HFTokenizer(tmp_path / "nowhere")
    assert isinstance(err.value, DataError)


# ---------------------------------------------------------------- .bin/.idx


@pytest.fixture
def indexed(tmp_path) -> str:
    prefix = str(tmp_path / "d")
    samples = [Sample(tokens=np.arange(n) % 200, loss_mask=np.ones(n, np.uint8)) for n in (5, 9, 3, 7)]
    write_indexed(prefix, samples, vocab_size=256)
    return prefix


def test_a_sound_pair_passes_the_check(indexed):
    assert check_indexed_files(indexed) == 4
    assert IndexedTokenDataset(indexed).lengths.tolist() == [5, 9, 3, 7]


def _cut(path: str, keep: int) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:keep])


@pytest.mark.parametrize("keep", [0, 20, 34, 34 + 4 * 4 + 3, -1])
def test_a_truncated_idx_is_named_at_open(indexed, keep):
    idx = f"{indexed}.idx"
    _cut(idx, keep if keep >= 0 else Path(idx).stat().st_size - 1)
    with pytest.raises(DataFileError) as err:
        IndexedTokenDataset(indexed)
    msg = one_line(err)
    assert msg.startswith(f"{idx}: ") and "data.path" in msg
    assert "truncated" in msg


def test_a_bad_magic_or_version_or_dtype_is_named(indexed):
    idx = Path(f"{indexed}.idx")
    good = idx.read_bytes()
    for patch, needle in (
        (b"XXIDIDX\x00\x00" + good[9:], "bad magic"),
        (good[:9] + struct.pack("<Q", 7) + good[17:], "version 7"),
        (good[:17] + bytes([99]) + good[18:], "dtype code 99"),
    ):
        idx.write_bytes(patch)
        with pytest.raises(DataFileError, match=needle) as err:
            check_indexed_files(indexed)
        assert one_line(err).startswith(f"{idx}: ")


def test_a_bin_shorter_than_its_idx_says_is_named(indexed):
    bin_ = f"{indexed}.bin"
    _cut(bin_, 5 + 9 + 3 + 2)  # the last sample (7 tokens, uint8) is cut short
    with pytest.raises(DataFileError) as err:
        IndexedTokenDataset(indexed)
    msg = one_line(err)
    assert msg.startswith(f"{bin_}: 19 bytes") and "sample 3" in msg and "data.path" in msg


def test_a_truncated_loss_mask_sibling_is_named(indexed):
    idx = f"{indexed}_loss_mask.idx"
    _cut(idx, 40)
    with pytest.raises(DataFileError) as err:
        IndexedTokenDataset(indexed)
    assert one_line(err).startswith(f"{idx}: ")


def test_a_truncated_idx_through_build_dataset(indexed):
    _cut(f"{indexed}.idx", 50)
    with pytest.raises(DataError, match=f"^{indexed}.idx: "):
        build_dataset(data_cfg(indexed))


# ---------------------------------------------------------------- empty data


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_an_empty_or_blank_jsonl_says_no_samples(tmp_path, content):
    src = tmp_path / "empty.jsonl"
    src.write_text(content)
    with pytest.raises(DataFileError) as err:
        build_dataset(data_cfg(src))
    msg = one_line(err)
    assert msg.startswith(f"{src}: no samples") and "max_seq_length" not in msg


def test_an_empty_dataset_is_not_reported_as_overlong():
    with pytest.raises(DataFileError, match="^mem: no samples"):
        LengthLimitedDataset(InMemoryDataset([], "mem"), 8, "drop")


def test_an_empty_bin_idx_says_no_samples(tmp_path):
    prefix = str(tmp_path / "e")
    write_indexed(prefix, [], vocab_size=256)
    with pytest.raises(DataFileError, match="no samples"):
        build_dataset(data_cfg(prefix))


def test_every_sample_over_the_limit_still_says_so(tmp_path):
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"text": "x" * 100}) + "\n")
    with pytest.raises(OverlongError, match="over data.max_seq_length=64") as err:
        build_dataset(data_cfg(src, overlong="drop"))
    assert one_line(err).startswith(f"{src}: ")


def test_missing_data_path_is_a_data_error_and_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        build_dataset(data_cfg(tmp_path / "none.jsonl"))
    assert isinstance(err.value, DataError) and "data.path" in str(err.value)


# ---------------------------------------------------------------- sampler


def test_oversampling_factor():
    assert oversampling_factor(100, 32) == 1.0
    assert oversampling_factor(32, 32) == 1.0
    assert oversampling_factor(10, 32) == pytest.approx(3.2)
    with pytest.raises(DataError):
        oversampling_factor(0, 32)


def test_a_changed_sampler_setting_names_the_config_key():
    state = WindowSampler(10, 4, seed=3).state_dict()
    with pytest.raises(DataError, match=r"seed=3 .*\(restore train\.seed\)"):
        WindowSampler(10, 4, seed=5).load_state_dict(state)
