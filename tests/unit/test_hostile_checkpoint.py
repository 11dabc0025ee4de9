"""A hostile checkpoint directory: each attack is refused within seconds, naming the path, with no
code run and no file outside the directory read, and resume falls back to the previous checkpoint.

The payloads are built here: a hash bomb (tuples that each hold the previous one twice, used as a
dict key), a list graph as a file name, FIFOs, symlinks in and out, a sparse file declared 4 GiB
long, an object-dtype numpy array, a deflated archive, an ``_extra_state`` carrying a pickle,
and hostile ``meta.json`` values. One real checkpoint pair (steps 1 and 2 of a small model with
AdamW and the run's scheduler) is written once per module and copied per test.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import shutil
import signal
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from backend.checkpoint.bounded_pickle import UnsafeCheckpointError
from backend.checkpoint.files import CheckpointFileError, load_rng_file, only_torch_safe_globals
from backend.checkpoint.resume import resume_latest
from backend.checkpoint.safe_dcp import read_metadata_file, safe_load
from backend.checkpoint.store import complete_checkpoints, load_model_weights, resolve_step_dir, save_checkpoint
from backend.config import load_config
from backend.errors import CheckpointError
from backend.train.optim import build_optimizer, build_scheduler

REPO = Path(__file__).resolve().parents[2]
STEP1, STEP2 = "step_00000001", "step_00000002"


@contextmanager
def within(seconds: int):
    """Fail instead of hanging: the attack must be refused in ``seconds``."""

    def expired(signum, frame):
        raise TimeoutError(f"not refused within {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - start < seconds


def hash_bomb_pickle(levels: int = 60) -> bytes:
    """``{t: 1}`` where t holds the tuple of the level below twice: 300 bytes whose key hashes 2**60 times."""
    t = ()
    for _ in range(levels):
        t = (t, t)
    return b"\x80\x02}" + pickle.dumps(t, protocol=2)[2:-1] + b"K\x01s."


def archive_with(pkl: bytes, compress: int = zipfile.ZIP_STORED) -> bytes:
    """A torch.save-shaped zip holding ``pkl`` as its data.pkl."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=compress) as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)


class Run:
    """A model, AdamW and the run's scheduler, as resume sees them."""

    def __init__(self, cfg):
        torch.manual_seed(0)
        self.cfg = cfg
        self.model = Model()
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.scheduler, cfg.train.train_iters)

    def step(self):
        self.model.proj(self.model.embed(torch.tensor([1, 2, 3]))).square().mean().backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()


@pytest.fixture(autouse=True)
def _digests_the_attacker_wrote(monkeypatch):
    """A hostile checkpoint comes with digests of its own files (its meta.json is the attacker's
    too), so the digest check passes whatever was planted: these tests are about the readers behind
    it. tests/unit/test_checkpoint_integrity.py checks the digests themselves."""
    from backend.checkpoint import integrity, store

    monkeypatch.setattr(integrity, "mismatches", lambda *a, **k: [])
    monkeypatch.setattr(store, "mismatches", lambda *a, **k: [])


