"""Checkpoints: model and optimizer through torch.distributed.checkpoint, plus step, scheduler,
data-stream, RNG and run metadata. Written atomically: everything goes to a hidden temporary
directory that is renamed into place only when complete, so a kill at any moment leaves either
the previous complete checkpoint or the new one, never half of one. Loading never unpickles:
DCP for tensors (its pickled ``.metadata`` through a restricted, bounded unpickler, see
``safe_dcp``), validated JSON for metadata (``checkpoint_meta``), checked archives for RNG states;
no file is followed through a symlink and a step directory that is a symlink is skipped
(``checkpoint_files``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from backend.distributed.collectives import all_gather_objects
from backend.errors import CheckpointError
from backend.model.lora import has_adapters

from .files import check_step_dir, load_rng_file
from .integrity import ALGORITHM, check, digest_share, mismatches, step_files, verify_step
from .meta import META, STEP_DIR, read_meta, restore_scheduler
from .pp_state import to_whole_names
from .safe_dcp import safe_load
from .tp_state import from_whole_layout, to_whole_layout

log = logging.getLogger(__name__)

__all__ = ["META", "ResumeError", "complete_checkpoints", "load_checkpoint", "read_meta", "save_checkpoint"]


class ResumeError(CheckpointError):
    """The checkpoint is readable but does not fit this run (its parallel layout differs)."""


def complete_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (a directory is complete once it has its final name)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        if not STEP_DIR.match(p.name):
            continue
        if p.is_symlink():
            log.warning("%s: skipping a checkpoint step directory that is a symbolic link", p)
        elif p.is_dir() and os.path.lexists(p / META):  # a bad meta.json is reported, not passed over
            found.append(p)
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def clear_path(path: Path) -> None:
    """Free ``path`` for a new checkpoint directory without following anything there: a real
    directory (an older save of the same step) is removed; a symbolic link (dangling or not) or
    any other file is unlinked itself, never its target, with a warning, since our saves write
    neither (resume skips such a step directory, and rmtree or os.replace on it failed every
    restart until someone removed it by hand)."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        kind = "symbolic link" if path.is_symlink() else "file"
        target = f" to {os.readlink(path)}" if path.is_symlink() else ""
        log.warning(
            "%s: replacing a %s%s that occupied a checkpoint's name (its target is left alone)", path, kind, target
        )
        path.unlink()
    else:
        shutil.rmtree(path)


def resolve_step_dir(path: str | Path) -> Path:
    """A checkpoint given as a step_* directory, or as a checkpoint directory (its newest complete one)."""
    path = Path(path)
    if os.path.lexists(path / ".metadata"):
        check_step_dir(path)
        return path
    found = complete_checkpoints(path)
    if not found:
        raise CheckpointError(f"{path}: neither a complete checkpoint (no .metadata) nor a directory holding one")
    return found[-1]


def state_options(model) -> StateDictOptions | None:
    """LoRA (``backend.model.lora``): a checkpoint holds the trained parameters only (the adapters,
    a critic's head) and their optimizer state, never the frozen base again: it is named by its
    source and digest in ``meta.json`` (``lora_base``) and rebuilt from it. None: everything."""
    if not has_adapters(model):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def load_model_weights(model, step_dir: str | Path) -> None:
    """Only the model's weights from one of our checkpoints, pickle-free (``safe_load``); the
    optimizer state in it is not read. For forward-only models: log-probabilities, references, export."""
    check_step_dir(step_dir)
    verify_step(Path(step_dir))
    options = state_options(model)
    model_sd = get_model_state_dict(model, options=options)
    whole, _, swapped = to_whole_layout(model, model_sd, fill=False)  # tensor parallelism: whole tensors on disk
    whole, _ = to_whole_names(model, whole, saving=False)  # pipeline parallelism: the whole model's names
    safe_load({"model": whole}, step_dir)
    from_whole_layout(model, swapped)
    set_model_state_dict(model, model_sd, options=options)


