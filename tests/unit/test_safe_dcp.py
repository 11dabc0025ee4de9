"""Loading distributed checkpoints without running code from them (backend.checkpoint.safe_dcp)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from backend.checkpoint.safe_dcp import (
    CheckpointLayoutError,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    read_metadata_file,
    safe_load,
)
from backend.errors import CheckpointError, UserError


class Touch:
    """Unpickling this runs ``touch PATH``: the payload a crafted checkpoint would carry."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch '{self.path}'",))


def small_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 5, bias=False)).to(dtype)


def train_one_step(model: nn.Module) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3, 4]])).float().square().mean().backward()
    opt.step()
    return opt


def flat(state) -> dict:
    out = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(f"{prefix}.{i}", v)
        else:
            out[prefix] = obj.full_tensor() if hasattr(obj, "full_tensor") else obj

    walk("", state)
    return out


def assert_same_state(a, b):
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        if isinstance(fa[k], torch.Tensor):
            assert torch.equal(fa[k], fb[k]), k
        else:
            assert fa[k] == fb[k], k


def save_plain(tmp_path: Path) -> tuple[Path, dict]:
    model = small_model()
    opt = train_one_step(model)
    msd, osd = get_state_dict(model, opt)
    path = tmp_path / "ckpt"
    dcp.save({"model": msd, "optim": osd, "extra": {"step": 7, "name": "run", "lr": [0.5, 1]}}, checkpoint_id=path)
    return path, {"model": msd, "optim": osd}


def test_safe_load_restores_a_model_and_adamw_state(tmp_path):
    path, saved = save_plain(tmp_path)
    fresh = small_model()
    for p in fresh.parameters():
        p.data.zero_()
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    msd, osd = get_state_dict(fresh, opt)
    state = {"model": msd, "optim": osd, "extra": {"step": 0, "name": "", "lr": [0.0, 0]}}
    safe_load(state, path)
    set_state_dict(fresh, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["extra"] == {"step": 7, "name": "run", "lr": [0.5, 1]}
    assert_same_state({"model": state["model"], "optim": state["optim"]}, saved)
    assert opt.state_dict()["state"][0]["step"].item() == 1.0


def test_an_fsdp2_bf16_checkpoint_loads_through_the_allowlist(tmp_path):
    """A real FSDP2 (DTensor) model + AdamW checkpoint, in a one-process gloo world."""
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = small_model(torch.bfloat16)
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        opt = train_one_step(model)
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ckpt")
        md = read_metadata_file(tmp_path / "ckpt" / ".metadata")
        assert md.state_dict_metadata["model.0.weight"].properties.dtype == torch.bfloat16

        fresh = small_model(torch.bfloat16)
        for layer in fresh:
            fully_shard(layer)
        fully_shard(fresh)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        fmsd, fosd = get_state_dict(fresh, fresh_opt)
        state = {"model": fmsd, "optim": fosd}
        safe_load(state, tmp_path / "ckpt")
        assert_same_state(state, {"model": msd, "optim": osd})
    finally:
        dist.destroy_process_group()


def plant_metadata(path: Path, payload) -> Path:
    (path / ".metadata").write_bytes(pickle.dumps(payload))
    return path / ".metadata"


def test_a_planted_metadata_payload_is_refused_and_never_runs(tmp_path):
    path, saved = save_plain(tmp_path)
    marker = tmp_path / "MARKER"
    md_file = plant_metadata(path, Touch(marker))
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_load(saved, path)
    msg = str(err.value)
    assert msg.startswith(f"{md_file}: refusing") and f"{os.system.__module__}.system" in msg
    assert isinstance(err.value, CheckpointError) and isinstance(err.value, UserError)
    assert not marker.exists()


def test_a_payload_hidden_inside_real_metadata_is_refused(tmp_path):
    path, saved = save_plain(tmp_path)
    md = read_metadata_file(path / ".metadata")
    md.planner_data = {"model.0.weight": Touch(tmp_path / "MARKER")}
    plant_metadata(path, md)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refusing"):
        safe_load(saved, path)
    assert not (tmp_path / "MARKER").exists()


def test_plain_dcp_load_runs_the_payload(tmp_path):
    """What this module guards against, in torch 2.13: if this starts failing, torch fixed it."""
    path, saved = save_plain(tmp_path)
    marker = tmp_path / "MARKER"
    plant_metadata(path, Touch(marker))
    with pytest.raises(CheckpointException):  # the payload ran, then DCP found an int, not Metadata
        dcp.load(saved, checkpoint_id=path)
    assert marker.exists()


def test_a_storage_entry_pointing_outside_the_directory_is_refused(tmp_path):
    path, saved = save_plain(tmp_path)
    md = read_metadata_file(path / ".metadata")
    index = next(iter(md.storage_data))
    md.storage_data[index].relative_path = "../../etc/passwd"
    plant_metadata(path, md)
    with pytest.raises(UnsafeCheckpointError, match="points outside the checkpoint directory"):
        safe_load(saved, path)


def test_truncated_or_missing_metadata_is_a_checkpoint_error(tmp_path):
    path, saved = save_plain(tmp_path)
    data = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata: unreadable checkpoint metadata"):
        safe_load(saved, path)
    (path / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="no such file"):
        safe_load(saved, path)


@pytest.mark.parametrize("planner", [None, DefaultLoadPlanner()], ids=["safe-planner", "default-planner"])
def test_a_non_tensor_entry_that_needs_code_is_refused(tmp_path, planner):
    """DCP torch.save()s non-tensor entries; the default planner loads them with weights_only=False."""
    marker = tmp_path / "MARKER"
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3), "evil": Touch(marker)}, checkpoint_id=path)
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError) as err:
        safe_load({"w": torch.zeros(3), "evil": None}, path, planner=planner)
    msg = str(err.value)
    assert msg.startswith(str(path / "__0_0.distcp") + " (evil): refusing a non-tensor checkpoint entry")
    assert f"GLOBAL {os.system.__module__}.system" in msg
    assert not marker.exists()