@pytest.fixture(scope="module")
def cfg():
    return load_config(REPO / "tests" / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def saved(world, cfg, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "checkpoints"
    run = Run(cfg)
    sampler = {"consumed": 0, "seed": 1, "num_samples": 10, "global_batch_size": 2, "shuffle": True}
    for step in (1, 2):
        run.step()
        sampler["consumed"] = 2 * step
        extra = {"data": {"sampler": dict(sampler)}, "wandb_run_id": None, "config": dataclasses.asdict(cfg)}
        save_checkpoint(root, step, run.model, run.optimizer, run.scheduler, env=world, extra=extra, keep_last=0)
    return root


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root, symlinks=True)
    return root


def resume(ckpt: Path, world, cfg, caplog) -> dict:
    """Resume a fresh run from ``ckpt``; the step it resumed from (2, or 1 after a fallback)."""
    run = Run(cfg)
    with caplog.at_level(logging.WARNING, logger="backend.train"), within(30):
        meta = resume_latest(ckpt, cfg, run.model, run.optimizer, run.scheduler, env=world)
    return meta


def assert_falls_back(ckpt, world, cfg, caplog, *, names: str):
    meta = resume(ckpt, world, cfg, caplog)
    assert meta["step"] == 1, "resumed from the hostile checkpoint"
    warning = " ".join(r.getMessage() for r in caplog.records if "cannot resume" in r.getMessage())
    assert str(ckpt / STEP2) in warning and names in warning, warning


def bytes_entry(step_dir: Path) -> str:
    md = read_metadata_file(step_dir / ".metadata")
    return next(k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata")


def plant_entry(step_dir: Path, fqn: str, archive: bytes, *, length: int | None = None) -> Path:
    """Point ``fqn``'s storage at a new file holding ``archive`` (the metadata rewritten to match)."""
    md = read_metadata_file(step_dir / ".metadata")
    target = step_dir / "__9_0.distcp"
    target.write_bytes(archive)
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            info.relative_path, info.offset, info.length = target.name, 0, len(archive) if length is None else length
    (step_dir / ".metadata").write_bytes(pickle.dumps(md))
    return target


def test_the_checkpoint_pair_resumes_from_the_newest(ckpt, world, cfg, caplog):
    meta = resume(ckpt, world, cfg, caplog)
    assert meta["step"] == 2 and not [r for r in caplog.records if "cannot resume" in r.getMessage()]


# ---- pickles: hash bombs, shared graphs, globals ------------------------------------------------


def test_a_hash_bomb_metadata_is_refused_and_resume_falls_back(ckpt, world, cfg, caplog):
    bomb = hash_bomb_pickle()
    assert len(bomb) < 400
    (ckpt / STEP2 / ".metadata").write_bytes(bomb)
    with within(5), pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing .*second reference to a tuple"):
        read_metadata_file(ckpt / STEP2 / ".metadata")
    assert_falls_back(ckpt, world, cfg, caplog, names=".metadata")


def test_a_list_graph_as_file_name_is_refused_without_printing_it(ckpt):
    md = read_metadata_file(ckpt / STEP2 / ".metadata")
    graph: list = []
    for _ in range(40):
        graph = [graph, graph]
    next(iter(md.storage_data.values())).relative_path = graph
    (ckpt / STEP2 / ".metadata").write_bytes(pickle.dumps(md))
    with within(5), pytest.raises(UnsafeCheckpointError) as err:
        read_metadata_file(ckpt / STEP2 / ".metadata")
    assert "second reference to a list" in str(err.value) and len(str(err.value)) < 400


def test_a_hash_bomb_in_a_non_tensor_entry_is_refused(ckpt, world, cfg, caplog):
    step2 = ckpt / STEP2
    plant_entry(step2, bytes_entry(step2), archive_with(hash_bomb_pickle()))
    with within(10), pytest.raises(UnsafeCheckpointError, match=r"__9_0\.distcp.*second reference to a tuple"):
        safe_load(_state(cfg), step2)
    assert_falls_back(ckpt, world, cfg, caplog, names="__9_0.distcp")


def _state(cfg) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run = Run(cfg)
    model_sd, optim_sd = get_state_dict(run.model, run.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def test_a_hash_bomb_or_a_list_as_rng_state_is_refused(ckpt, world, cfg, caplog):
    rng = ckpt / STEP2 / "rng_rank0.pt"
    rng.write_bytes(archive_with(hash_bomb_pickle()))
    with within(5), pytest.raises(UnsafeCheckpointError, match="rng_rank0.pt"):
        load_rng_file(rng)
    assert_falls_back(ckpt, world, cfg, caplog, names="rng_rank0.pt")
    buf = io.BytesIO()
    torch.save([torch.zeros(3, dtype=torch.uint8)], buf)
    rng.write_bytes(buf.getvalue())
    with pytest.raises(CheckpointFileError, match=r"rng_rank0.pt: not an RNG state"):
        load_rng_file(rng)


def test_an_object_ndarray_entry_is_refused_before_it_is_built(ckpt, cfg):
    import numpy as np

    step2 = ckpt / STEP2
    payload = pickle.dumps(np.empty(3, dtype=object))  # a real attack declares 2**29 elements: 4.6 GB
    plant_entry(step2, bytes_entry(step2), archive_with(payload))
    with within(5), pytest.raises(UnsafeCheckpointError, match=r"GLOBAL numpy\.\S*_reconstruct"):
        safe_load(_state(cfg), step2)


def test_torch_load_sees_only_torch_own_safe_globals():
    import numpy as np

    buf = io.BytesIO()
    torch.save({"a": np.zeros(2)}, buf)
    saved = torch.serialization.get_safe_globals()
    multiarray = getattr(np, "_core", None) or np.core
    torch.serialization.add_safe_globals([multiarray.multiarray._reconstruct, np.ndarray, np.dtype])
    try:
        before = torch.serialization.get_safe_globals()
        with only_torch_safe_globals(), pytest.raises(pickle.UnpicklingError):
            torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        assert set(map(id, torch.serialization.get_safe_globals())) == set(map(id, before))
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def test_a_compressed_tensor_archive_is_refused(ckpt, cfg):
    step2 = ckpt / STEP2
    md = read_metadata_file(step2 / ".metadata")
    fqn = next(k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "TensorStorageMetadata")
    buf = io.BytesIO()
    torch.save(torch.zeros(4, 8), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name in src.namelist():
            z.writestr(name, src.read(name))
    plant_entry(step2, fqn, out.getvalue())
    with within(5), pytest.raises(UnsafeCheckpointError, match=r"__9_0\.distcp: refusing a compressed archive member"):
        safe_load(_state(cfg), step2)


def test_a_declared_length_past_a_sparse_file_is_refused_before_reading(ckpt, cfg):
    step2 = ckpt / STEP2
    md = read_metadata_file(step2 / ".metadata")
    fqn = next(k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "TensorStorageMetadata")
    target = plant_entry(step2, fqn, b"", length=4 << 30)
    os.truncate(target, (4 << 30) + 1)  # sparse: 4 GiB long, no blocks
    with within(5), pytest.raises(UnsafeCheckpointError, match=r"declares 4,294,967,296 bytes, more than"):
        safe_load(_state(cfg), step2)


# ---- files: FIFOs and symlinks ------------------------------------------------------------------------


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "rng_rank0.pt", "meta.json"])
def test_a_fifo_in_place_of_a_file_is_refused_without_blocking(ckpt, world, cfg, caplog, name):
    target = ckpt / STEP2 / name
    target.unlink()
    os.mkfifo(target)
    assert_falls_back(ckpt, world, cfg, caplog, names=f"{name}: refusing a checkpoint file that is a FIFO")


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "rng_rank0.pt", "meta.json"])
def test_a_symlinked_file_is_refused_even_into_another_checkpoint(ckpt, world, cfg, caplog, name):
    target = ckpt / STEP2 / name
    target.unlink()
    target.symlink_to(ckpt / STEP1 / name)  # another run's weights would load with rc 0
    assert_falls_back(ckpt, world, cfg, caplog, names=f"{name}: refusing a symbolic link")


