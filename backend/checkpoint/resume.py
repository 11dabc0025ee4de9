"""Resuming a run: the newest checkpoint that loads, checked against this run's config.

Order of checks, and why:
1. ``meta.json`` must parse (else: the checkpoint is damaged; fall back to the previous one).
2. The stored config is compared with this run's (``resume_policy``): a change to the model, the
   data stream or the parallel layout is refused, naming every key, *before* any tensor is read,
   so a ``model.hidden_size`` change is a one-line error instead of a size-mismatch traceback.
   ``checkpoint.allow_config_change=true`` accepts such changes (logged as warnings).
3. Tensors load through the restricted DCP reader. A failure on any rank (a truncated ``.distcp``,
   a planted ``.metadata``) is agreed by all ranks (one all-reduce) and the previous complete
   checkpoint is tried; with none left the run stops, naming every path it tried and why. A
   readable checkpoint of another parallel or parameter layout (``ResumeError``,
   ``CheckpointLayoutError``) stops the run instead: an older one would silently lose steps.
4. Optimizer hyperparameters and the learning rate come from this run's config, not from the
   checkpoint: torch restores ``lr``, ``betas``, ``weight_decay`` and the scheduler's ``base_lrs``
   from the state dicts, which silently ignored an ``optimizer.lr`` change on resume.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from backend.distributed.collectives import dist_any
from backend.errors import CheckpointError

from .lora_base import check_base
from .resume_policy import diff_resume_config
from .safe_dcp import CheckpointLayoutError
from .store import ResumeError, complete_checkpoints, load_checkpoint, read_meta

log = logging.getLogger(__name__)


class NoUsableCheckpointError(CheckpointError):
    pass


def resume_latest(
    ckpt_dir: Path, cfg, model, optimizer, scheduler, *, env, unread: tuple[str, ...] = (), base: dict | None = None
) -> dict | None:
    """Restore the newest loadable checkpoint in ``ckpt_dir`` in place; its metadata, or None.
    ``unread``: config keys the driver never reads, whose changes are allowed (``diff_resume_config``).
    ``base``: a LoRA run's base (``lora_base.base_identity``), which the checkpoint's must equal."""
    candidates = complete_checkpoints(ckpt_dir)
    tried: list[str] = []
    for path in reversed(candidates):
        reason = None
        try:
            meta = read_meta(path)
        except CheckpointError as e:
            reason = str(e)
        if reason is None:
            _check_config(meta, cfg, path, unread)
            check_base(meta, base, path)
            try:
                load_checkpoint(
                    path,
                    model,
                    optimizer,
                    scheduler,
                    env=env,
                    allow_dp_change=cfg.checkpoint.allow_dp_change,
                    meta=meta,
                )
            except (ResumeError, CheckpointLayoutError):
                raise  # readable but not for this layout: the user decides, no silent fallback
            except (CheckpointError, CheckpointException, OSError, RuntimeError, ValueError, KeyError) as e:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist_any(reason is not None, env.device, group=env.group("world")):
            tried.append(f"{path} ({reason or 'failed on another rank'})")
            log.warning(
                "cannot resume from %s: %s; trying the previous checkpoint", path, reason or "another rank failed"
            )
            continue
        apply_optimizer_config(optimizer, scheduler, cfg.optimizer)
        if tried:
            log.warning("resumed from %s after skipping %d damaged checkpoint(s)", path, len(tried))
        return meta
    if tried:
        raise NoUsableCheckpointError(
            f"{ckpt_dir}: no checkpoint could be loaded; tried "
            + "; ".join(tried)
            + " (set checkpoint.resume=false to start afresh, or checkpoint.dir to another directory)"
        )
    return None


def _check_config(meta: dict, cfg, path: Path, unread: tuple[str, ...] = ()) -> None:
    diff = diff_resume_config(meta.get("config") or {}, dataclasses.asdict(cfg), unread=unread)
    for line in diff.summary():
        log.info("resume %s: %s", path.name, line)
    if diff.refused:
        if not cfg.checkpoint.allow_config_change:
            raise CheckpointError(
                diff.message(str(path)) + " (or set checkpoint.allow_config_change=true to accept the change)"
            )
        for key, old, new in diff.refused:
            log.warning("resume %s: accepting %s: %r -> %r (checkpoint.allow_config_change=true)", path, key, old, new)


def apply_optimizer_config(optimizer, scheduler, opt_cfg) -> None:
    """This run's lr, betas, eps and weight decay over what the checkpoint restored.

    Group 0 holds the decayed weights (see ``optim.build_optimizer``); group 1 never decays. The lr
    is recomputed exactly as the scheduler does (base lr x the schedule factor at its last step),
    so an unchanged config gives bitwise the restored value.
    """
    for i, group in enumerate(optimizer.param_groups):
        group["betas"] = (opt_cfg.adam_beta1, opt_cfg.adam_beta2)
        group["eps"] = opt_cfg.adam_eps
        group["weight_decay"] = opt_cfg.weight_decay if i == 0 else 0.0
        group["initial_lr"] = opt_cfg.lr
    scheduler.base_lrs = [opt_cfg.lr] * len(optimizer.param_groups)
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
