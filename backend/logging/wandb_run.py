"""A wandb run on rank 0 when ``logger.wandb.enable``; resumes the run id a checkpoint recorded.

The API key is never part of our config: wandb reads it from its own environment or login.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from backend.train.checkpoint import META, complete_checkpoints


def start_wandb(cfg, env):
    w = cfg.logger.wandb
    if not env.is_main or not w.enable or w.mode == "disabled":
        return None
    import wandb

    run_id = None
    ckpt_dir = Path(cfg.checkpoint.dir or Path(cfg.logger.run_dir) / "checkpoints")
    if cfg.checkpoint.resume and (found := complete_checkpoints(ckpt_dir)):
        run_id = json.loads((found[-1] / META).read_text()).get("wandb_run_id")
    Path(cfg.logger.run_dir).mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=w.project,
        entity=w.entity or None,
        name=w.name or None,
        group=w.group or None,
        tags=list(w.tags) or None,
        mode=w.mode,
        dir=cfg.logger.run_dir,
        config=dataclasses.asdict(cfg),
        id=run_id,
        resume="allow" if run_id else None,
    )
