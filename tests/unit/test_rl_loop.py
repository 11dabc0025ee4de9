"""The GRPO loop: advantages, reward loading, its refusals, exact resume, and the demo learning.

- group advantages against a plain loop (zero-variance groups give 0, never NaN);
- a reward that raises or returns NaN, and a prompt file with a bad row: an error naming it, and
  nothing trained (no step taken, no metrics row);
- a loop stopped at step 2 and resumed gives steps 3-4 of an uninterrupted one, bitwise (prompt
  stream and sampling seeds included);
- ``python -m backend.rl configs/grpo_demo.yaml``: the reward rises several-fold over 30 steps
  and stays flat with ``optimizer.lr=0`` (so the updated weights reach the sampler).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from backend.config import ConfigError
from backend.data.errors import DataFormatError
from backend.generators.hf import HFGenerator
from backend.logging.metric_keys import undocumented
from backend.logging.metrics import read_metrics
from backend.rl import PolicyWorker
from backend.rl.advantages import group_advantages, zero_variance_share
from backend.rl.loop import GRPOLoop
from backend.rl.reward import RewardError, load_reward
from tests.conftest import REPO
from tests.helpers.subprocess_env import subprocess_env

DEMO = str(REPO / "configs" / "grpo_demo.yaml")
SMALL = [
    "rl.prompts_per_step=4",
    "rl.samples_per_prompt=4",
    "rl.max_new_tokens=4",
    "train.train_iters=4",
    "checkpoint.interval=2",
    "logger.log_interval=100",
]


def test_group_advantages_against_a_plain_loop():
    rewards = np.array([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 1.0]])
    for scale in (True, False):
        got = group_advantages(rewards, scale=scale)
        for g, row in enumerate(rewards):
            mean = sum(row) / len(row)
            std = (sum((x - mean) ** 2 for x in row) / len(row)) ** 0.5
            for k, x in enumerate(row):
                want = (x - mean) / (std + 1e-6) if scale else x - mean
                assert got[g, k] == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert np.all(group_advantages(rewards)[1] == 0.0)  # equal rewards: no signal, not NaN
    assert zero_variance_share(rewards) == pytest.approx(1 / 3)


def test_reward_specs(tmp_path):
    f = tmp_path / "r.py"
    f.write_text("def score(prompt, response, row):\n    return len(response)\n")
    assert load_reward(f"{f}:score")("p", "abc", {}) == 3
    assert load_reward("math:hypot")(3, 4) == 5  # module:function
    for spec, message in (
        (f"{f}", "expected 'module:function'"),
        (f"{f}:nope", "no function 'nope'"),
        ("no_such_module_x:f", "cannot import"),
        (f"{tmp_path}/missing.py:f", "no such file"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_reward(spec)


@pytest.fixture(scope="module")
def worker(world, tmp_path_factory):
    run = tmp_path_factory.mktemp("rl_loop") / "run"
    w = PolicyWorker.from_config(DEMO, [*SMALL, f"logger.run_dir={run}"], env=world)
    yield w
    w.close()


def _loop(worker, **rl) -> GRPOLoop:
    worker.trainer.cfg.rl.__dict__.update(rl)  # this test's prompts / reward on the shared worker
    return GRPOLoop(worker, HFGenerator.from_worker(worker))


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise ValueError('no answer field')", "raised ValueError: no answer field"),
        ("return float('nan')", "returned nan"),
        ("return 'yes'", "returned 'yes' (str), not a number"),
    ],
)
def test_a_failing_reward_stops_the_step_naming_it_and_trains_nothing(worker, tmp_path, body, message):
    spec = tmp_path / "bad_reward.py"
    spec.write_text(f"def reward(prompt, response, row):\n    {body}\n")
    before = worker.step
    metrics = Path(worker.cfg.logger.run_dir) / "metrics.jsonl"
    rows_before = len(read_metrics(metrics)[0]) if metrics.exists() else 0
    loop = _loop(worker, reward=f"{spec}:reward", prompts=str(REPO / "configs/grpo_demo/prompts.jsonl"))
    with pytest.raises(RewardError) as e:
        loop.step()
    text = str(e.value)
    assert message in text and f"rl.reward={spec}:reward" in text and "prompts.jsonl:" in text
    if "raise" in body:  # the line in the user's file
        assert f"at {spec}:2 (on " in text
    assert "nothing of this step was trained" in text
    assert worker.step == before
    assert (len(read_metrics(metrics)[0]) if metrics.exists() else 0) == rows_before


def test_a_reward_that_never_returns_stops_the_step_within_its_timeout(worker, tmp_path):
    """rl.reward_timeout_s: a reward stuck for an hour ends the step after about the limit with an
    error naming the function, the prompt and the time (on every rank: the loop's error exchange)."""
    import time

    spec = tmp_path / "stuck_reward.py"
    spec.write_text("import time\n\ndef reward(prompt, response, row):\n    time.sleep(3600)\n")
    before = worker.step
    loop = _loop(worker, reward=f"{spec}:reward", prompts=str(REPO / "configs/grpo_demo/prompts.jsonl"))
    loop.cfg.rl.reward_timeout_s = 1.0
    start = time.perf_counter()
    try:
        with pytest.raises(RewardError) as e:
            loop.step()
    finally:
        loop.cfg.rl.reward_timeout_s = 600.0
    assert time.perf_counter() - start < 30
    text = str(e.value)
    assert f"rl.reward={spec}:reward: no result after 1.0 s (rl.reward_timeout_s=1)" in text
    assert "prompts.jsonl:" in text and "nothing of this step was trained" in text
    assert worker.step == before


def test_a_generator_that_raises_stops_the_step_with_its_error_and_trains_nothing(worker, tmp_path):
    """The generator's own failure (a sampler crash, an out-of-memory) ends the step on every rank
    (the loop's error exchange) with the generator's error and the prompt; no step is taken."""

    class Broken(HFGenerator):
        def generate_batch(self, *args, **kwargs):
            raise RuntimeError("sampler crashed: CUDA error: an illegal memory access")

    spec = tmp_path / "reward.py"
    spec.write_text("def reward(prompt, response, row):\n    return 1.0\n")
    worker.trainer.cfg.rl.__dict__.update(
        reward=f"{spec}:reward", prompts=str(REPO / "configs/grpo_demo/prompts.jsonl")
    )
    base = HFGenerator.from_worker(worker)
    broken = Broken.__new__(Broken)
    broken.__dict__.update(base.__dict__)
    before = worker.step
    with pytest.raises(RuntimeError) as e:
        GRPOLoop(worker, broken).step()
    text = str(e.value)
    assert "generating for" in text and "prompts.jsonl:" in text and "sampler crashed" in text
    assert "nothing of this step was trained" in text
    assert worker.step == before


@pytest.mark.parametrize(
    "line, message",
    [
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"question": "2+2"}', "no 'prompt' or 'messages' field"),
        ('{"prompt": ""}', "'prompt' must be a non-empty string"),
        ('{"prompt": "' + "x" * 300 + '"}', "exceed data.max_seq_length=256"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "needs a chat template"),
    ],
)
def test_a_bad_prompt_row_is_refused_naming_file_and_line(worker, tmp_path, line, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "copy abc: ", "answer": "abc"}) + "\n" + line + "\n")
    with pytest.raises(DataFormatError, match=f"{prompts}:2: .*{message}"):
        _loop(worker, prompts=str(prompts), reward=f"{REPO}/configs/grpo_demo/reward.py:reward")