def save_checkpoint(
    ckpt_dir,
    step: int,
    model,
    optimizer,
    scheduler,
    *,
    env,
    extra: dict,
    keep_last: int,
    files: dict | None = None,
    protect: frozenset[int] = frozenset(),
) -> Path:
    """``files``: name -> bytes that rank 0 writes into the step directory beside the state (a
    caller's own data, digested and checked on load like every other file). ``protect``: steps
    that ``keep_last`` never removes (``checkpoint.keep_best``'s best step)."""
    root = Path(ckpt_dir)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        clear_path(tmp)
        tmp.mkdir()
    dist.barrier(group=env.group("world"))
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_options(model))
    model_sd, optim_sd, _ = to_whole_layout(model, model_sd, optim_sd, fill=True)  # TP: the whole tensors' layout
    model_sd, optim_sd = to_whole_names(model, model_sd, optim_sd, env=env, saving=True)  # PP: the whole model's names
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    rng = {"cpu": torch.get_rng_state()}
    if env.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(env.device)
    torch.save(rng, tmp / f"rng_rank{env.rank}.pt")
    if env.is_main:
        for name, data in (files or {}).items():
            (tmp / name).write_bytes(data)
    world = env.group("world")
    dist.barrier(group=world)  # every rank's files are written: hash them, a share each
    names = step_files(tmp)
    shares = all_gather_objects(digest_share(tmp, names, env.rank, env.world_size), group=world)
    if env.is_main:
        digests = {"algorithm": ALGORITHM, "files": {k: v for share in shares for k, v in share.items()}}
        meta = {
            "step": step,
            "scheduler": scheduler.state_dict(),
            "world_size": env.world_size,
            "dp_size": env.dp_size,
            "cp_size": env.cp_size,
            "parallel": env.dims.sizes(),  # every dimension (world_size, dp, cp, ep, tp, pp)
            "digests": digests,  # every other file's, checked on load (integrity.py)
            **extra,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1))
    dist.barrier(group=env.group("world"))
    if env.is_main:
        clear_path(final)
        os.replace(tmp, final)  # the commit point
        if keep_last:
            for old in complete_checkpoints(root)[:-keep_last]:
                if int(STEP_DIR.match(old.name).group(1)) not in protect:
                    shutil.rmtree(old, ignore_errors=True)
    dist.barrier(group=env.group("world"))
    return final


BEST = "best.json"


def read_best(ckpt_dir) -> dict | None:
    """``checkpoint.keep_best``'s record in ``ckpt_dir`` ({"step", "valid_loss", "path"}), or None
    when there is none (or it is unreadable: a new best then replaces it)."""
    path = Path(ckpt_dir) / BEST
    try:
        best = json.loads(path.read_text(encoding="utf-8"))
        return best if isinstance(best, dict) and isinstance(best.get("step"), int) else None
    except (OSError, ValueError):
        return None


def write_best(ckpt_dir, step: int, valid_loss: float) -> dict:
    """Record ``step`` as the best (atomically: a temporary file renamed over ``best.json``)."""
    root = Path(ckpt_dir)
    best = {"step": step, "valid_loss": valid_loss, "path": str(root / f"step_{step:08d}")}
    tmp = root / f".{BEST}.tmp"
    tmp.write_text(json.dumps(best), encoding="utf-8")
    os.replace(tmp, root / BEST)
    return best


def load_checkpoint(
    path: str | Path, model, optimizer, scheduler, *, env, allow_dp_change: bool, meta: dict | None = None
) -> dict:
    """Restore in place; returns the metadata (step, data state, ...). Never unpickles: DCP through
    the restricted reader (``safe_dcp``), JSON, and ``torch.load(weights_only=True)``."""
    path = Path(path)
    check_step_dir(path)
    meta = read_meta(path) if meta is None else meta
    found = mismatches(path, meta["digests"], env.rank, env.world_size) if "digests" in meta else []
    check(path, meta, [m for part in all_gather_objects(found, group=env.group("world")) for m in part])
    old_tp = (meta.get("parallel") or {}).get("tp", 1)
    # a TP change in a world of the same size moves ranks between TP and DP: the same windows, dealt anew
    tp_moved = old_tp != env.tp_size and meta["dp_size"] * old_tp == env.dp_size * env.tp_size
    if meta["cp_size"] != env.cp_size or (meta["dp_size"] != env.dp_size and not (allow_dp_change or tp_moved)):
        raise ResumeError(
            f"{path} was written with data-parallel size {meta['dp_size']} and context-parallel size "
            f"{meta['cp_size']}; this run has {env.dp_size} and {env.cp_size}. Resuming would change the data "
            f"order and plans; keep the layout, or set checkpoint.allow_dp_change=true to accept a new order "
            f"(context-parallel size must match)"
        )
    options = state_options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    whole_model, whole_optim, swapped = to_whole_layout(model, model_sd, optim_sd, fill=False)
    whole_model, whole_optim = to_whole_names(model, whole_model, whole_optim, saving=False)
    safe_load({"model": whole_model, "optim": whole_optim}, path)
    from_whole_layout(model, swapped)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
    restore_scheduler(scheduler, meta["scheduler"], path / META)
    rng_file = path / f"rng_rank{env.rank}.pt"
    if os.path.lexists(rng_file):
        rng = load_rng_file(rng_file)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and env.device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], env.device)
    log.info("resumed from %s (step %d)", path, meta["step"])
    return meta
