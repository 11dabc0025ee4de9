"""The RL command: ``python -m backend.rl CONFIG.yaml [dotted.key=value ...]`` (GRPO), also under
torchrun. One process per rank holds the policy worker (FSDP2 x CP) and a generator; see
``backend.rl.loop`` for a step. Exit status as ``python -m backend.train``: 0 finished (or
preempted after saving), 130 Ctrl-C after saving, 2 a user error in one ``error:`` line (a bad
config key, prompt row, reward function or checkpoint), 1 a bug (its traceback).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from backend.config import ConfigError, load_config, validate
from backend.errors import run_main

EXIT_INTERRUPTED = 130


def build_generator(worker):
    """The generator ``rl.generator`` names, holding the worker's current weights; with
    ``rl.max_staleness`` >= 1 a generator process started by rank 0 (None on the other ranks)."""
    from .loop import stop_token_ids

    stops = stop_token_ids(worker.cfg, worker.tokenizer)
    if worker.cfg.rl.generator == "vllm_server":  # servers of their own (backend.generators.vllm_server)
        from backend.generators.vllm_server import VLLMServerGenerator

        run_dir = worker.cfg.logger.run_dir
        if worker.cfg.rl.max_staleness > 0:  # the asynchronous loop: rank 0 alone talks to them
            if not worker.env.is_main:
                return None
            return VLLMServerGenerator.from_worker(worker, stop_token_ids=stops, sender=True, run_dir=run_dir)
        return VLLMServerGenerator.from_worker(worker, stop_token_ids=stops, run_dir=run_dir)
    if worker.cfg.rl.max_staleness > 0:
        from backend.generators.process import RemoteGenerator

        return RemoteGenerator.from_worker(worker, stop_token_ids=stops) if worker.env.is_main else None
    if worker.cfg.rl.generator == "vllm":
        from backend.generators.vllm_local import VLLMGenerator

        return VLLMGenerator.from_worker(worker, stop_token_ids=stops)
    from backend.generators.hf import HFGenerator

    return HFGenerator(
        worker.hf_config(), vocab_limit=worker.sampling_vocab, stop_token_ids=stops, device=worker.env.device
    )


# What the critic's config takes from the policy's, changed: a value head and loss, its own run
# directory, and the policy-only loss keys at their defaults (validation refuses them otherwise).
CRITIC_KEYS = (
    "model.head=value",
    "loss.type=value",
    "model.logits_chunk_tokens=0",
    "loss.kl_coef=0",
    "loss.entropy_coef=0",
    "loss.reference_checkpoint=''",
    "loss.temperature=1.0",
    "loss.rollout_correction=none",
    "loss.kl_clamp=0",
    "loss.minibatches_per_rollout=1",
    "checkpoint.dir=''",
    "logger.log_interval=1000000000",  # its numbers join the policy's step line and row (vf_loss, ...)
)


def build_critic(config, overrides, worker, env):
    """PPO's critic beside the policy, on the same ranks: the same config file with ``CRITIC_KEYS``,
    run directory ``<logger.run_dir>/critic``, then ``rl.critic_overrides``."""
    from .worker import ValueWorker

    run_dir = f"{worker.cfg.logger.run_dir}/critic"
    keys = [*overrides, *CRITIC_KEYS, f"logger.run_dir={run_dir}", *worker.cfg.rl.critic_overrides]
    return ValueWorker.from_config(config, keys, env=env)


def check_loop_config(cfg) -> None:
    """``rl.*`` errors found without building anything: the reward loads, the prompt file exists,
    the sampler's temperature is the trainer's."""
    from pathlib import Path

    from backend.data.errors import DataNotFoundError

    from .reward import load_reward

    if cfg.loss.type == "policy" and cfg.rl.temperature != cfg.loss.temperature:
        raise ConfigError(
            f"rl.temperature={cfg.rl.temperature} but loss.temperature={cfg.loss.temperature}: the trainer would "
            f"compute log-probabilities of another distribution than the one the sampler drew from; set both the same"
        )
    if not cfg.rl.prompts or not Path(cfg.rl.prompts).is_file():
        raise DataNotFoundError(f"rl.prompts: no such file {cfg.rl.prompts!r}; point it at a JSONL file of prompt rows")
    load_reward(cfg.rl.reward)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.rl", description=__doc__)
    parser.add_argument("config", help="YAML config file (see configs/grpo_demo.yaml)")
    parser.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides, applied in order")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg = validate(load_config(args.config, args.overrides), world_size=world_size, from_memory=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from backend.train.cli import print_resolved

        return run_main(lambda: check_loop_config(cfg) or print_resolved(cfg))  # the prompts file, the reward
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    logging.getLogger("megatron").setLevel(logging.WARNING)

    def run() -> int:
        from backend.distributed.setup import init_from_config, shutdown_distributed
        from backend.logging.wandb_run import start_wandb

        from .async_loop import AsyncGRPOLoop
        from .loop import GRPOLoop
        from .worker import PolicyWorker

        check_loop_config(cfg)  # the loop's own keys, before minutes of model building
        env = init_from_config(cfg)
        worker = critic = generator = None
        try:
            worker = PolicyWorker.from_config(args.config, args.overrides, env=env)
            critic = build_critic(args.config, args.overrides, worker, env) if cfg.rl.advantage == "gae" else None
            generator = build_generator(worker)
            loop = (AsyncGRPOLoop if cfg.rl.max_staleness > 0 else GRPOLoop)(worker, generator, critic)
            wandb_run = start_wandb(worker.cfg, env, run_id=worker.trainer.wandb_run_id)
            worker.trainer.attach_wandb(wandb_run)
            outcome = loop.run()
            worker.trainer.end_summary(outcome)
            if wandb_run is not None:
                wandb_run.finish()
        finally:
            for w in (critic, worker):  # metrics flushed and run directories released, whatever happened
                if w is not None:
                    w.close()
            if generator is not None:  # process groups, child processes and servers released
                generator.close()
            shutdown_distributed(env)
        return EXIT_INTERRUPTED if outcome == "interrupted" else 0

    return run_main(run)