def _run_loop(world, run_dir, *extra) -> list[dict]:
    w = PolicyWorker.from_config(DEMO, [*SMALL, f"logger.run_dir={run_dir}", *extra], env=world)
    try:
        GRPOLoop(w, HFGenerator.from_worker(w)).run()
    finally:
        w.close()
    return read_metrics(Path(run_dir) / "metrics.jsonl")[0]


def test_a_resumed_loop_continues_the_prompt_and_sampling_stream_exactly(world, tmp_path):
    dense = tmp_path / "dense.py"  # a reward every response earns some of: a signal from the first step
    dense.write_text("def reward(prompt, response, row):\n    return len(set(response)) / 4\n")
    spec = f"rl.reward={dense}:reward"
    whole = _run_loop(world, tmp_path / "whole", spec)
    _run_loop(world, tmp_path / "split", spec, "train.train_iters=2")
    split = _run_loop(world, tmp_path / "split", spec)  # resumes step 2's checkpoint, runs 3 and 4
    assert [r["step"] for r in whole] == [1, 2, 3, 4] and [r["step"] for r in split] == [1, 2, 3, 4]
    for a, b in zip(whole, split):
        for key in ("reward_mean", "reward_std", "response_length_mean", "loss", "grad_norm", "tokens"):
            assert a[key] == b[key], (a["step"], key)
    assert len({r["reward_mean"] for r in whole}) > 1 and all(r["grad_norm"] > 0 for r in whole)  # not vacuous


def _demo(tmp_path: Path, *overrides) -> list[dict]:
    run = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "backend.rl", DEMO, f"logger.run_dir={run}", "logger.log_interval=10", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=subprocess_env(OMP_NUM_THREADS="2"),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run / "metrics.jsonl")[0]
    critic = read_metrics(run / "critic" / "metrics.jsonl")[0]
    assert not undocumented(rows + critic), undocumented(rows + critic)  # every metric in docs/reference/metrics.md
    return rows