def test_the_reader_works_with_dcp_load_directly(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4.0), "meta": {"a": [1, 2]}}, checkpoint_id=path)
    state = {"w": torch.zeros(4), "meta": {"a": [0, 0]}}
    dcp.load(state, storage_reader=SafeFileSystemReader(path), planner=DefaultLoadPlanner())
    assert torch.equal(state["w"], torch.arange(4.0)) and state["meta"] == {"a": [1, 2]}


def test_bytes_from_a_default_planner_are_reserialised_plain_data(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"x": {"k": (1, "s", 2.5)}}, checkpoint_id=path)
    seen = []

    class Recording(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO):
            seen.append(value.getvalue())
            value.seek(0)
            super().load_bytes(read_item, value)

    state = {"x": {"k": None}}
    safe_load(state, path, planner=Recording())
    assert state == {"x": {"k": (1, "s", 2.5)}} and seen


def test_a_checkpoint_of_another_layout_names_the_path_and_the_entries(tmp_path):
    """A model whose parameters are named differently from the saved ones (e.g. experts stacked
    instead of one module per expert) is refused before anything is read, naming both sides."""
    path, _ = save_plain(tmp_path)
    other = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 5, bias=True))
    state = {"model": other.state_dict()}
    with pytest.raises(CheckpointLayoutError) as err:  # resume stops on it (no fallback to older ones)
        safe_load(state, path)
    msg = str(err.value)
    assert str(path) in msg and "lacks 1 of the" in msg and "model.3.bias" in msg
    state = {"model": {"renamed.weight": torch.zeros(11, 8)}, "extra": {"step": 0, "name": "", "lr": [0.0, 0]}}
    with pytest.raises(
        CheckpointError,
        match=r"lacks 1 of the 4 .*model\.renamed\.weight.* holds \d+ this run does not \(e\.g\. model\.0\.weight",
    ):
        safe_load(state, path)
