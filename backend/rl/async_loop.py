"""The GRPO loop with generation overlapped with training: ``rl.max_staleness`` k >= 1.

The generator runs in its own process (``RemoteGenerator``, started by the trainer's rank 0).
Weight version v is the policy after v optimizer steps. Per loop step s (the policy is version
s - 1 before it):

1. requests for steps s .. s + k that were not sent yet go to the generator, which samples each
   with the newest weights it holds when it reaches it;
2. the trainer waits for step s's rollouts (``trainer_idle_s`` counts the wait), scores them and
   trains step s, while the generator samples the steps requested after them;
3. the trainer takes every result still in flight (the generator is then idle), and streams
   version s into the generator.

So step t's rollouts were requested right after version t - k - 1 was synced and sampled with it:
a trained row lags the policy by exactly k versions (fewer in the first k steps), never more.
Stale rows are never produced, so none is dropped. One step's wall time is then about
max(train, generate) + sync instead of their sum. Each row carries ``weight_version``; each step
row has ``staleness_max`` / ``staleness_mean``, ``trainer_idle_s`` and ``generator_idle_s``.

The rows' ``rollout_logprobs`` are the behaviour policy's (the sampler's, version t - k - 1).
Either make them the ratio's denominator (``loss.old_logprobs: rollout``: PPO against the
behaviour policy), or keep a current-policy denominator (``data`` / ``recompute``) and weight the
lag with ``loss.rollout_correction`` (``tis``, ``icepop``, ...: decoupled PPO). ``detach``, or
``data`` / ``recompute`` without a correction, ignores the lag: the loop warns at start.

Resume is exact: every result in flight at a checkpoint is complete (step 3 comes before the
save) and is saved beside it (``async_rollouts.json``, digested with the checkpoint), so a resumed
run trains the rollouts an uninterrupted one would have. Generation is deterministic (per-prompt
seeds of (seed, step, slot)) given the weights. A checkpoint holding rollouts resumes only with
the same ``rl.max_staleness`` (their lag was decided by it).

Ranks: rank 0 owns the generator process and shares each result; the others wait in small agreed
polls (one tiny all-reduce a second), never in one collective that could outlast its timeout.
Generation is not split over ranks here (the colocated loop splits it): with several ranks the
synchronous loop generates faster, the asynchronous one overlaps.
"""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np
import torch

from backend.config import ConfigError
from backend.distributed.collectives import all_gather_objects, dist_any
from backend.errors import CheckpointError
from backend.generators.process import GENERATOR_THREADS, stream_dtype
from backend.generators.results import Completion

from .loop import GRPOLoop, sampling_seed

log = logging.getLogger(__name__)

#: The rollouts received and not yet trained at a checkpoint, saved beside it (JSON, read back capped).
ROLLOUTS_FILE = "async_rollouts.json"
MAX_ROLLOUTS_BYTES = 16 << 30


