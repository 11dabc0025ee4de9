"""The engine: everything a run trains with, built once from the config, fed one window at a time.

Model (the one factory), optimizer, schedule, the measured budget (``auto``), the planner, the
objective (``loss.type``, registered), the reference model, the memory meter, the run directory's
lock and record, metrics, save and resume. One optimizer step on a planned window is
``train_window``; forward-only outputs are ``backend.train.forward_only`` on ``engine.model``.

Two drivers feed it: ``Trainer`` (``python -m backend.train``: windows from ``data.path``, with
evaluation; ``trainer.py``) and the RL workers (``backend.rl.PolicyWorker`` / ``ValueWorker``:
windows from rows handed over in memory). A driver adds its data through the hooks below
(``build_data``, ``shape_buckets``, ``build_stream``, ``restore_stream``, ``stream_state``,
``replanned``, ``describe_data``, ``stream_metrics``); the engine's own are those of a driver with
no data set (rows arrive with each call). The run loop both drivers use is ``run_loop.run_steps``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

from backend.batching.memory_fit import BUDGET_QUANTUM, BudgetError
from backend.checkpoint.lora_base import share_base_identity
from backend.checkpoint.metrics_rewind import rewind_metrics
from backend.checkpoint.resume import resume_latest
from backend.checkpoint.run_lock import hold_run_dirs
from backend.checkpoint.store import read_best, save_checkpoint, write_best
from backend.config import Config, ConfigError, checkpoint_dir, save_config
from backend.config.run_values import resolve_run_config
from backend.data.errors import DataError
from backend.data.iterator import StepData, planner_from_config
from backend.data.tokenizers import build_tokenizer
from backend.distributed.collectives import dist_max
from backend.distributed.pipeline import pipeline_metrics
from backend.distributed.setup import check_world_matches_allocation, describe_world, tp_groups_across_nodes
from backend.logging.console import format_end_summary, format_startup_summary
from backend.logging.metrics import MetricsLogger, plan_metrics
from backend.loss.registry import build_loss
from backend.model import lora
from backend.model.factory import build_model

from .memory_meter import MemoryMeter, resident_tensors
from .memory_probe import probe_memory
from .optim import build_optimizer, build_scheduler
from .rollout import build_reference
from .step import NonFiniteError, train_step

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


def describe_tensor_parallel(env) -> str | None:
    """The start-up summary's TP line (None at tp 1): the groups and what sequence parallelism does."""
    tp = env.tp_size
    if tp == 1:
        return None
    groups = ", ".join(f"{g}-{g + tp - 1}" for g in range(0, min(env.world_size, 4 * tp), tp))
    more = ", ..." if env.world_size > 4 * tp else ""
    sp = (
        f"sequence parallel: rows aligned to {2 * env.cp_size * tp if env.cp_size > 1 else tp} tokens and split "
        f"{tp} ways between the TP regions"
        if env.sp_size > 1
        else "activations whole on every TP rank (parallel.sequence_parallel=false)"
    )
    return (
        f"TP {tp} (groups: ranks {groups}{more}): each rank holds 1/{tp} of every layer, the vocabulary split too; "
        f"{sp}; FSDP2 over the {env.world_size // tp} rank(s) holding the same slice"
    )


def describe_loss(loss, lora_base: bool = False) -> str:
    """The start-up summary's loss line: ``cross_entropy`` or the policy loss's settings."""
    if loss.type != "policy":
        return loss.type
    parts = [
        f"policy, clip [{1 - loss.ratio_clip_low:g}, {1 + loss.ratio_clip_high:g}]",
        f"dual clip {loss.dual_clip:g}" if loss.dual_clip else "",
        f"{loss.kl_estimator} KL x {loss.kl_coef:g} to "
        + (loss.reference_checkpoint or ("the base (LoRA adapters off)" if lora_base else "rows' ref_logprobs"))
        if loss.kl_coef
        else "",
        f"entropy x {loss.entropy_coef:g}" if loss.entropy_coef else "",
        f"{loss.normalization} normalisation",
        f"old log-probs: {loss.old_logprobs}"
        + (f", {loss.minibatches_per_rollout} steps per rollout" if loss.minibatches_per_rollout > 1 else ""),
    ]
    return ", ".join(p for p in parts if p)


