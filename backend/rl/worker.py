"""``PolicyWorker``: the engine (``backend.train.engine``) driven from memory, for an RL loop in the
same process: one of the engine's two drivers (the other is ``python -m backend.train``'s).

SPMD, as NeMo-RL's and verl's workers are called: under torchrun every rank constructs the worker
and calls the same methods with the same arguments (checked: a hash of the rows is compared
across ranks, so a caller that hands ranks different rows gets an error, not a hang). The worker
plans (the same planner as ``python -m backend.train``), shards over dp x cp, and restores the
caller's order in what it returns.

    worker = PolicyWorker.from_config("configs/grpo_demo.yaml", ["optimizer.lr=1e-4"])
    lp = worker.logprobs(rows)                    # per-token log p, entry 0 NaN, caller's order
    row = worker.train_step(rows)                 # one optimizer step over exactly these rows
    for name, tensor in worker.hf_weights():      # HF names, full tensors, one at a time
        generator.load_weights([(name, tensor)])
    worker.save(); worker.close()

Rows are dicts with the JSONL row fields (``input_ids``, ``loss_mask``, ``loss_weight``,
``advantages``, ``old_logprobs``, ``ref_logprobs``; or ``text`` / ``messages``), lists or numpy
arrays, validated by the same parser as a data file (a bad row names ``rows[i]`` and the field).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from backend.checkpoint.hf_export import export_fields
from backend.config import ConfigError, load_config, validate
from backend.data.errors import DataFormatError
from backend.data.iterator import window_data
from backend.data.memory_rows import rows_dataset
from backend.data.row_fields import PASS_THROUGH, row_fields
from backend.data.sample import POLICY_FIELDS
from backend.distributed.collectives import all_gather_objects
from backend.distributed.plan_check import check_plan_agreement, check_same_arguments
from backend.distributed.setup import init_from_config, shutdown_distributed
from backend.errors import UserError
from backend.model.lora import as_reference
from backend.train.engine import Engine
from backend.train.forward_only import compute_logprobs, compute_values
from backend.train.rollout import fill_window

from . import weights

log = logging.getLogger(__name__)

MODELS = ("policy", "reference")


def _rows_digest(dataset) -> str:
    """A hash of every sample's tokens and per-token fields (what the ranks must agree on)."""
    h = hashlib.sha256()
    for i in range(len(dataset)):
        s = dataset[i]
        for name in ("tokens", "loss_mask", "loss_weight", *POLICY_FIELDS):
            value = getattr(s, name, None)
            h.update(name.encode())
            if value is not None:
                h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def agreed_rows(rows, tokenizer, data_cfg, *, fields, limit: bool, what: str, vocab: int | None = None):
    """The rows as a dataset, parsed on every rank and checked to be the same rows everywhere. A
    rank whose rows are refused shares its error in the same exchange, so every rank raises (one
    rank raising while the others wait in a collective would hang)."""
    error, dataset = None, None
    shared = dist.is_initialized() and dist.get_world_size() > 1  # one rank: nothing to agree with
    try:
        dataset = rows_dataset(rows, tokenizer, data_cfg, fields=fields, limit=limit, vocab=vocab)
        digest = _rows_digest(dataset) if shared else ""
    except UserError as e:
        error, digest = e, f"error: {e}"
    if shared:
        digests = all_gather_objects(digest, group=dist.group.WORLD)
        failed = [(r, d) for r, d in enumerate(digests) if d.startswith("error: ")]
        if error is None and failed:
            rank, message = failed[0]
            raise DataFormatError(f"{what}: refused on rank {rank}: {message.removeprefix('error: ')}")
        if error is None:
            check_same_arguments(
                digest, what=what, group=dist.group.WORLD
            )  # every rank parsed: compare (cheap, same call everywhere)
    if error is not None:
        raise error
    return dataset


def check_worker_config(cfg) -> None:
    """What a worker fed from memory cannot do as the CLI does, refused with the key to change."""
    loss = cfg.loss
    if loss.type == "policy" and loss.old_logprobs == "recompute" and loss.minibatches_per_rollout > 1:
        raise ConfigError(
            "loss.minibatches_per_rollout>1 with loss.old_logprobs=recompute: a worker fed from memory does not know "
            "your rollout batches; compute old log-probabilities once per batch with worker.logprobs(rows) and set "
            "loss.old_logprobs=data (or keep loss.minibatches_per_rollout=1)"
        )