class AsyncGRPOLoop(GRPOLoop):
    """``GRPOLoop`` with the generator in its own process, ``k = rl.max_staleness`` steps ahead.
    ``generator`` is a ``RemoteGenerator`` on rank 0 and None on every other rank."""

    def __init__(self, worker, generator, critic=None):
        super().__init__(worker, generator, critic)
        self.k = self.cfg.rl.max_staleness
        self.requested: dict[int, list[int]] = {}  # step -> its prompt ids (sent, result not in yet)
        self.ready: dict[int, dict] = {}  # step -> {"ids", "version", "completions", "generate_s", "idle_s"}
        self.idle_s = 0.0  # the trainer's waits since the last step row
        self.submit_error: str | None = None
        # On CPU the generator process needs a core of its own to overlap anything: rank 0 gives it
        # one of its threads while a step runs (2 cores: 0.73x the synchronous step with 1 + 1
        # threads, 1.05x with 2 + 1; tools/bench/bench_async_rl.py).
        threads = torch.get_num_threads()
        crowded = worker.env.device.type == "cpu" and (os.cpu_count() or 1) < threads + GENERATOR_THREADS
        self.threads = max(1, threads - GENERATOR_THREADS) if generator is not None and crowded else threads
        if self.threads != threads and worker.env.is_main:
            log.info(
                "the trainer takes %d thread(s) while the generator process runs (it has %d)",
                self.threads,
                GENERATOR_THREADS,
            )
        self._restore(worker)
        loss = self.cfg.loss
        if loss.type == "policy" and worker.env.is_main:
            if loss.old_logprobs == "detach" or (loss.old_logprobs != "rollout" and loss.rollout_correction == "none"):
                log.warning(
                    "rl.max_staleness=%d with loss.old_logprobs=%s and loss.rollout_correction=%s: the rows were "
                    "sampled by weights %d version(s) old and nothing corrects for it; set loss.old_logprobs=rollout "
                    "(the sampler as the ratio's denominator) or loss.rollout_correction=tis / icepop with data or "
                    "recompute",
                    self.k,
                    loss.old_logprobs,
                    loss.rollout_correction,
                    self.k,
                )

    def _restore(self, worker) -> None:
        state = (worker.resumed_state or {}).get("async")
        if not state or not state.get("steps"):  # nothing held: any k continues from here
            return
        if state.get("max_staleness") != self.k:
            raise ConfigError(
                f"rl.max_staleness={self.k}: the checkpoint of step {worker.step} holds rollouts of the next "
                f"{len(state.get('steps', []))} step(s), sampled for rl.max_staleness={state.get('max_staleness')}; "
                f"resume with that value (a change would train them at another lag, or drop their prompts)"
            )
        data = worker.trainer.resumed_file(ROLLOUTS_FILE, MAX_ROLLOUTS_BYTES)
        if data is None:
            raise CheckpointError(
                f"the checkpoint of step {worker.step} ({worker.trainer.ckpt_dir}) names {ROLLOUTS_FILE} but holds no "
                "such file"
            )
        items = json.loads(data)
        self.ready = {int(t): item for t, item in items.items()}
        if worker.env.is_main:
            log.info(
                "resumed %d step(s) of rollouts generated before the checkpoint: %s",
                len(self.ready),
                sorted(self.ready),
            )

    # ---- rank 0 talks to the generator; every rank learns the outcome ----
    def _agreed_wait(self) -> None:
        """Return once rank 0 has a reply to read: every rank polls, one tiny all-reduce a second."""
        env = self.worker.env
        if env.world_size == 1:
            return
        while not dist_any(self._has_reply(), env.device, group=env.group("world")):
            pass

    def _has_reply(self) -> bool:
        """Rank 0: a reply (or a failed request) is there to act on; the other ranks: False."""
        return self.generator is not None and (self.submit_error is not None or self.generator.has_reply(1.0))

    def _submit_through(self, last: int) -> None:
        """Draw the prompts of every step up to ``last`` not drawn yet (every rank: the same ids)
        and, on rank 0, send them to the generator (a failure is raised at the next collect)."""
        rl = self.cfg.rl
        for t in range(max([self.worker.step, *self.requested, *self.ready]) + 1, last + 1):
            ids = [int(i) for i in self.sampler.next_window()]
            self.requested[t] = ids
            if self.generator is not None and self.submit_error is None:
                prompts = [self.prompts[i].token_ids for i in ids]
                seeds = [sampling_seed(self.cfg.train.seed, t, slot) for slot in range(len(ids))]
                try:
                    self.generator.submit(t, prompts, rl.samples_per_prompt, rl.temperature, rl.max_new_tokens, seeds)
                except Exception as e:
                    self.submit_error = f"{type(e).__name__}: {e}"

    def _collect(self, through: int) -> None:
        """Receive the results of every requested step up to ``through``, on every rank; the wait
        counts as the trainer's idle time."""
        start = time.perf_counter()
        env = self.worker.env
        for _ in [t for t in sorted(self.requested) if t <= through]:
            self._agreed_wait()
            got, error = None, self.submit_error
            if self.generator is not None and error is None:
                try:
                    got = self.generator.receive()
                except Exception as e:  # raised on every rank below
                    error = f"{type(e).__name__}: {e}"
            if env.world_size > 1:
                got, error = all_gather_objects((got, error), group=env.group("world"))[0]
            if error:
                raise RuntimeError(f"generator process: {error} (nothing of this step was trained)")
            self.ready[got.step] = {
                "ids": self.requested.pop(got.step),
                "version": got.version,
                "completions": got.completions,
                "generate_s": got.generate_s,
                "idle_s": got.generator_idle_s,
            }
        self.idle_s += time.perf_counter() - start

    # ---- one step ----
    def step(self) -> dict:
        previous = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self._step()
        finally:
            torch.set_num_threads(previous)

    def _step(self) -> dict:
        worker = self.worker
        self.mark_start()
        if self.last_sync is None:  # the generator takes the built or resumed weights first
            self.sync_weights()
        step = worker.step + 1
        self._submit_through(min(step + self.k, self.cfg.train.train_iters))
        if step not in self.ready:
            self._collect(step)
        item = self.ready[step]
        ids, env = item["ids"], worker.env
        slots = list(range(env.rank, len(ids), env.world_size))
        batches = [
            [Completion(list(t), list(lp), bool(stop)) for t, lp, stop in item["completions"][slot]] for slot in slots
        ]
        rows, metrics = self.scored_rows(step, np.asarray(ids), slots, batches, None, item["generate_s"])
        lag = worker.step - item["version"]
        if lag > self.k:
            raise RuntimeError(
                f"step {step}: rollouts of weight version {item['version']} lag the policy by {lag} > "
                f"rl.max_staleness={self.k} (a bug: the loop never requests them so early)"
            )
        for row in rows:
            row["weight_version"] = item["version"]
        metrics.update(
            staleness_max=lag, staleness_mean=float(lag), trainer_idle_s=self.idle_s, generator_idle_s=item["idle_s"]
        )
        row = self.train_rows(rows, metrics)
        self.ready.pop(step)  # trained (a step that failed before its update is retried on these rows)
        self.idle_s = 0.0
        self._collect(10**12)  # everything in flight: the generator is then idle for the sync
        self.sync_weights()
        return row

    def sync_weights(self):
        """Stream version ``worker.step`` into the generator process (every rank iterates the
        stream's gathers; rank 0 sends), then check it on the probe sequence on every rank."""
        worker = self.worker
        stream = worker.hf_weights(stream_dtype(worker.env.device))
        error, stats = None, None
        if self.generator is not None:
            try:
                stats = self.generator.load_weights(stream, worker.step)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                for _ in stream:  # the other ranks' gathers go on to the end
                    pass
        else:
            for _ in stream:
                pass
        env = worker.env
        if env.world_size > 1:
            stats, error = all_gather_objects((stats, error), group=env.group("world"))[0]
        if error:
            raise RuntimeError(f"weight sync into the generator process: {error}")
        self.last_sync = stats
        self.last_probe_diff = self.check_sync()
        return stats

    def generator_probe(self, probe: list[int]) -> list[float]:
        """Rank 0 asks the generator process; every rank gets the answer (or its error)."""
        mine, error = None, None
        if self.generator is not None:
            try:
                mine = self.generator.probe_logprobs(probe)
            except Exception as e:  # raised on every rank below
                error = f"{type(e).__name__}: {e}"
        env = self.worker.env
        if env.world_size > 1:
            mine, error = all_gather_objects((mine, error), group=env.group("world"))[0]
        if error:
            raise RuntimeError(f"generator process, probe after the weight sync: {error}")
        return mine

    def state(self) -> dict:
        """The prompt stream's position, and the steps whose rollouts were received and not yet
        trained (saved beside the checkpoint by ``save``)."""
        assert not self.requested, "a checkpoint with rollouts in flight would skip their prompts"
        return {**super().state(), "async": {"max_staleness": self.k, "steps": sorted(self.ready)}}

    def save(self):
        if self.critic is not None:
            self.critic.save()
        files = {ROLLOUTS_FILE: json.dumps({str(t): item for t, item in self.ready.items()}).encode()}
        return self.worker.save(self.state(), files=files)
