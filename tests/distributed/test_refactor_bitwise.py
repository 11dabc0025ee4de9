"""Structure changes change no number: the same jobs run side by side from the commit before the
engine / ParallelDims restructuring and from this tree, compared exactly with the kernels of
then pinned (``tests/helpers/pinned_kernels.py``: the dense-mask and per-sequence SDPA calls, a
prompt prefilled once per sample, torch.multinomial's draws), and within FP32 rounding with
today's causal fast paths (the sampler still pinned).

The jobs (``tests/helpers/baseline_runs.py``): the quickstart's first 3 steps (losses, gradient
norms, validation loss), a packed dp 2 run of the tiny config, 6 steps of the GRPO demo (rewards,
losses, gradient norms, entropy) and a policy worker's step and log-probabilities. Both trees run
in this test on this machine (FP32 sums round differently on other CPUs, so recorded numbers
would not travel); the earlier tree comes from git (``git archive``), so a clone without that
commit skips with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.distributed

# The last commit before the restructuring (issue: one engine, two drivers, ParallelDims).
BASE = "f4f991e75792f3cae49b632bce687585e8a930ba"
DRIVER = REPO / "tests" / "helpers" / "baseline_runs.py"


def _numbers(tree, work, *, pinned: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = work / "out.json"
    done = subprocess.run(
        [sys.executable, str(DRIVER), str(out), str(work), *([f"--pinned={pinned}"] if pinned else [])],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def test_numbers_equal_the_commit_before(tmp_path):
    has = subprocess.run(["git", "cat-file", "-e", f"{BASE}^{{commit}}"], cwd=REPO, capture_output=True)
    if has.returncode:
        pytest.skip(f"commit {BASE[:10]} is not in this clone (a shallow clone?): nothing to compare with")
    base = tmp_path / "base"
    base.mkdir()
    archive = subprocess.run(["git", "archive", BASE], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    before = _numbers(base, tmp_path / "before")
    pinned = _numbers(REPO, tmp_path / "pinned", pinned="kernels,sampler")
    assert pinned.keys() == before.keys()
    for job in before:
        assert pinned[job] == before[job], f"{job}: {json.dumps(before[job])[:800]} != {json.dumps(pinned[job])[:800]}"
    # the jobs say something: the GRPO demo's reward and gradient moved within its 6 steps
    assert any(r.get("grad_norm") not in (None, "0.0") for r in pinned["grpo"])
    # today's kernels: the same runs to FP32 rounding (the same tokens, microbatches and sampled
    # responses' rewards; losses, norms and log-probabilities within RTOL of each other). The
    # sampler stays pinned: today's draws other tokens from the same distribution
    # (tests/unit/test_causal_fast_paths.py checks it), which no tolerance could compare.
    now = _numbers(REPO, tmp_path / "now", pinned="sampler")
    worst = _compare(before, now)
    print(f"largest relative difference with the causal fast paths: {worst:.2e}")


EXACT = ("tokens", "num_microbatches", "reward_mean")  # counts, and rewards of the same sampled responses
RTOL = 1e-4  # relative, on |x| + 1e-3 (FP32 rounding after 6 optimizer steps at lr 5e-3)


def _compare(before, now, where="") -> float:
    """The largest relative difference between two job trees of repr'd floats (asserted <= RTOL);
    every other value (steps, events, token counts) equal."""
    if isinstance(before, dict):
        assert isinstance(now, dict) and now.keys() == before.keys(), where
        return max((_compare(before[k], now[k], f"{where}.{k}") for k in before), default=0.0)
    if isinstance(before, list):
        assert isinstance(now, list) and len(now) == len(before), where
        return max((_compare(b, n, f"{where}[{i}]") for i, (b, n) in enumerate(zip(before, now))), default=0.0)
    if isinstance(before, str) and before != now and not where.endswith(EXACT):
        b, n = float(before), float(now)
        diff = abs(b - n) / (abs(b) + 1e-3)
        assert diff <= RTOL, f"{where}: {before} before, {now} now"
        return diff
    assert before == now, f"{where}: {before!r} before, {now!r} now"
    return 0.0
