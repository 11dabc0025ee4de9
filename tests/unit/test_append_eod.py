"""End-of-document ids: tokenizers, JSONL loading, tools/preprocess_data.py --append-eod, data.append_eod."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from backend.config import load_config
from backend.config.run_values import padded_vocab
from backend.data.build import build_dataset
from backend.data.errors import DataError, DataFileError, TokenizerError
from backend.data.indexed import IndexedTokenDataset
from backend.data.jsonl import read_jsonl
from backend.data.tokenizers import BYTE_EOD_ID, ByteTokenizer, HFTokenizer, build_tokenizer

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"text": "héllo"},
    {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "loss_weight": [0.0, 0.0, 0.5, -1.25]},
    {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 0]},
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def preprocess(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools/preprocess_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(argv)


def test_byte_tokenizer_grows_by_one_id_only_with_eod():
    plain, eod = ByteTokenizer(), ByteTokenizer(eod=True)
    assert (plain.vocab_size, plain.eod_id) == (256, None)
    assert (eod.vocab_size, eod.eod_id) == (257, BYTE_EOD_ID) == (257, 256)
    assert build_tokenizer("byte", eod=True).eod_id == 256
    assert eod.decode([104, 105, 256]) == "hi"  # the EOD decodes to nothing
    # the model pads the vocabulary to a multiple of 128: 256 stays 256, 257 becomes 384
    model_cfg = load_config(None, []).model
    assert padded_vocab(model_cfg, plain.vocab_size) == 256 and padded_vocab(model_cfg, eod.vocab_size) == 384


def test_jsonl_samples_end_with_eod_and_the_eod_inherits_the_last_mask(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", ROWS)
    plain = list(read_jsonl(src, ByteTokenizer()))
    with_eod = list(read_jsonl(src, ByteTokenizer(eod=True), append_eod=True))
    for a, b in zip(plain, with_eod):
        assert b.tokens.tolist() == a.tokens.tolist() + [256]
    assert with_eod[0].loss_mask is None and with_eod[0].loss_tokens() == plain[0].loss_tokens() + 1
    assert with_eod[1].loss_mask.tolist() == [0, 0, 1, 1, 1] and with_eod[1].loss_weight.tolist() == [
        0.0,
        0.0,
        0.5,
        -1.25,
        -1.25,
    ]
    assert with_eod[2].loss_mask.tolist() == [1, 1, 0, 0]  # a masked-out tail keeps its EOD masked out
    with pytest.raises(ValueError, match="end-of-document"):
        list(read_jsonl(src, ByteTokenizer(), append_eod=True))


def test_preprocess_append_eod_round_trip(tmp_path, capsys):
    src = write_jsonl(tmp_path / "d.jsonl", ROWS)
    assert preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "plain"), "--tokenizer", "byte"]) == 0
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "eod"), "--tokenizer", "byte", "--append-eod"]
    assert preprocess(argv) == 0
    assert "end-of-document id 256" in capsys.readouterr().out
    plain, eod = IndexedTokenDataset(tmp_path / "plain"), IndexedTokenDataset(tmp_path / "eod")
    assert eod.lengths.tolist() == (plain.lengths + 1).tolist() == [7, 5, 4]
    assert (plain.token_itemsize, eod.token_itemsize) == (1, 2)  # 257 ids need uint16
    for i in range(len(eod)):
        a, b = plain[i], eod[i]
        assert b.tokens.tolist() == a.tokens.tolist() + [256] and eod.last_token(i) == 256
    assert eod[1].loss_mask.tolist() == [0, 0, 1, 1, 1] and eod[2].loss_mask.tolist() == [1, 1, 0, 0]
    assert eod.loss_token_counts.tolist() == [6, 3, 1]


def test_data_append_eod_for_jsonl_and_bin_idx(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", ROWS)
    cfg = load_config(None, [f"data.path={src}", "data.append_eod=true"]).data
    ds, tok = build_dataset(cfg)
    assert tok.vocab_size == 257 and [ds[i].tokens.tolist()[-1] for i in range(len(ds))] == [256] * 3
    assert preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "eod"), "--append-eod"]) == 0
    ds, tok = build_dataset(load_config(None, [f"data.path={tmp_path / 'eod'}", "data.append_eod=true"]).data)
    assert tok.eod_id == 256 and ds.lengths.tolist() == [7, 5, 4]  # nothing appended twice
    # the same files without data.append_eod would feed id 256 to a 256-row embedding: refused
    with pytest.raises(DataFileError, match="set data.append_eod=true"):
        build_dataset(load_config(None, [f"data.path={tmp_path / 'eod'}"]).data)
    # files without EOD under data.append_eod=true: refused, naming the tool flag
    assert preprocess(["--input", str(src), "--output-prefix", str(tmp_path / "plain")]) == 0
    with pytest.raises(DataFileError, match="--append-eod"):
        build_dataset(load_config(None, [f"data.path={tmp_path / 'plain'}", "data.append_eod=true"]).data)
    with pytest.raises(DataError, match="embedded"):
        build_dataset(load_config(None, ["data.append_eod=true"]).data)


def _hf_tokenizer(tmp_path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world"] * 4, trainer)
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_hf_eos_from_tokenizer_config_then_usual_names(tmp_path):
    path = _hf_tokenizer(tmp_path / "a", ["<|endoftext|>", "<|im_end|>"])
    named = HFTokenizer(path, eod=True)
    assert named.eod_id == named._tok.token_to_id("<|endoftext|>") and named.vocab_size == HFTokenizer(path).vocab_size
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    configured = HFTokenizer(path, eod=True)
    assert configured.eod_id == configured._tok.token_to_id("<|im_end|>") != named.eod_id
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    (sample,) = read_jsonl(src, configured, append_eod=True)
    assert sample.tokens[-1] == configured.eod_id
    bare = _hf_tokenizer(tmp_path / "b", ["<pad>"])
    assert HFTokenizer(bare).eod_id is None  # only looked up when asked for
    with pytest.raises(TokenizerError, match="no end-of-document token") as err:
        HFTokenizer(bare, eod=True)
    assert "tokenizer_config.json" in str(err.value)


def test_preprocess_reports_a_tokenizer_without_eos(tmp_path, capsys):
    bare = _hf_tokenizer(tmp_path / "b", ["<pad>"])
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "hello"}])
    argv = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(bare), "--append-eod"]
    assert preprocess(argv) == 1
    assert "no end-of-document token" in capsys.readouterr().err
    assert not np.any([p.name.startswith("o.") for p in tmp_path.iterdir()])
