"""The trainer: build everything from the config, then run optimizer steps. Reads top to bottom."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path

from backend.batching.memory_fit import BUDGET_QUANTUM, BudgetError
from backend.checkpoint.metrics_rewind import rewind_metrics
from backend.checkpoint.resume import resume_latest
from backend.checkpoint.run_lock import hold_run_dirs
from backend.checkpoint.store import save_checkpoint
from backend.config import Config, ConfigError, checkpoint_dir, save_config
from backend.config.run_values import resolve_run_config
from backend.data.build import build_dataset
from backend.data.errors import DataError
from backend.data.iterator import DataIterator, StepData, bucket_edges_for, planner_from_config
from backend.data.prefetch import PrefetchingIterator, SyncIterator
from backend.data.row_fields import format_ignored, row_fields
from backend.data.sampler import WindowSampler, oversampling_factor
from backend.data.split import build_train_and_valid, evaluation_ids
from backend.data.tokenizers import build_tokenizer
from backend.distributed.collectives import dist_max
from backend.distributed.plan_check import check_plan_agreement
from backend.distributed.setup import check_world_matches_allocation, describe_world
from backend.logging.console import format_end_summary, format_startup_summary, length_stats
from backend.logging.metrics import MetricsLogger, plan_metrics
from backend.model.factory import build_model

from .evaluate import validation_loss
from .memory_meter import MemoryMeter, resident_tensors
from .memory_probe import probe_memory
from .optim import build_optimizer, build_scheduler
from .preemption import StopRequest
from .rollout import RolloutStream, build_reference
from .step import train_step

log = logging.getLogger(__name__)


def describe_experts(num_experts: int, env) -> str | None:
    """The start-up summary's experts line (None for a dense model): how many a rank computes with."""
    if not num_experts:
        return None
    if env.ep_size == 1:
        return (
            f"{num_experts} a layer, all gathered on every rank for each layer (FSDP2 over {env.world_size} rank(s); "
            "parallel.expert_parallel_size splits them)"
        )
    groups = [f"{g}-{g + env.ep_size - 1}" for g in range(0, env.world_size, env.ep_size)]
    return (
        f"{num_experts} a layer, EP {env.ep_size}: {num_experts // env.ep_size} on each rank (EP groups: ranks "
        f"{', '.join(groups)}), tokens sent to them by all-to-all; each rank's experts FSDP2-sharded over "
        f"{env.world_size // env.ep_size} rank(s)"
    )


def describe_loss(loss) -> str:
    """The start-up summary's loss line: ``cross_entropy`` or the policy loss's settings."""
    if loss.type != "policy":
        return loss.type
    parts = [
        f"policy, clip [{1 - loss.ratio_clip_low:g}, {1 + loss.ratio_clip_high:g}]",
        f"dual clip {loss.dual_clip:g}" if loss.dual_clip else "",
        f"{loss.kl_estimator} KL x {loss.kl_coef:g} to " + (loss.reference_checkpoint or "rows' ref_logprobs")
        if loss.kl_coef
        else "",
        f"entropy x {loss.entropy_coef:g}" if loss.entropy_coef else "",
        f"{loss.normalization} normalisation",
        f"old log-probs: {loss.old_logprobs}"
        + (f", {loss.minibatches_per_rollout} steps per rollout" if loss.minibatches_per_rollout > 1 else ""),
    ]
    return ", ".join(p for p in parts if p)


