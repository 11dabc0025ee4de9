"""Parquet files, directories of Parquet shards and datasets' save_to_disk directories as data.path:
the same samples and the same training (bitwise) as the same rows in JSONL, the same errors
naming file, row and field, and a file converted without holding it in memory."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch.distributed

from backend.config import load_config, validate
from backend.data.build import build_dataset
from backend.data.errors import DataError, DataFormatError
from backend.data.indexed import _indexed_dataset
from backend.logging.metrics import read_metrics
from backend.train.trainer import Trainer
from tests.conftest import TINY


def make_rows(n: int = 48, seed: int = 3) -> list[dict]:
    """Text rows and token-id rows with a loss mask and weights, of varied lengths."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(5, 120))
        if i % 3 == 0:
            rows.append({"text": "".join(chr(97 + int(c)) for c in rng.integers(0, 26, length))})
        else:
            row = {"input_ids": rng.integers(1, 256, length).tolist()}
            if i % 3 == 1:
                mask = (rng.random(length) < 0.8).astype(int)
                mask[-1] = 1
                row["loss_mask"] = mask.tolist()
                row["loss_weight"] = np.round(rng.random(length) + 0.5, 3).tolist()
            rows.append(row)
    return rows


def columns(rows: list[dict]) -> dict[str, list]:
    """Rows as columns, null where a row lacks a field (pyarrow's and datasets' from-list
    constructors take the first row's keys only)."""
    keys = sorted({k for r in rows for k in r})
    return {k: [r.get(k) for r in rows] for k in keys}


def write_sources(rows: list[dict], root: Path) -> dict[str, Path]:
    """The same rows as JSONL, one Parquet file, three Parquet shards and a save_to_disk directory."""
    import datasets

    root.mkdir(parents=True, exist_ok=True)
    out = {"jsonl": root / "rows.jsonl", "parquet": root / "rows.parquet", "shards": root / "shards"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table(columns(rows)), out["parquet"], row_group_size=10)
    out["shards"].mkdir()
    third = len(rows) // 3
    for i, part in enumerate((rows[:third], rows[third : 2 * third], rows[2 * third :])):
        pq.write_table(pa.table(columns(part)), out["shards"] / f"part-{i:05d}.parquet")
    out["save_to_disk"] = root / "saved"
    datasets.Dataset.from_dict(columns(rows)).save_to_disk(str(out["save_to_disk"]), num_shards=2)
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    return write_sources(make_rows(), tmp_path_factory.mktemp("arrow"))


def _data_cfg(path: Path, cache: Path, *extra: str):
    return validate(
        load_config(TINY, [f"data.path={path}", f"data.cache_dir={cache}", "data.max_seq_length=128", *extra])
    ).data


@pytest.mark.parametrize("kind", ["parquet", "shards", "save_to_disk"])
def test_arrow_sources_give_the_jsonl_samples(sources, tmp_path, kind):
    reference, _ = build_dataset(_data_cfg(sources["jsonl"], tmp_path))
    dataset, _ = build_dataset(_data_cfg(sources[kind], tmp_path))
    assert len(dataset) == len(reference) == 48
    assert dataset.lengths.tolist() == reference.lengths.tolist()
    for i in range(len(reference)):
        a, b = reference[i], dataset[i]
        assert a.tokens.tolist() == b.tokens.tolist(), i
        mask_a = a.loss_mask if a.loss_mask is not None else np.ones(len(a.tokens))
        assert mask_a.tolist() == b.loss_mask.tolist(), i
        weight_a = a.loss_weight if a.loss_weight is not None else np.ones(len(a.tokens), np.float32)
        assert np.array_equal(weight_a, b.loss_weight), i
    again, _ = build_dataset(_data_cfg(sources[kind], tmp_path))  # the cache is reused
    assert again.lengths.tolist() == dataset.lengths.tolist()
    assert len(list(tmp_path.glob("arrow_*.json"))) == 1


