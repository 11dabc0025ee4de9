"""``python -m backend.train``'s driver of the engine: windows from ``data.path``, planned, collated
(prefetched) and filled (recomputed old / reference log-probabilities), validation every
``train.eval_interval`` steps, the data stream's position in every checkpoint. Reads top to
bottom: the engine builds in its order and calls the hooks below where the data comes in.
"""

from __future__ import annotations

import functools
import logging
import time

from backend.data.blend import BlendSampler, build_blend
from backend.data.build import build_dataset
from backend.data.iterator import DataIterator, StepData, bucket_edges_for, planner_from_config
from backend.data.prefetch import PrefetchingIterator, SyncIterator
from backend.data.row_fields import format_ignored, row_fields
from backend.data.sampler import WindowSampler, oversampling_factor
from backend.data.split import build_train_and_valid, evaluation_ids
from backend.distributed.plan_check import check_plan_agreement
from backend.logging.console import length_stats

from .engine import Engine, describe_experts, describe_loss  # noqa: F401  (re-exported: the summary's lines)
from .forward_only import validation_loss
from .rollout import RolloutStream
from .run_loop import run_steps

log = logging.getLogger(__name__)


class Trainer(Engine):
    """The engine fed from ``data.path`` (see the module docstring); ``train()`` runs the loop."""

    meter_cpu_by_default = True  # the data stream's steps are measured on CPU too (train.memory_meter=auto)

    def build_data(self, cfg):
        build = functools.partial(build_dataset, fields=row_fields(cfg.loss, lora=cfg.model.lora.rank > 0))
        if cfg.data.blend:
            build = functools.partial(build_blend, build=build)
        self.dataset, self.valid, tokenizer = build_train_and_valid(cfg.data, cfg.train.seed, build=build)
        self.oversampling = oversampling_factor(len(self.dataset), cfg.train.global_batch_size)
        if self.oversampling > 1 and self.env.is_main:
            log.warning(
                "train.global_batch_size=%d is larger than the data set (%d samples): each window trains every "
                "sample about %.1f times",
                cfg.train.global_batch_size,
                len(self.dataset),
                self.oversampling,
            )
        return tokenizer

    def shape_buckets(self, cfg) -> list[int] | None:
        return bucket_edges_for(cfg.train, self.dataset.lengths, cp_size=self.env.cp_size, sp_size=self.env.sp_size)

    def build_stream(self, cfg) -> None:
        env, loss = self.env, cfg.loss
        if cfg.data.blend:
            sampler = BlendSampler(
                self.dataset.sizes, self.dataset.weights, cfg.train.global_batch_size, cfg.train.seed
            )
        else:
            sampler = WindowSampler(len(self.dataset), cfg.train.global_batch_size, cfg.train.seed)
        self.windows = windows = DataIterator(
            self.dataset, sampler, self.planner, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=env.cp_size
        )
        self.window_source = PrefetchingIterator(windows) if cfg.data.prefetch else SyncIterator(windows)
        self.data = RolloutStream(
            self.window_source,
            env,
            policy=self.model if self.policy and loss.old_logprobs == "recompute" else None,
            reference=self.reference,
            windows_per_rollout=loss.minibatches_per_rollout,
            temperature=loss.temperature,
        )
        if self.valid is not None:
            self.valid_ids = evaluation_ids(self.valid, cfg.train.eval_samples)
            self.valid_planner = planner_from_config(cfg.train, env.dims, forward=True)

    def restore_stream(self, meta: dict) -> None:
        if meta.get("data") is not None:
            self.data.load_state_dict(meta["data"])
        elif self.env.is_main:
            log.warning(
                "%s holds no data-stream position (written by a worker fed from memory): the data.path "
                "stream starts at its beginning",
                self.ckpt_dir,
            )

    def stream_state(self) -> dict:
        return self.data.state_dict()

    def replanned(self) -> None:
        self.window_source.quiesce()  # the window in preparation keeps the old plan on every rank
        self.windows.planner = self.planner

    def samples_per_step(self) -> int:
        return self.cfg.train.global_batch_size

    def unread_keys(self) -> tuple[str, ...]:
        return ()

    def describe_data(self) -> dict:
        report, source = self.dataset.report, self.dataset.source
        if getattr(self.dataset, "note", ""):
            source += f" ({self.dataset.note})"
        if report is not None and (report.truncated or report.dropped):
            source += f" (over data.max_seq_length: {report.truncated} truncated, {report.dropped} dropped)"
        validation = None
        if self.valid is not None:
            validation = (
                f"{len(self.valid_ids)} samples of {self.valid.source} every {self.cfg.train.eval_interval} step(s)"
                if self.cfg.train.eval_interval
                else f"{self.valid.source} (train.eval_interval=0: never evaluated)"
            )
        return {
            "validation": validation,
            "data_source": source,
            "lengths": length_stats(self.dataset.lengths),
            "ignored_fields": format_ignored(getattr(self.dataset, "ignored_fields", None) or {}) or None,
        }

    def stream_metrics(self) -> dict:
        out = {"data_wait_s": self.data.last_wait_s}  # waiting for the window's plan and tensors
        if self.policy:  # forward-only passes (recomputed old / reference log-probabilities) in data_time_s
            out["logprob_time_s"] = self.data.last_fill_s
        return out

    def train(self) -> str:
        """Run to train.train_iters (``run_loop.run_steps``): "finished", "preempted" (SIGTERM /
        SIGUSR1) or "interrupted" (Ctrl-C), the last two after saving the step every rank reached."""

        def one_step() -> None:
            self.step += 1
            self.train_one_step()

        def after_step() -> None:
            if self.should_evaluate():
                self.note_valid_loss(self.evaluate()["valid_loss"])

        return run_steps(self, one_step, self.save, after_step)

    def train_one_step(self) -> dict:
        data, data_time = self.next_data()
        extra = {"blend_samples": self.dataset.source_counts(data.window_ids)} if self.cfg.data.blend else None
        return self.train_window(data, data_time, source=self.dataset.source, report=self.dataset.report, extra=extra)

    def next_data(self) -> tuple[StepData, float]:
        """The next window, planned, collated and checked to agree across ranks; and its seconds."""
        start = time.perf_counter()
        data = next(self.data)
        data_time = time.perf_counter() - start
        check_plan_agreement(data.plan, self.env.group("world"), step=self.step)
        return data, data_time

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