class Engine:
    """Model, optimizer, schedule, budget, planner, objective, reference, metrics, save / resume
    (see the module docstring). Built as its drivers need it: ``Engine(cfg, env)`` is fed windows
    by its caller (the RL workers); ``Trainer(cfg, env)`` adds the data stream."""

    #: ``train.memory_meter=auto`` on CPU: measured in this driver's steps (the data-stream
    #: trainer's are; an RL worker's, short and many, are not: the meter was 40% of the tiny GRPO
    #: demo's training step), or whenever ``max_tokens_per_gpu=auto`` checks the peak.
    meter_cpu_by_default = False

    def __init__(self, cfg: Config, env):
        self.cfg, self.env = cfg, env
        self.run_dir = Path(cfg.logger.run_dir)
        self.ckpt_dir = checkpoint_dir(cfg)
        self.locks = hold_run_dirs(cfg, env)  # one run per run directory, held for our life
        try:
            self._start(cfg, env)
        except BaseException:  # a failed start leaves no run directory holding only its lock files
            for lock in self.locks:
                lock.release(discard_if_empty=True)
            raise

    def _start(self, cfg: Config, env) -> None:
        """Everything after the run directories are held: the world's check, data, model,
        optimizer, budget, planner, stream, resume, metrics and the start-up summary."""
        world = describe_world(env)
        check_world_matches_allocation(world)
        spread = tp_groups_across_nodes(world, env.tp_size) if env.tp_size > 1 else []
        if spread and env.is_main:
            log.warning(
                "parallel.tensor_parallel_size=%d: TP group(s) %s span more than one node (every layer's "
                "collectives cross the network); launch a multiple of %d ranks per node",
                env.tp_size,
                spread[:4],
                env.tp_size,
            )
        self.world = world
        if env.is_main:
            log.info(
                "world: %d ranks on %d node(s): %s",
                env.world_size,
                len({w["hostname"] + str(w["slurm_node_id"]) for w in world}),
                ", ".join(f"rank {w['rank']}@{w['hostname']}/node {w['slurm_node_id']}" for w in world),
            )

        self.tokenizer = self.build_data(cfg)
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
        self.meter = MemoryMeter(
            env.device, resident_tensors(self.model, self.optimizer), enabled=self.meters_memory(cfg, env.device)
        )
        self.memory = None  # the probe's result with train.max_tokens_per_gpu=auto
        if cfg.train.max_tokens_per_gpu == "auto":
            self.cfg = cfg = self.resolve_budget(cfg)

        self.bucket_edges = edges = self.shape_buckets(cfg)
        if edges and env.is_main:
            log.info("shape buckets (train.dynamic_batch_max_shapes=%d): %s", cfg.train.dynamic_batch_max_shapes, edges)
        self.planner = planner_from_config(cfg.train, env.dims, bucket_edges=edges)
        self.objective = build_loss(cfg.loss)  # loss.type's objective, handed to every step
        self.policy = cfg.loss.type == "policy"
        # The KL penalty's reference: loss.reference_checkpoint, or with LoRA the policy itself run
        # with its adapters off (rollout.fill_window runs every reference so): no second copy.
        self.reference_is_base = bool(
            cfg.model.lora.rank and cfg.loss.type == "policy" and cfg.loss.kl_coef and not cfg.loss.reference_checkpoint
        )
        self.reference = (
            build_reference(cfg, env, tokenizer_vocab=self.tokenizer.vocab_size)
            if cfg.loss.reference_checkpoint
            else (self.model if self.reference_is_base else None)
        )
        self.model.base_is_reference = self.reference_is_base  # lora.as_reference: its adapters off then
        self.lora_base = share_base_identity(cfg, env)
        self.build_stream(cfg)

        self.step = 0
        self.nonfinite_steps = 0  # steps train.nonfinite=skip applied no update to (kept in checkpoints)
        self.wandb_run_id = None
        self.resumed_meta: dict | None = None  # the checkpoint's meta.json when this run resumed
        if cfg.checkpoint.resume and (
            meta := resume_latest(
                self.ckpt_dir,
                cfg,
                self.model,
                self.optimizer,
                self.scheduler,
                env=env,
                unread=self.unread_keys(),
                base=self.lora_base,
            )
        ):
            self.step = meta["step"]
            self.resumed_meta = meta
            self.meter.track(resident_tensors(self.model, self.optimizer))  # the loaded optimizer state
            self.restore_stream(meta)
            self.wandb_run_id = meta.get("wandb_run_id")
            self.nonfinite_steps = meta.get("nonfinite_steps") or 0
            loss = cfg.loss
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
        # checkpoint.keep_best: the best step's record (best.json), kept when resumed from a later step
        self.pending_best: tuple[int, float] | None = None
        best = read_best(self.ckpt_dir) if cfg.checkpoint.keep_best and self.resumed_meta else None
        self.best = best if best and best["step"] <= self.step else None
        if env.is_main:
            log.info("%s", format_startup_summary(self.startup_info()))

    # The driver's hooks: these are the engine's own, for windows handed over by the caller.
    def build_data(self, cfg):
        """Build the driver's data; returns the tokenizer (the vocabulary the model is sized for)."""
        self.oversampling = 1.0
        return build_tokenizer(cfg.data.tokenizer, eod=cfg.data.append_eod)

    def shape_buckets(self, cfg) -> list[int] | None:
        """Shape-bucket edges for the planner (from a data set's lengths); none without one."""
        return None

    def build_stream(self, cfg) -> None:
        """The driver's window stream (none: windows arrive with each call)."""

    def restore_stream(self, meta: dict) -> None:
        """Put the driver's stream where the checkpoint ``meta`` left it."""

    def stream_state(self) -> dict | None:
        """The driver's stream position for a checkpoint (None: no stream)."""
        return None

    def replanned(self) -> None:
        """``self.planner`` was replaced (a lower budget): the driver's stream plans with it from now on."""

    def describe_data(self) -> dict:
        """The start-up summary's data lines."""
        return {
            "data_source": "rows handed over in memory, one optimizer window per call",
            "lengths": None,
            "ignored_fields": None,
        }

    def stream_metrics(self) -> dict:
        """The driver's per-step numbers (waiting for data, forward-only passes)."""
        return {}

    def samples_per_step(self) -> int:
        """The start-up summary's samples per optimizer step. Rows handed over in memory: what the
        GRPO loop hands over, rl.prompts_per_step x rl.samples_per_prompt (train.global_batch_size is
        not read: a summary saying 64 where the loop trains 16 misled a user)."""
        return self.cfg.rl.prompts_per_step * self.cfg.rl.samples_per_prompt

    def unread_keys(self) -> tuple[str, ...]:
        """Config keys this driver never reads: a resume allows (and reports) their changes."""
        return ("train.global_batch_size",)

    # The engine.
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

    def forward_planner(self):
        """The planner of forward-only passes (log-probabilities, values, validation):
        ``train.forward_max_tokens_per_gpu`` in the configured layout and dp x cp."""
        return planner_from_config(self.cfg.train, self.env.dims, forward=True)

    @classmethod
    def meters_memory(cls, cfg: Config, device) -> bool:
        """Whether each step's peak memory is measured (``train.memory_meter``)."""
        mode = cfg.train.memory_meter
        if mode != "auto":
            return mode == "always"
        return device.type == "cuda" or cfg.train.max_tokens_per_gpu == "auto" or cls.meter_cpu_by_default

    def check_memory(self, data: StepData, peak: int) -> dict:
        """The step's measured peak against the fit's prediction for its largest microbatch; over by
        more than 5% on any rank: a warning with both numbers, and with ``auto`` a lower budget for
        the windows planned from now on (never a higher one). Returns what the step row records
        beside the measured peak (nothing without ``auto``): this rank's prediction and the worst
        rank's measured / predicted ratio."""
        if self.memory is None:
            return {}
        cp = self.env.cp_size * self.env.sp_size  # the area is priced per GPU after both cuts
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
            self.cfg = dataclasses.replace(
                self.cfg, train=dataclasses.replace(self.cfg.train, max_tokens_per_gpu=lower)
            )
            self.planner = planner_from_config(self.cfg.train, self.env.dims, bucket_edges=self.bucket_edges)
            self.replanned()
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
        return {
            "validation": None,
            "model": cfg.model.hf_checkpoint
            if getattr(cfg.model, "hf_checkpoint", "")
            else f"GPTModel {cfg.model.num_layers} layers x {cfg.model.hidden_size}",
            "parameters": self.num_parameters,
            "dp": env.dp_size,
            "cp": env.cp_size,
            "world_size": env.world_size,
            "parallel": env.dims.sizes(),
            "experts": describe_experts(cfg.model.num_moe_experts, env),
            "tensor_parallel": describe_tensor_parallel(env),
            "device": env.device.type,
            "precision": cfg.train.precision,
            "attention_backend": self.backend,
            "recompute": cfg.model.recompute_granularity,
            "logits_chunk_tokens": cfg.model.logits_chunk_tokens,
            **self.describe_data(),
            "max_seq_length": cfg.data.max_seq_length,
            "global_batch_size": self.samples_per_step(),
            "batching": {
                "dynamic": cfg.train.dynamic_batch_enable,
                "max_tokens_per_gpu": cfg.train.max_tokens_per_gpu,
                "micro_batch_size": cfg.train.micro_batch_size,
            },
            "train_iters": cfg.train.train_iters,
            "start_step": self.step,
            "schedule": f"{cfg.scheduler.type}, warm-up {cfg.scheduler.warmup_iters}",
            "run_dir": str(self.run_dir),
            "loss": describe_loss(cfg.loss, lora_base=self.reference_is_base),
            "lora": lora.describe(cfg.model.lora, lora.trainable_count(self.model), self.num_parameters)
            if cfg.model.lora.rank
            else None,
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
                "best_checkpoint": self.best,
                "run_dir": str(self.run_dir),
            }
            log.info("%s", format_end_summary(info))

    def attach_wandb(self, run) -> None:
        """Send metrics to ``run`` too; its id is stored in checkpoints so a resume continues it."""
        if run is not None:
            self.metrics.wandb_run = run
            self.wandb_run_id = run.id

    def train_window(
        self,
        data: StepData,
        data_time: float,
        *,
        source: str,
        report=None,
        extra: dict | None = None,
        started: float | None = None,
    ) -> dict:
        """One optimizer step on ``data`` (step ``self.step``, already counted): the guards, the
        update, the memory check and the step row (``extra`` merged into it; with ``started``, the
        ``time.perf_counter()`` at which a driver's step began, also ``loop_step_s``); returns the row."""
        if data.global_loss_tokens == 0:
            ids = [int(i) for i in data.window_ids[:8]]
            raise DataError(
                f"{source}: step {self.step}: the window's {len(data.window_ids)} samples (indices "
                f"{ids}{' ...' if len(data.window_ids) > 8 else ''}) hold no loss tokens (every loss_mask is 0), so "
                f"there is nothing to train on; check the data's loss_mask (or its chat template's assistant turns)"
            )
        try:
            with self.meter.step():
                out = train_step(
                    self.model,
                    self.optimizer,
                    self.scheduler,
                    data,
                    self.env,
                    clip_grad=self.cfg.optimizer.clip_grad,
                    step=self.step,
                    objective=self.objective,
                    nonfinite=self.cfg.train.nonfinite,
                )
        except NonFiniteError as e:
            raise self.stop_nonfinite(str(e)) from None
        if out.pop("update_skipped", 0):
            self.nonfinite_steps += 1
            limit = self.cfg.train.nonfinite_max_skips
            if self.env.is_main:
                log.warning(
                    "step %d: loss %s, gradient norm %s: not finite, no update applied (train.nonfinite=skip; "
                    "%d skipped, at most %d)",
                    self.step,
                    out["loss"],
                    out["grad_norm"],
                    self.nonfinite_steps,
                    limit,
                )
            if self.nonfinite_steps > limit:
                raise self.stop_nonfinite(
                    f"step {self.step}: {self.nonfinite_steps} steps were not finite, more than "
                    f"train.nonfinite_max_skips={limit}"
                )
        out["nonfinite_steps"] = self.nonfinite_steps
        if self.env.pp_size > 1:
            out.update(pipeline_metrics(self.model, data, self.env))
        if self.meter.enabled:
            out["peak_memory_bytes"] = self.meter.peak_bytes
            out.update(self.check_memory(data, self.meter.peak_bytes))
        return self.log_step(data, out, data_time, report=report, extra=extra, started=started)

    def stop_nonfinite(self, what: str) -> NonFiniteError:
        """The error that ends a run at a step that is not finite (no update applied at it), after
        making sure the last good state is on disk: the step before is saved unless the interval
        already did (or nothing was trained yet). Every rank arrives here together (the loss and
        the gradient norm are sums over all ranks), so the save's collectives line up. The saved
        data-stream position is past the failed window: a resumed run goes on with the next one."""
        good, step = self.step - 1, self.step
        path = self.ckpt_dir / f"step_{good:08d}"
        if good > 0 and not path.is_dir():
            self.step = good
            try:
                path = self.save()
            finally:
                self.step = step
        where = f"the last good checkpoint is {path} (step {good})" if good > 0 else "nothing was trained yet"
        return NonFiniteError(f"{what}; {where}; lower optimizer.lr (or set train.nonfinite=skip) and resume")

    def log_step(
        self, data: StepData, out: dict, data_time: float, *, report=None, extra: dict | None = None, started=None
    ) -> dict:
        """Step metrics (train_step's, the plan's, the data's and ``extra``) to the console, jsonl and wandb."""
        metrics = {"step": self.step, **out, **plan_metrics(data.plan, self.env.dp_rank)}
        metrics["data_time_s"] = data_time
        metrics.update(self.stream_metrics())
        metrics["tokens_per_s"] = metrics["tokens"] / out["step_time_s"]
        metrics["loss_tokens"] = data.global_loss_tokens
        metrics["oversampling_factor"] = self.oversampling
        if report is not None:
            metrics.update(report.as_dict())
        metrics.update(extra or {})
        if started is not None:  # a driver's step began there (the RL loop: its previous row)
            metrics["loop_step_s"] = time.perf_counter() - started
        self.metrics.log(metrics)
        return metrics

    def should_save(self) -> bool:
        interval = self.cfg.checkpoint.interval
        new_best = self.pending_best is not None and self.pending_best[0] == self.step  # checkpoint.keep_best
        return (interval and self.step % interval == 0) or self.step == self.cfg.train.train_iters or new_best

    def note_valid_loss(self, valid_loss: float) -> None:
        """``checkpoint.keep_best``: a validation loss below the best so far makes this step the
        best, saved at once (``should_save``) and kept by every later pruning."""
        if self.cfg.checkpoint.keep_best and (self.best is None or valid_loss < self.best["valid_loss"]):
            self.pending_best = (self.step, valid_loss)

    def save(self, state: dict | None = None, files: dict | None = None) -> Path:
        """A checkpoint of this step. ``state``: the caller's own resumable state (JSON), stored as
        ``meta.json``'s ``caller_state`` (the RL loop's prompt stream); a run fed from memory has no
        data-stream position (``data`` null: the CLI resuming it starts data.path from the start).
        ``files``: name -> bytes written beside it (``resumed_file`` reads them back)."""
        extra = {
            "data": self.stream_state(),
            "wandb_run_id": self.wandb_run_id,
            "nonfinite_steps": self.nonfinite_steps,
            "config": dataclasses.asdict(self.cfg),
        }
        if self.lora_base is not None:  # the base these adapters belong to (lora_base.check_base)
            extra["lora_base"] = self.lora_base
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
            files=files,
            protect=frozenset([self.best["step"]] if self.best else []),
        )
        if self.pending_best is not None and self.pending_best[0] == self.step:
            step, loss = self.pending_best
            self.best = {"step": step, "valid_loss": loss, "path": str(self.last_checkpoint)}
            if self.env.is_main:
                write_best(self.ckpt_dir, step, loss)
            self.pending_best = None
        return self.last_checkpoint

    def resumed_file(self, name: str, limit: int) -> bytes | None:
        """A file ``save(files=...)`` wrote into the checkpoint this run resumed from (digested on
        load like the rest), read as untrusted input up to ``limit`` bytes; None if absent."""
        from backend.checkpoint.files import read_regular

        if self.resumed_meta is None:
            return None
        path = Path(self.ckpt_dir) / f"step_{self.resumed_meta['step']:08d}" / name
        return read_regular(path, limit) if path.exists() else None