def test_a_symlink_out_of_the_directory_is_never_opened(ckpt, world, cfg):
    (ckpt / STEP2 / "rng_rank0.pt").unlink()
    (ckpt / STEP2 / "rng_rank0.pt").symlink_to("/etc/passwd")
    atime = os.stat("/etc/passwd").st_atime_ns
    with pytest.raises(CheckpointFileError, match="rng_rank0.pt: refusing a symbolic link"):
        load_rng_file(ckpt / STEP2 / "rng_rank0.pt")
    assert os.stat("/etc/passwd").st_atime_ns == atime


def test_a_step_directory_that_is_a_symlink_is_skipped_and_refused(ckpt, world, cfg, caplog, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    (ckpt / STEP2).rename(elsewhere)
    (ckpt / STEP2).symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="backend.train"):
        assert [p.name for p in complete_checkpoints(ckpt)] == [STEP1]
    assert any("symbolic link" in r.getMessage() for r in caplog.records)
    with pytest.raises(CheckpointFileError, match="step directory that is a symbolic link"):
        resolve_step_dir(ckpt / STEP2)
    with pytest.raises(CheckpointFileError, match="step directory that is a symbolic link"):
        load_model_weights(Run(cfg).model, ckpt / STEP2)
    assert resume(ckpt, world, cfg, caplog)["step"] == 1