class TrainerWorker:
    """What the policy and the value worker share: the engine fed from memory in one process of an
    SPMD world (see the module docstring): build, train_step, save, close."""

    def __init__(self, engine: Engine, *, owns_world: bool = False):
        self.trainer = self.engine = engine  # ``trainer``: the name earlier callers read
        self.owns_world = owns_world
        self.fields = export_fields(engine.cfg, engine.model_fields)
        self.closed = False

    @classmethod
    def check_config(cls, cfg) -> None:
        """What this kind of worker refuses in a config, with the key to change."""
        check_worker_config(cfg)

    @classmethod
    def from_config(cls, path: str | Path, overrides: Sequence[str] = (), *, env=None):
        """Build what ``python -m backend.train`` builds (model from ``model.hf_checkpoint`` or the
        seed, optimizer, schedule, FSDP2 x CP, the reference model when ``loss.reference_checkpoint``
        is set), take the run directory's lock, write ``config.yaml``, and resume from the run's
        newest checkpoint when there is one. ``env``: an existing ``init_distributed`` world (else
        one is joined, or formed for a single process, and shut down by ``close``)."""
        world_size = int(os.environ.get("WORLD_SIZE", "1")) if env is None else env.world_size
        cfg = validate(load_config(path, list(overrides)), world_size=world_size, from_memory=True)
        cls.check_config(cfg)
        owns = env is None and not dist.is_initialized()
        if env is None:
            env = init_from_config(cfg)
        try:
            engine = Engine(cfg, env)
        except BaseException:
            if owns:
                shutdown_distributed(env)
            raise
        return cls(engine, owns_world=owns)

    # What callers read.
    @property
    def cfg(self):
        return self.trainer.cfg

    @property
    def env(self):
        return self.trainer.env

    @property
    def step(self) -> int:
        """Optimizer steps taken (a resumed run starts at its checkpoint's step)."""
        return self.trainer.step

    @property
    def tokenizer(self):
        return self.trainer.tokenizer

    @property
    def sampling_vocab(self) -> int | None:
        """The ids the policy's softmax covers, which a sampler must draw from: the tokenizer's
        vocabulary when we padded the embedding past it, else None (every row: an imported
        checkpoint's rows past its tokenizer are in the trainer's softmax, so the sampler keeps
        them too, or its log-probabilities would differ from the trainer's)."""
        from backend.model.forward import output_settings

        return output_settings(self.trainer.model).vocab_limit

    @property
    def row_vocab(self) -> int:
        """Ids the rows handed in may hold: what the policy's softmax covers (a critic's rows come
        from the same sampler, so it takes the same rule from its config)."""
        return self.sampling_vocab or self.cfg.model.vocab_size

    @property
    def resumed_state(self) -> dict | None:
        """The ``state`` given to ``save`` in the checkpoint this worker resumed from (None: a fresh run)."""
        meta = self.trainer.resumed_meta
        return None if meta is None else meta.get("caller_state")

    def train_step(self, rows: Sequence[dict], extra_metrics: dict | None = None, *, started=None) -> dict:
        """One optimizer step whose window is exactly ``rows`` (any count), through the CLI's
        planner, loss, window normalisation and guards; returns the step's metrics row (as written
        to ``metrics.jsonl``, with ``extra_metrics`` merged in) and appends it there. ``started``: the
        ``time.perf_counter()`` at which the caller's step began (the row then holds ``loop_step_s``)."""
        trainer, cfg, env = self.trainer, self.cfg, self.env
        start = time.perf_counter()
        dataset = agreed_rows(
            rows,
            self.tokenizer,
            cfg.data,
            fields=row_fields(cfg.loss, lora=cfg.model.lora.rank > 0),
            limit=True,
            what="train_step rows",
            vocab=self.row_vocab,
        )
        data = window_data(
            dataset,
            np.arange(len(dataset)),
            trainer.planner,
            dp_rank=env.dp_rank,
            cp_rank=env.cp_rank,
            cp_size=env.cp_size,
        )
        trainer.step += 1
        updates = trainer.scheduler.last_epoch  # moves once the optimizer step is applied
        try:
            check_plan_agreement(data.plan, env.group("world"), step=trainer.step)
            recompute = trainer.policy and cfg.loss.old_logprobs == "recompute"
            fill_window(
                data,
                env,
                policy=trainer.model if recompute else None,
                reference=trainer.reference,
                temperature=cfg.loss.temperature,
            )
            return trainer.train_window(
                data,
                time.perf_counter() - start,
                source="rows",
                report=dataset.report,
                extra=extra_metrics,
                started=started,
            )
        except BaseException:
            if trainer.scheduler.last_epoch == updates:
                # nothing was applied: drop any partial gradient, and the next call trains this step again
                trainer.optimizer.zero_grad(set_to_none=True)
                trainer.step -= 1
            raise  # after the update (logging, the memory check): the step counts, as it was applied

    def save(self, state: dict | None = None, files: dict | None = None) -> Path:
        """A checkpoint of the current step that ``python -m backend.train`` and ``from_config``
        resume; ``state`` (JSON-serialisable: a loop's prompt stream position) comes back as
        ``resumed_state``; ``files`` (name -> bytes) are written beside it, read back by
        ``trainer.resumed_file``."""
        return self.trainer.save(state, files)

    def close(self) -> None:
        """Flush the metrics, release the run directory, and leave the world if this worker joined it."""
        if self.closed:
            return
        self.closed = True
        self.trainer.metrics.close()
        for lock in self.trainer.locks:
            lock.release()
        if self.owns_world:
            shutdown_distributed(self.env)

    def __enter__(self) -> PolicyWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PolicyWorker(TrainerWorker):
    """The policy trainer: log-probabilities, train_step, and its weights as a Hugging Face stream."""

    @classmethod
    def check_config(cls, cfg) -> None:
        check_worker_config(cfg)
        if cfg.model.head != "lm":
            raise ConfigError(
                "model.head=value: a critic is a ValueWorker (backend.rl.ValueWorker), not a PolicyWorker"
            )

    def _model(self, model: str):
        if model not in MODELS:
            raise ValueError(f"model={model!r}: allowed values are {', '.join(MODELS)}")
        if model == "reference":
            if self.trainer.reference is None:
                raise ConfigError(
                    "model='reference': set loss.reference_checkpoint to load a reference model (or, with LoRA, "
                    "loss.kl_coef > 0: the base is the reference)"
                )
            return self.trainer.reference
        return self.trainer.model

    def logprobs(
        self, rows: Sequence[dict], model: str = "policy", temperature: float | None = None
    ) -> list[np.ndarray]:
        """Per-token log-probabilities of each row's tokens under ``model`` ("policy" or
        "reference"): float32 arrays as long as the row, aligned like ``old_logprobs`` (entry t is
        token t as a target; entry 0 NaN), in the caller's order, on every rank, at
        ``loss.temperature`` (or ``temperature``). Planned under ``train.forward_max_tokens_per_gpu`` in the configured
        layout and dp x cp."""
        cfg, env = self.cfg, self.env
        dataset = agreed_rows(
            rows, self.tokenizer, cfg.data, fields=PASS_THROUGH, limit=False, what="logprobs rows", vocab=self.row_vocab
        )
        planner = self.engine.forward_planner()
        samples = [dataset[i] for i in range(len(dataset))]
        temperature = cfg.loss.temperature if temperature is None else temperature
        with as_reference(self._model(model)) if model == "reference" else contextlib.nullcontext():
            values = compute_logprobs(self._model(model), samples, env, planner, temperature=temperature)
        return [np.concatenate([np.full(1, np.nan, np.float32), v.astype(np.float32)]) for v in values]

    def weight_metadata(self, dtype=None) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(HF name, dtype, shape) of each tensor ``hf_weights(dtype)`` yields, in the same order."""
        return weights.weight_metadata(self.trainer.model, self.fields, dtype)

    def hf_weights(self, dtype=None, *, device=None, merged: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, full unsharded tensor) pairs, one parameter at a time, on ``device``
        (default: the model's device); every rank must iterate to the end in lockstep. Bitwise the
        tensors ``tools/export_hf.py`` writes at the same weights and dtype (None: FP32). With LoRA
        the adapters are merged in (``merged=False``: the frozen base alone)."""
        return weights.hf_weights(
            self.trainer.model, self.fields, dtype, device=device or self.env.device, merged=merged
        )

    def adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """LoRA: (whole-model name, full FP32 tensor) of every adapter parameter, on the CPU (for a
        PEFT adapter directory); every rank iterates in lockstep, as ``hf_weights``."""
        return weights.adapter_weights(self.trainer.model)

    def hf_config(self, dtype=None) -> dict:
        """The config.json a generator builds its model from (``export_hf`` writes the same)."""
        from backend.model.hf.export import hf_config_dict

        return hf_config_dict(self.fields, dtype=weights.export_dtype(dtype, self.trainer.model))


