"""Fixed versus dynamic microbatching on the same samples from the same initial weights.

Each arm is a real run in its own process group (``torchrun``), so its memory and time are its
own. Both arms build the model from the same seed and draw the same optimizer windows; they
differ only in the plan (or in the layout, e.g. dp 1 against dp 2). Rank 0 of each arm records,
per step, the window loss, the full gradient (before clipping) and the full parameter update.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from backend.distributed.collectives import all_gather_objects, dist_max
from backend.distributed.fsdp import full_tensor
from backend.distributed.launch import torchrun_command
from backend.model.tensor_parallel import full_param, plain_name


def _full_flat(model, named) -> torch.Tensor:
    """Every (name, tensor) of ``named`` whole (FSDP2 shards, then TP slices gathered), flattened
    into one FP64 vector: what each arm records, whatever its parallel layout. Under pipeline
    parallelism the stages' vectors are joined in stage order (the whole model's order), the last
    stage's tied embedding copy left out (the whole model has one)."""
    stage = getattr(model, "stage_names", None)
    parts = []
    for name, t in named:
        if stage is not None and stage.whole(plain_name(name)) is None:
            continue
        t = full_param(model, name, full_tensor(t))
        parts.append(t.detach().reshape(-1).double().cpu())
    mine = torch.cat(parts)
    if stage is None:
        return mine
    return torch.cat(all_gather_objects(mine, group=model.pipeline_group))


def watch_experts_held(model) -> dict:
    """The experts a rank computes with, read at each MoE layer's forward (FSDP2 has unsharded its
    parameters by then): all E at EP 1, E / EP under expert parallelism."""
    from backend.model.expert_parallel import experts_held

    held: dict = {}
    for module in model.modules():
        if hasattr(module, "experts_per_rank"):
            module.register_forward_pre_hook(lambda m, _args: held.update(experts=experts_held(m)))
    return held


def worker(argv: list[str]) -> int:
    """One arm, inside torchrun: ``python -m backend.bench.compare OUT STEPS CONFIG [overrides]``.

    Each step runs the trainer's own pieces (next window, forward/backward, update, metrics) with
    the full gradient recorded between the backward and the update."""
    out, steps, config, *overrides = argv
    from backend.config import load_config, validate
    from backend.distributed.setup import init_from_config, shutdown_distributed
    from backend.model import moe_stats
    from backend.train.step import apply_update, forward_backward
    from backend.train.trainer import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # the arms' peaks are part of the record: measured whatever the config says
    keys = [*overrides, "checkpoint.resume=false", "logger.wandb.enable=false", "train.memory_meter=always"]
    cfg = validate(load_config(config, keys), world)
    env = init_from_config(cfg)
    try:
        trainer = Trainer(cfg, env)
        named = list(trainer.model.named_parameters())
        model = trainer.model
        record: dict = {
            "loss": [],
            "grad_norm": [],
            "grad": [],
            "update": [],
            "step_time_s": [],
            "num_microbatches": [],
            "padding_efficiency": [],
        }
        held = watch_experts_held(trainer.model)
        peak = 0
        for _ in range(int(steps)):
            trainer.step += 1
            before = _full_flat(model, named)
            data, data_time = trainer.next_data()
            start = time.perf_counter()
            with trainer.meter.step():  # the trainer's memory meter: this step's peak on any device
                window = forward_backward(trainer.model, data, env, loss_cfg=trainer.cfg.loss)
            step_peak = trainer.meter.peak_bytes
            loss = window["loss"]
            grad_time = time.perf_counter() - start
            for key, value in window.items():  # the policy loss's metrics (pg_loss, clipfrac, ...)
                if key != "loss":
                    record.setdefault(key, []).append(value)
            for key, value in moe_stats.window_metrics(trainer.model, len(data.window_ids), env).items():
                record.setdefault(key, []).append(value)  # MoE models: aux loss, tokens per expert
            # before clipping; trained parameters only (LoRA: the frozen base has none)
            record["grad"].append(_full_flat(model, [(n, p.grad) for n, p in named if p.requires_grad]))
            start = time.perf_counter()
            with trainer.meter.step():
                update = apply_update(
                    trainer.model,
                    trainer.optimizer,
                    trainer.scheduler,
                    loss=loss,
                    clip_grad=cfg.optimizer.clip_grad,
                    step=trainer.step,
                    group=env.group("world"),
                )
            step_time = grad_time + time.perf_counter() - start  # the recording is not timed
            step_peak = max(step_peak, trainer.meter.peak_bytes)
            peak = max(peak, step_peak)
            out_row = {**window, **update, "step_time_s": step_time, "peak_memory_bytes": step_peak}
            metrics = trainer.log_step(data, out_row, data_time)
            record["update"].append(_full_flat(model, named) - before)
            for key in ("loss", "grad_norm", "step_time_s", "num_microbatches", "padding_efficiency"):
                record[key].append(metrics[key])
        record["params"] = _full_flat(model, named)
        record["peak_memory_bytes"] = int(dist_max(peak, env.device, group=env.group("world")))
        record["world_size"] = env.world_size
        record["expert_parallel_size"] = env.ep_size
        record["tensor_parallel_size"] = env.tp_size
        record["pipeline_parallel_size"] = env.pp_size
        stage = getattr(model, "stage_names", None)
        record["stage_layers"] = (
            all_gather_objects(stage.count, group=env.group("pp")) if stage is not None else [cfg.model.num_layers]
        )
        # the attention and MLP linear weights: elements this rank holds once FSDP2 has gathered
        # them (its TP slice) against the whole model's
        layers = [(n, p) for n, p in named if ".linear_" in n]
        record["layer_numel_held"] = sum(full_tensor(p).numel() for _, p in layers)
        record["layer_numel_whole"] = sum(full_param(model, n, full_tensor(p)).numel() for n, p in layers)
        record["experts_per_rank"] = held.get("experts")
        if env.is_main:
            torch.save(record, out)
    finally:
        shutdown_distributed(env)
    return 0