class Trainer:
    """The CLI's trainer (``from_memory=False``): windows from ``data.path``; or, with
    ``from_memory=True``, the same model, optimizer, schedule, budget, reference, metrics, lock
    and resume with no data set: windows are handed over one at a time (``train_window``), as
    the RL worker (``backend.rl.PolicyWorker``) does."""

    def __init__(self, cfg: Config, env, *, from_memory: bool = False):
        self.cfg, self.env = cfg, env
        self.from_memory = from_memory
        self.run_dir = Path(cfg.logger.run_dir)
        self.ckpt_dir = checkpoint_dir(cfg)
        self.locks = hold_run_dirs(cfg, env)  # one run per run directory, held for our life
        world = describe_world(env)
        check_world_matches_allocation(world)
        self.world = world
        if env.is_main:
            log.info(
                "world: %d ranks on %d node(s): %s",
                env.world_size,
                len({w["hostname"] + str(w["slurm_node_id"]) for w in world}),
                ", ".join(f"rank {w['rank']}@{w['hostname']}/node {w['slurm_node_id']}" for w in world),
            )

        if from_memory:
            self.dataset = self.valid = None
            self.tokenizer = build_tokenizer(cfg.data.tokenizer, eod=cfg.data.append_eod)
            self.oversampling = 1.0
        else:
            build = functools.partial(build_dataset, fields=row_fields(cfg.loss))
            self.dataset, self.valid, self.tokenizer = build_train_and_valid(cfg.data, cfg.train.seed, build=build)
            self.oversampling = oversampling_factor(len(self.dataset), cfg.train.global_batch_size)
        if self.oversampling > 1 and env.is_main:
            log.warning(
                "train.global_batch_size=%d is larger than the data set (%d samples): each window trains every "
                "sample about %.1f times",
                cfg.train.global_batch_size,
                len(self.dataset),
                self.oversampling,
            )
        built = build_model(cfg, env, tokenizer_vocab=self.tokenizer.vocab_size)
        self.model, self.backend = built.model, built.attention_backend
        self.model_fields = built.fields  # the architecture as HF export writes it
        # From here on the config says what the run uses (vocab_size, ffn size, precision, ...).
        resolved = resolve_run_config(cfg, tokenizer_vocab=self.tokenizer.vocab_size, device_type=env.device.type)
        self.cfg = cfg = dataclasses.replace(
            resolved, model=dataclasses.replace(resolved.model, attention_backend=self.backend)
        )
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, cfg.scheduler, cfg.train.train_iters)
        self.meter = MemoryMeter(env.device, resident_tensors(self.model, self.optimizer))
        self.memory = None  # the probe's result with train.max_tokens_per_gpu=auto
        if cfg.train.max_tokens_per_gpu == "auto":
            self.cfg = cfg = self.resolve_budget(cfg)

        lengths = None if from_memory else self.dataset.lengths  # shape buckets come from the data set's lengths
        self.bucket_edges = edges = (
            bucket_edges_for(cfg.train, lengths, cp_size=env.cp_size) if lengths is not None else None
        )
        if edges and env.is_main:
            log.info("shape buckets (train.dynamic_batch_max_shapes=%d): %s", cfg.train.dynamic_batch_max_shapes, edges)
        self.planner = planner = planner_from_config(cfg.train, env.dims, bucket_edges=edges)
        loss = cfg.loss
        self.policy = loss.type == "policy"
        self.reference = reference = (
            build_reference(cfg, env, tokenizer_vocab=self.tokenizer.vocab_size) if loss.reference_checkpoint else None
        )
        self.data = self.windows = self.window_source = None
        if not from_memory:
            sampler = WindowSampler(len(self.dataset), cfg.train.global_batch_size, cfg.train.seed)
            self.windows = windows = DataIterator(
                self.dataset, sampler, planner, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=env.cp_size
            )
            self.window_source = PrefetchingIterator(windows) if cfg.data.prefetch else SyncIterator(windows)
            self.data = RolloutStream(
                self.window_source,
                env,
                policy=self.model if self.policy and loss.old_logprobs == "recompute" else None,
                reference=reference,
                windows_per_rollout=loss.minibatches_per_rollout,
                temperature=loss.temperature,
            )
        if self.valid is not None:
            self.valid_ids = evaluation_ids(self.valid, cfg.train.eval_samples)
            self.valid_planner = planner_from_config(cfg.train, env.dims, forward=True)

        self.step = 0
        self.wandb_run_id = None
        self.resumed_meta: dict | None = None  # the checkpoint's meta.json when this run resumed
        if cfg.checkpoint.resume and (
            meta := resume_latest(self.ckpt_dir, cfg, self.model, self.optimizer, self.scheduler, env=env)
        ):
            self.step = meta["step"]
            self.resumed_meta = meta
            self.meter.track(resident_tensors(self.model, self.optimizer))  # the loaded optimizer state
            if self.data is not None and meta.get("data") is not None:
                self.data.load_state_dict(meta["data"])
            elif self.data is not None and env.is_main:
                log.warning(
                    "%s holds no data-stream position (written by a worker fed from memory): the data.path "
                    "stream starts at its beginning",
                    self.ckpt_dir,
                )
            self.wandb_run_id = meta.get("wandb_run_id")
            rollout = loss.minibatches_per_rollout
            if self.policy and loss.old_logprobs == "recompute" and self.step % rollout and env.is_main:
                log.warning(
                    "resumed after step %d, inside a rollout batch of loss.minibatches_per_rollout=%d windows: the "
                    "old log-probabilities of the windows from step %d on are recomputed from the resumed weights "
                    "(a new rollout batch starts there)",
                    self.step,
                    rollout,
                    self.step + 1,
                )
        if env.is_main and self.step < cfg.train.train_iters:
            self.write_run_record()
        if env.is_main and (dropped := rewind_metrics(self.run_dir / "metrics.jsonl", self.step)):
            log.info("metrics.jsonl: dropped %d row(s) past step %d (written before a restart)", dropped, self.step)
        self.metrics = MetricsLogger(
            self.run_dir, cfg.train.train_iters, enabled=env.is_main, log_interval=cfg.logger.log_interval
        )
        self.num_parameters = built.num_parameters
        self.last_checkpoint: Path | None = None
        if env.is_main:
            log.info("%s", format_startup_summary(self.startup_info()))

    def resolve_budget(self, cfg):
        """``train.max_tokens_per_gpu: auto`` measured (``memory_probe``): the config with the number."""
        try:
            self.memory = probe_memory(
                self.model, self.optimizer, cfg, self.env, backend=self.backend, meter=self.meter
            )
        except BudgetError as e:
            raise ConfigError(f"train.max_tokens_per_gpu=auto: {e}") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.env.is_main:
            log.info("%s", self.memory.summary())
        budget = self.memory.budget
        train = dataclasses.replace(cfg.train, max_tokens_per_gpu=budget)
        if cfg.train.forward_max_tokens_per_gpu in (0, "auto"):  # forward-only passes: the same fit and budget
            train = dataclasses.replace(train, forward_max_tokens_per_gpu=budget)
        return dataclasses.replace(cfg, train=train)

    def check_memory(self, data: StepData, peak: int) -> dict:
        """The step's measured peak against the fit's prediction for its largest microbatch; over by
        more than 5% on any rank: a warning with both numbers, and with ``auto`` a lower budget for
        the windows planned from now on (never a higher one). Returns what the step row records
        beside the measured peak (nothing without ``auto``): this rank's prediction and the worst
        rank's measured / predicted ratio."""
        if self.memory is None:
            return {}
        cp = self.env.cp_size
        predicted = max(
            (self.memory.fit.predict(mb.cost, mb.area / cp) for mb in data.plan.microbatches(self.env.dp_rank)),
            default=self.memory.fit.a,
        )
        ratio = float(dist_max(peak / predicted, self.env.device, group=self.env.group("world")))
        row = {"predicted_peak_bytes": predicted, "peak_over_prediction_max_rank": ratio}
        if ratio <= 1.05:
            return row
        budget = self.cfg.train.max_tokens_per_gpu
        lower = max(BUDGET_QUANTUM, int(budget / ratio) // BUDGET_QUANTUM * BUDGET_QUANTUM)
        if self.env.is_main:
            log.warning(
                "step %d: measured peak memory %.1f MiB is %.0f%% over the probe's prediction %.1f MiB (on the worst "
                "rank); train.max_tokens_per_gpu %d -> %d for the windows planned from now on",
                self.step,
                peak / 2**20,
                (ratio - 1) * 100,
                predicted / 2**20,
                budget,
                lower,
            )
        if lower < budget:
            if self.window_source is not None:
                self.window_source.quiesce()  # the window in preparation keeps the old plan on every rank
            self.cfg = dataclasses.replace(
                self.cfg, train=dataclasses.replace(self.cfg.train, max_tokens_per_gpu=lower)
            )
            self.planner = planner_from_config(self.cfg.train, self.env.dims, bucket_edges=self.bucket_edges)
            if self.windows is not None:
                self.windows.planner = self.planner
        return row

    def write_run_record(self) -> None:
        """config.yaml (the config this run trains with) and world.json, written only by a start that
        will train: a start with nothing left to train changes no file of the run directory. A
        resume with another config keeps the earlier one beside it as
        ``config.before_step_NNNNNNNN.yaml`` (the config that trained up to that step)."""
        path = self.run_dir / "config.yaml"
        if path.is_file() and self.step:
            earlier = path.read_text(encoding="utf-8")
            save_config(self.cfg, path)
            if path.read_text(encoding="utf-8") != earlier:
                (self.run_dir / f"config.before_step_{self.step:08d}.yaml").write_text(earlier, encoding="utf-8")
        else:
            save_config(self.cfg, path)
        (self.run_dir / "world.json").write_text(json.dumps(self.world, indent=1))

    def startup_info(self) -> dict:
        """What the start-up summary shows: model, parallel layout, attention, data, batching, schedule."""
        cfg, env = self.cfg, self.env
        if self.dataset is None:
            source, lengths = "rows handed over in memory, one optimizer window per call", None
        else:
            report, source, lengths = self.dataset.report, self.dataset.source, length_stats(self.dataset.lengths)
            if getattr(self.dataset, "note", ""):
                source += f" ({self.dataset.note})"
            if report is not None and (report.truncated or report.dropped):
                source += f" (over data.max_seq_length: {report.truncated} truncated, {report.dropped} dropped)"
        validation = None
        if self.valid is not None:
            validation = (
                f"{len(self.valid_ids)} samples of {self.valid.source} every {cfg.train.eval_interval} step(s)"
                if cfg.train.eval_interval
                else f"{self.valid.source} (train.eval_interval=0: never evaluated)"
            )
        return {
            "validation": validation,
            "model": cfg.model.hf_checkpoint
            if getattr(cfg.model, "hf_checkpoint", "")
            else f"GPTModel {cfg.model.num_layers} layers x {cfg.model.hidden_size}",
            "parameters": self.num_parameters,
            "dp": env.dp_size,
            "cp": env.cp_size,
            "world_size": env.world_size,
            "experts": describe_experts(cfg.model.num_moe_experts, env),
            "device": env.device.type,
            "precision": cfg.train.precision,
            "attention_backend": self.backend,
            "recompute": cfg.model.recompute_granularity,
            "logits_chunk_tokens": cfg.model.logits_chunk_tokens,
            "data_source": source,
            "lengths": lengths,
            "max_seq_length": cfg.data.max_seq_length,
            "global_batch_size": cfg.train.global_batch_size,
            "batching": {
                "dynamic": cfg.train.dynamic_batch_enable,
                "max_tokens_per_gpu": cfg.train.max_tokens_per_gpu,
                "micro_batch_size": cfg.train.micro_batch_size,
            },
            "train_iters": cfg.train.train_iters,
            "start_step": self.step,
            "schedule": f"{cfg.scheduler.type}, warm-up {cfg.scheduler.warmup_iters}",
            "run_dir": str(self.run_dir),
            "loss": describe_loss(cfg.loss),
            "ignored_fields": format_ignored(getattr(self.dataset, "ignored_fields", None) or {}) or None,
        }

    def end_summary(self, status: str) -> None:
        """Steps, tokens, wall time, tokens/s, padding efficiency, valid loss, where the checkpoint is."""
        self.metrics.close()
        if self.env.is_main:
            info = {
                **self.metrics.totals(),
                "status": status,
                "wall_time_s": time.monotonic() - self.metrics.started,
                "checkpoint": str(self.last_checkpoint or self.ckpt_dir),
                "run_dir": str(self.run_dir),
            }
            log.info("%s", format_end_summary(info))

    def attach_wandb(self, run) -> None:
        """Send metrics to ``run`` too; its id is stored in checkpoints so a resume continues it."""
        if run is not None:
            self.metrics.wandb_run = run
            self.wandb_run_id = run.id

    def train(self) -> str:
        """Run to train.train_iters; returns "finished", "preempted" (SIGTERM/SIGUSR1) or "interrupted"
        (Ctrl-C), the last two after saving a checkpoint at the step where every rank stopped."""
        if self.step >= self.cfg.train.train_iters:
            if self.env.is_main:
                log.warning(
                    "this run already finished: step %d of train.train_iters=%d is checkpointed in %s; nothing to "
                    "train (raise train.train_iters to continue it)",
                    self.step,
                    self.cfg.train.train_iters,
                    self.ckpt_dir,
                )
            return "finished"
        stop = StopRequest().install()
        try:
            while self.step < self.cfg.train.train_iters:
                self.step += 1
                self.train_one_step()
                if stop.agreed(self.env):
                    self.save()
                    log.warning(
                        "stop signal (%s) received: saved step %d, exiting to be resumed",
                        stop.signal_name or "on another rank",
                        self.step,
                    )
                    return "interrupted" if stop.signal_name == "SIGINT" else "preempted"
                if self.should_evaluate():
                    self.evaluate()
                if self.should_save():
                    self.save()
            return "finished"
        finally:
            stop.uninstall()

    def train_one_step(self) -> dict:
        data, data_time = self.next_data()
        return self.train_window(data, data_time, source=self.dataset.source, report=self.dataset.report)

    def train_window(
        self, data: StepData, data_time: float, *, source: str, report=None, extra: dict | None = None
    ) -> dict:
        """One optimizer step on ``data`` (step ``self.step``, already counted): the guards, the
        update, the memory check and the step row (``extra`` merged into it); returns the row."""
        if data.global_loss_tokens == 0:
            ids = [int(i) for i in data.window_ids[:8]]
            raise DataError(
                f"{source}: step {self.step}: the window's {len(data.window_ids)} samples (indices "
                f"{ids}{' ...' if len(data.window_ids) > 8 else ''}) hold no loss tokens (every loss_mask is 0), so "
                f"there is nothing to train on; check the data's loss_mask (or its chat template's assistant turns)"
            )
        with self.meter.step():
            out = train_step(
                self.model,
                self.optimizer,
                self.scheduler,
                data,
                self.env,
                clip_grad=self.cfg.optimizer.clip_grad,
                step=self.step,
                loss_cfg=self.cfg.loss,
            )
        out["peak_memory_bytes"] = self.meter.peak_bytes
        out.update(self.check_memory(data, self.meter.peak_bytes))
        return self.log_step(data, out, data_time, report=report, extra=extra)

    def next_data(self) -> tuple[StepData, float]:
        """The next window, planned, collated and checked to agree across ranks; and its seconds."""
        start = time.perf_counter()
        data = next(self.data)
        data_time = time.perf_counter() - start
        check_plan_agreement(data.plan, self.env.group("world"), step=self.step)
        return data, data_time

    def log_step(self, data: StepData, out: dict, data_time: float, *, report=None, extra: dict | None = None) -> dict:
        """Step metrics (train_step's, the plan's, the data's and ``extra``) to the console, jsonl and wandb."""
        metrics = {"step": self.step, **out, **plan_metrics(data.plan, self.env.dp_rank)}
        metrics["data_time_s"] = data_time
        if self.data is not None:
            metrics["data_wait_s"] = self.data.last_wait_s  # waiting for the window's plan and tensors
            if self.policy:  # forward-only passes (recomputed old / reference log-probabilities) in data_time_s
                metrics["logprob_time_s"] = self.data.last_fill_s
        metrics["tokens_per_s"] = metrics["tokens"] / out["step_time_s"]
        metrics["loss_tokens"] = data.global_loss_tokens
        metrics["oversampling_factor"] = self.oversampling
        if report is not None:
            metrics.update(report.as_dict())
        metrics.update(extra or {})
        self.metrics.log(metrics)
        return metrics

    def should_evaluate(self) -> bool:
        interval = self.cfg.train.eval_interval
        return (
            bool(interval)
            and self.valid is not None
            and (self.step % interval == 0 or self.step == self.cfg.train.train_iters)
        )

    def evaluate(self) -> dict:
        """The validation loss on the fixed validation samples; logged as an eval row."""
        start = time.perf_counter()
        loss, tokens = validation_loss(self.model, self.valid, self.valid_ids, self.env, self.valid_planner)
        row = {"valid_loss": loss, "valid_tokens": tokens, "valid_time_s": time.perf_counter() - start}
        self.metrics.log_eval(self.step, row)
        return row

    def should_save(self) -> bool:
        interval = self.cfg.checkpoint.interval
        return (interval and self.step % interval == 0) or self.step == self.cfg.train.train_iters

    def save(self, state: dict | None = None) -> Path:
        """A checkpoint of this step. ``state``: the caller's own resumable state (JSON), stored as
        ``meta.json``'s ``caller_state`` (the RL loop's prompt stream); a run fed from memory has no
        data-stream position (``data`` null: the CLI resuming it starts data.path from the start)."""
        extra = {
            "data": self.data.state_dict() if self.data is not None else None,
            "wandb_run_id": self.wandb_run_id,
            "config": dataclasses.asdict(self.cfg),
        }
        if state is not None:
            extra["caller_state"] = state
        self.last_checkpoint = save_checkpoint(
            self.ckpt_dir,
            self.step,
            self.model,
            self.optimizer,
            self.scheduler,
            env=self.env,
            extra=extra,
            keep_last=self.cfg.checkpoint.keep_last,
        )
        return self.last_checkpoint