class ValueWorker(TrainerWorker):
    """PPO's critic (``model.head: value``, ``loss.type: value``) with the policy worker's shape:
    ``values(rows)``, ``train_step(rows)`` (rows carry ``returns`` and ``old_values``), ``save()``.
    Planned exactly as the policy: the same planner, layouts and dp x cp."""

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.model.head != "value" or cfg.loss.type != "value":
            raise ConfigError(
                f"a ValueWorker needs model.head=value and loss.type=value (got model.head={cfg.model.head}, "
                f"loss.type={cfg.loss.type})"
            )

    def values(self, rows: Sequence[dict]) -> list[np.ndarray]:
        """The critic's value of each row's tokens: float32 arrays as long as the row, aligned like
        ``old_logprobs`` (entry t values the state before token t; entry 0 NaN), in the caller's
        order, on every rank; planned under ``train.forward_max_tokens_per_gpu``."""
        cfg, env = self.cfg, self.env
        dataset = agreed_rows(
            rows, self.tokenizer, cfg.data, fields=PASS_THROUGH, limit=False, what="values rows", vocab=self.row_vocab
        )
        planner = self.engine.forward_planner()
        samples = [dataset[i] for i in range(len(dataset))]
        out = compute_values(self.trainer.model, samples, env, planner)
        return [np.concatenate([np.full(1, np.nan, np.float32), v.astype(np.float32)]) for v in out]