@pytest.mark.distributed
def test_the_demo_learns_and_stays_flat_without_updates(tmp_path):
    rows = _demo(tmp_path / "learn")
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = (float(np.mean([r["reward_mean"] for r in part])) for part in (rows[:5], rows[-5:]))
    assert last >= 0.1 and last >= 4 * first, (first, last)
    for key in (
        "generate_s",
        "logprobs_s",
        "step_time_s",
        "weight_sync_s",
        "weight_sync_bytes",
        "zero_variance_groups",
    ):
        assert all(key in r for r in rows), key
    frozen = _demo(tmp_path / "frozen", "optimizer.lr=0", "optimizer.min_lr=0", "train.train_iters=10")
    first, last = (float(np.mean([r["reward_mean"] for r in part])) for part in (frozen[:5], frozen[5:]))
    assert abs(last - first) <= 0.03 and last < 0.05, (first, last)


#: GRPO with LoRA (rank 8 on all seven projections) on the demo. Its base is random: at the demo's
#: init_method_std of 0.02 a frozen (tied) output layer can raise a token's logit by about 2.5 nats
#: at most (hidden 128, the final norm's unit scale), so adapters alone barely move the reward in 60
#: steps (measured: 0.004 -> 0.012); full fine-tuning learns through the output layer itself. A
#: base at 0.2 has the output range a pretrained model has, and LoRA learns as full fine-tuning does.
LORA_DEMO = ("model.lora.rank=8", "model.init_method_std=0.2", "optimizer.lr=0.02", "optimizer.min_lr=0.02")


@pytest.mark.distributed
def test_grpo_with_lora_learns_with_kl_to_its_base_and_stays_flat_at_lr_0(tmp_path):
    """The generator samples the merged weights after every sync, and the KL penalty's reference is
    the base (the adapters off): 0 at step 1 (B = 0), above 0 once the adapters have trained."""
    rows = _demo(tmp_path / "learn", *LORA_DEMO, "loss.kl_coef=0.01")
    first, last = (float(np.mean([r["reward_mean"] for r in part])) for part in (rows[:5], rows[-5:]))
    assert last >= 0.1 and last >= 4 * first, (first, last)
    assert rows[0]["kl"] == 0.0 and all(r["kl"] > 0 for r in rows[5:]), [r["kl"] for r in rows]
    assert all(r["weight_sync_bytes"] > 0 for r in rows)
    frozen = _demo(tmp_path / "frozen", *LORA_DEMO[:2], "optimizer.lr=0", "optimizer.min_lr=0", "train.train_iters=10")
    first, last = (float(np.mean([r["reward_mean"] for r in part])) for part in (frozen[:5], frozen[5:]))
    assert abs(last - first) <= 0.03 and last < 0.05, (first, last)


@pytest.mark.distributed
def test_a_lora_critic_trains_its_adapters_and_value_head(tmp_path):
    """PPO with LoRA: the critic (the policy's config, model.lora included) trains its adapters and
    its new value head, the value loss falls, and its checkpoint holds exactly those."""
    from backend.checkpoint.safe_dcp import read_metadata_file

    rows = _demo(tmp_path / "ppo", "rl.advantage=gae", "model.lora.rank=8", "train.train_iters=15")
    vf = [r["vf_loss"] for r in rows]
    assert np.mean(vf[-5:]) < np.mean(vf[:5]) / 3, vf
    step = tmp_path / "ppo" / "run" / "critic" / "checkpoints" / "step_00000015"
    keys = [k for k in read_metadata_file(step / ".metadata").state_dict_metadata if k.startswith("model.")]
    kept = sorted(k for k in keys if ".adapters." not in k and not k.endswith("_extra_state"))
    assert kept == ["model.output_layer.bias", "model.output_layer.weight"], kept


@pytest.mark.distributed
def test_ppo_with_a_critic_learns_its_values(tmp_path):
    """rl.advantage=gae on the demo: the critic (a ValueWorker beside the policy, its own run
    directory and checkpoints) lowers its value loss and raises its explained variance, and the
    policy's reward rises."""
    rows = _demo(tmp_path / "ppo", "rl.advantage=gae")
    vf, ev = [r["vf_loss"] for r in rows], [r["explained_variance"] for r in rows]
    assert np.mean(vf[-5:]) < 0.5 * np.mean(vf[:5]), vf
    assert np.mean(ev[-5:]) > np.mean(ev[:5]), ev
    assert np.mean([r["reward_mean"] for r in rows[-5:]]) > 4 * max(0.01, np.mean([r["reward_mean"] for r in rows[:5]]))
    critic = tmp_path / "ppo" / "run" / "critic"
    assert len(read_metrics(critic / "metrics.jsonl")[0]) == 30 and (critic / "checkpoints" / "step_00000030").is_dir()
