"""A wandb run on rank 0 when ``logger.wandb.enable``; continues the run id a checkpoint recorded
(the trainer reads it from the checkpoint it resumes and passes it in).

The API key is never part of our config: wandb reads it from its own environment or login.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path


def start_wandb(cfg, env, *, run_id: str | None = None):
    w = cfg.logger.wandb
    if not env.is_main or not w.enable or w.mode == "disabled":
        return None
    import wandb

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