@pytest.mark.parametrize("occupant", ["symlink", "file", "dangling"])
def test_a_step_name_held_by_a_link_or_a_file_is_replaced_without_following_it(
    ckpt, world, cfg, caplog, tmp_path, occupant
):
    """A save of step 3 where step_00000003 (and its temporary name) is a symbolic link to a
    directory elsewhere, a plain file or a dangling link: the link itself is replaced, with a
    warning; nothing it points at is touched; the new checkpoint resumes."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("precious")
    for name in ("step_00000003", ".tmp_step_00000003"):
        path = ckpt / name
        if occupant == "symlink":
            path.symlink_to(elsewhere)
        elif occupant == "file":
            path.write_text("not a checkpoint")
        else:
            path.symlink_to(tmp_path / "missing")
    run = Run(cfg)
    run.step()
    extra = {
        "data": {"sampler": {"consumed": 6, "seed": 1, "num_samples": 10, "global_batch_size": 2, "shuffle": True}},
        "wandb_run_id": None,
        "config": dataclasses.asdict(cfg),
    }
    with caplog.at_level(logging.WARNING), within(30):
        saved = save_checkpoint(ckpt, 3, run.model, run.optimizer, run.scheduler, env=world, extra=extra, keep_last=0)
    assert saved.is_dir() and not saved.is_symlink() and (saved / "meta.json").is_file()
    assert (
        sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
        and (elsewhere / "keep.txt").read_text() == "precious"
    )
    warnings = [r.getMessage() for r in caplog.records if "replacing a" in r.getMessage()]
    assert len(warnings) == 2 and all("occupied a checkpoint's name" in w for w in warnings), warnings
    assert resume(ckpt, world, cfg, caplog)["step"] == 3


def test_a_damaged_tensor_archive_names_the_file_and_the_reason(ckpt, world, cfg, caplog):
    """Bytes flipped inside a shard's first archive: torch's own reader fails; the warning names
    the shard, the bytes of the entry and torch's reason (not 'CheckpointException ranks:[0]')."""
    shard = next((ckpt / STEP2).glob("__*.distcp"))
    data = bytearray(shard.read_bytes())
    for i in range(10, 74):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert_falls_back(ckpt, world, cfg, caplog, names=f"{shard.name} (bytes 0..")
    warning = " ".join(r.getMessage() for r in caplog.records if "cannot resume" in r.getMessage())
    assert "unreadable: " in warning and "CheckpointException ranks" not in warning, warning


# ---- extra state: no pickle reaches a module ----------------------------------------------------------


class TeLikeLinear(nn.Linear):
    """Transformer Engine's extra-state handling: a non-empty uint8 tensor is unpickled."""

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state):
        if isinstance(state, torch.Tensor) and state.numel():
            pickle.loads(state.numpy().tobytes())


class Touch:
    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch '{self.path}'",))


def test_a_pickle_in_extra_state_never_reaches_the_module(tmp_path):
    marker = tmp_path / "MARKER"
    payload = torch.frombuffer(bytearray(pickle.dumps(Touch(marker))), dtype=torch.uint8)
    path = tmp_path / "ckpt"
    module = TeLikeLinear(4, 4)
    state = module.state_dict()
    state["_extra_state"] = payload
    dcp.save({"model": state}, checkpoint_id=path)
    fresh = TeLikeLinear(4, 4)
    want = {"model": fresh.state_dict()}
    with pytest.raises(UnsafeCheckpointError, match=r"ckpt: refusing a non-empty _extra_state tensor \(model\._extra"):
        safe_load(want, path)
    assert not marker.exists()
    # The megatron-core form (extra state None, stored as bytes) carrying pickled bytes instead.
    dcp.save({"model": {"weight": torch.ones(2), "_extra_state": pickle.dumps(Touch(marker))}}, checkpoint_id=path)
    with pytest.raises(UnsafeCheckpointError, match="refusing a non-empty _extra_state"):
        safe_load({"model": {"weight": torch.zeros(2), "_extra_state": None}}, path)
    assert not marker.exists()