def run_arm(
    config: str, overrides: list[str], *, nproc: int, steps: int, out_dir: Path, name: str, timeout: float = 1800
) -> dict:
    """Launch one arm under torchrun and load what its rank 0 recorded."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.pt"
    cmd = torchrun_command(
        nproc,
        "-m",
        "backend.bench.compare",
        str(out),
        str(steps),
        config,
        *overrides,
        f"logger.run_dir={out_dir / name}",
    )
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(
            f"arm {name!r} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return torch.load(out, weights_only=True)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


# Window metrics of the policy loss compared arm against arm (worst step, relative to scale).
POLICY_METRICS = ("pg_loss", "kl", "entropy", "clipfrac", "approx_kl", "ratio_min", "ratio_max")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-12) if a != b else 0.0


def compare(ref: dict, other: dict) -> dict:
    """Agreement of ``other`` with ``ref`` (worst step) and their time and memory; for the policy
    loss also ``metric_rel_diff`` (each metric's worst relative difference)."""
    steps = len(ref["loss"])
    warm = slice(1, None) if steps > 1 else slice(None)
    metrics = {
        key: max(_rel(a, b) for a, b in zip(ref[key], other[key]))
        for key in POLICY_METRICS
        if key in ref and key in other
    }
    return {
        **({"metric_rel_diff": metrics} if metrics else {}),
        "steps": steps,
        "loss_ref": ref["loss"],
        "loss_other": other["loss"],
        "loss_rel_diff": max(_rel(a, b) for a, b in zip(ref["loss"], other["loss"])),
        "grad_cosine": min(_cos(a, b) for a, b in zip(ref["grad"], other["grad"])),
        "update_cosine": min(_cos(a, b) for a, b in zip(ref["update"], other["update"])),
        "rel_update_diff": max(float((a - b).norm() / a.norm()) for a, b in zip(ref["update"], other["update"])),
        "max_param_diff": float((ref["params"] - other["params"]).abs().max()),
        "step_time_ratio": statistics.median(ref["step_time_s"][warm]) / statistics.median(other["step_time_s"][warm]),
        "peak_memory_diff_bytes": ref["peak_memory_bytes"] - other["peak_memory_bytes"],
        "num_microbatches_ref": statistics.mean(ref["num_microbatches"]),
        "num_microbatches_other": statistics.mean(other["num_microbatches"]),
        "padding_efficiency_ref": statistics.mean(ref["padding_efficiency"]),
        "padding_efficiency_other": statistics.mean(other["padding_efficiency"]),
    }


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