def train_losses(world, path: Path, tmp: Path) -> list[tuple]:
    """(loss, grad norm, tokens) of 3 dynamic steps on ``path`` (rank 0's run directory per source)."""
    cfg = validate(
        load_config(
            TINY,
            [
                f"data.path={path}",
                f"data.cache_dir={tmp / 'cache'}",
                f"logger.run_dir={tmp / path.stem}",
                f"checkpoint.dir={tmp / path.stem / 'ckpt'}",
                "checkpoint.interval=0",
                "data.max_seq_length=128",
                "train.global_batch_size=8",
                "train.train_iters=3",
                "train.dynamic_batch_enable=true",
                "train.max_tokens_per_gpu=256",
                "checkpoint.resume=false",
                "logger.log_interval=1000",
            ],
        ),
        world.world_size,
    )
    trainer = Trainer(cfg, world)
    trainer.train()
    trainer.metrics.close()
    torch.distributed.barrier()  # rank 0 writes metrics.jsonl; every rank reads it
    steps, _ = read_metrics(Path(cfg.logger.run_dir) / "metrics.jsonl")
    return [(s["loss"], s["grad_norm"], s["tokens"]) for s in steps]


def test_parquet_trains_bitwise_like_jsonl(world, sources, tmp_path):
    jsonl = train_losses(world, sources["jsonl"], tmp_path)
    assert len(jsonl) == 3
    assert train_losses(world, sources["parquet"], tmp_path) == jsonl


def test_a_bad_row_names_file_row_and_field(tmp_path):
    rows = make_rows(12)
    rows[7] = {"input_ids": [5, 6, 7], "loss_mask": [1, 0]}
    pq.write_table(pa.table(columns(rows)), tmp_path / "bad.parquet", row_group_size=4)
    with pytest.raises(DataFormatError, match=r"bad\.parquet: row 7: 'loss_mask' needs 3 entries"):
        build_dataset(_data_cfg(tmp_path / "bad.parquet", tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("arrow_*"))  # nothing half-written is left behind


def test_a_dataset_dict_directory_names_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a", "b"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"a DatasetDict \(splits: train\); set data.path to one split"):
        build_dataset(_data_cfg(tmp_path / "dd", tmp_path / "cache"))


def test_a_file_larger_than_the_memory_it_may_use_streams_through(tmp_path):
    """20,000 rows of 200 token ids (4 M tokens: 32 MB as int64, several times that as Python
    objects) convert with a Python-allocation peak of a few record batches."""
    rng = np.random.default_rng(0)
    writer = None
    for _ in range(10):
        ids = rng.integers(1, 256, size=(2000, 200))
        table = pa.table({"input_ids": pa.array(list(ids), type=pa.list_(pa.int64()))})
        writer = writer or pq.ParquetWriter(tmp_path / "big.parquet", table.schema)
        writer.write_table(table, row_group_size=2000)
    writer.close()
    cfg = _data_cfg(tmp_path / "big.parquet", tmp_path / "cache", "data.max_seq_length=256")
    _indexed_dataset()  # imported before measuring: importing megatron-core allocates ~190 MiB itself
    tracemalloc.start()
    try:
        dataset, _ = build_dataset(cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(dataset) == 20_000 and int(dataset.lengths.sum()) == 4_000_000
    print(f"peak Python allocations {peak / 2**20:.1f} MiB for 32 MB of int64 tokens")
    assert peak < 8 << 20, f"peak Python allocations {peak / 2**20:.1f} MiB"


def test_preprocess_reads_parquet_like_jsonl(sources, tmp_path):
    from backend.commands.preprocess_data import main as preprocess

    assert preprocess(["--input", str(sources["jsonl"]), "--output-prefix", str(tmp_path / "j")]) == 0
    assert preprocess(["--input", str(sources["shards"]), "--output-prefix", str(tmp_path / "p")]) == 0
    for suffix in (".bin", "_loss_mask.bin", "_loss_weight.bin"):
        assert (tmp_path / f"j{suffix}").read_bytes() == (tmp_path / f"p{suffix}").read_bytes(), suffix