def test_an_entry_of_the_other_kind_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2), "x": b"bytes"}, checkpoint_id=path)
    with pytest.raises(UnsafeCheckpointError, match=r"refusing entry x: stored as bytes, but this run loads a tensor"):
        safe_load({"w": torch.zeros(2), "x": torch.zeros(2)}, path)


# ---- meta.json --------------------------------------------------------------------------------------


def _edit_meta(ckpt: Path, edit) -> None:
    file = ckpt / STEP2 / "meta.json"
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "edit, names",
    [
        (lambda m: m.update(step=-1), "has step of type int outside"),
        (lambda m: m.update(step="../x"), "has step of type str"),
        (lambda m: m.update(step=7), "says step 7, but its directory is step_00000002"),
        (lambda m: m["scheduler"].update(last_epoch=10**400), "scheduler state's last_epoch is a int unlike"),
        (lambda m: m["scheduler"].update(evil=1), "scheduler state holds unknown key"),
        (lambda m: m.update(dp_size=0), "has dp_size of type int outside"),
        (lambda m: m["data"]["sampler"].update(consumed="../x"), "data.sampler.consumed of type str"),
        (lambda m: m.update(extra={"a": 1}), "holds 1 unknown key"),
    ],
    ids=["step-1", "step-path", "step-mismatch", "huge-last-epoch", "unknown-scheduler-key", "dp0", "consumed", "key"],
)
def test_hostile_meta_values_fall_back_to_the_previous_checkpoint(ckpt, world, cfg, caplog, edit, names):
    _edit_meta(ckpt, edit)
    assert_falls_back(ckpt, world, cfg, caplog, names=names)


def test_a_deeply_nested_meta_json_falls_back(ckpt, world, cfg, caplog):
    (ckpt / STEP2 / "meta.json").write_text("[" * 200_000 + "]" * 200_000)
    assert_falls_back(ckpt, world, cfg, caplog, names="unreadable checkpoint metadata (RecursionError)")


def test_no_checkpoint_left_names_every_path(ckpt, world, cfg, caplog):
    for step in (STEP1, STEP2):
        (ckpt / step / ".metadata").write_bytes(hash_bomb_pickle())
    run = Run(cfg)
    with within(30), pytest.raises(CheckpointError) as err:
        resume_latest(ckpt, cfg, run.model, run.optimizer, run.scheduler, env=world)
    assert str(ckpt / STEP1) in str(err.value) and str(ckpt / STEP2) in str(err.value)


def test_a_dup_bomb_and_a_build_on_a_class_are_refused(ckpt):
    import pathlib

    md_file = ckpt / STEP2 / ".metadata"
    md_file.write_bytes(b"\x80\x02}N" + b"2\x86" * 60 + b"K\x01s.")  # DUP: a second reference without the memo
    with within(5), pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing .* the opcode DUP"):
        read_metadata_file(md_file)
    # BUILD with slot state on an admitted class would set class attributes for the whole process.
    name = pathlib.PurePath.name
    md_file.write_bytes(b"\x80\x02cpathlib\nPurePath\nN}X\x04\x00\x00\x00nameX\x01\x00\x00\x00xs\x86b.")
    with within(5), pytest.raises(UnsafeCheckpointError, match=r"BUILD on a type"):
        read_metadata_file(md_file)
    assert pathlib.PurePath.name is name


def test_metadata_objects_without_their_fields_are_refused(ckpt):
    from torch.distributed.checkpoint.metadata import Metadata

    md_file = ckpt / STEP2 / ".metadata"
    bare = Metadata.__new__(Metadata)  # no state_dict_metadata, no storage_data
    md_file.write_bytes(pickle.dumps(bare))
    with pytest.raises(UnsafeCheckpointError, match=r"lack their fields \(AttributeError\)"):
        read_metadata_file(md_file)
    md = read_metadata_file(ckpt / STEP1 / ".metadata")
    md.storage_meta = 5
    md_file.write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match="storage_meta is not a StorageMeta"):
        read_metadata_file(md_file)
