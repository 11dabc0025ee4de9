"""tools/simulate_batching.py: the planner's metrics beside the baselines, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOOL = [sys.executable, str(REPO / "tools" / "simulate_batching.py")]
KEYS = {
    "padding_efficiency",
    "num_microbatches",
    "modelled_step_time",
    "over_budget_microbatches",
    "oversize_singletons",
    "coverage_ok",
    "plan_ms",
}


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TOOL, *args], capture_output=True, text=True, cwd=REPO)


def test_json_has_every_scheduler_and_key():
    out = run("--dp", "8", "--cp", "2", "--steps", "1", "--global-batch-size", "128", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {(r["set"], r["scheduler"]) for r in rows} >= {
        ("rl_longtail", "dynamic"),
        ("short", "sort_and_stride"),
        ("equal", "fixed_mbs1"),
    }
    for r in rows:
        assert KEYS <= r.keys()
        assert r["coverage_ok"] is True
        if r["scheduler"] != "fixed_mbs1":  # a fixed plan has no budget, so it cannot be over one
            assert r["over_budget_microbatches"] == 0


def test_lengths_file_and_its_errors(tmp_path):
    good = tmp_path / "lengths.txt"
    good.write_text("# rollouts\n12\n4000\n\n7\n900\n3\n")
    out = run("--lengths-file", str(good), "--global-batch-size", "2", "--dp", "2", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {r["set"] for r in rows} == {"lengths.txt"}
    assert rows[0]["steps"] == 3  # 5 lengths, windows of 2: the short last window is planned too
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n")
    out = run("--lengths-file", str(bad))
    assert out.returncode != 0 and f"{bad}:2" in out.stderr


def test_bad_budget_is_a_clear_error():
    out = run("--cp", "4", "--max-tokens-per-gpu", "1", "--set", "equal")
    assert out.returncode != 0 and "max_tokens_per_gpu=1 is below the smallest" in out.stderr


def test_packed_beside_padded_efficiency_and_invariants():
    """Packed rows waste at most 1% at cp 1 and 2% at cp 2 on every length set; every plan's
    invariants hold (the tool checks them per window)."""
    for cp, floor in ((1, 0.99), (2, 0.98)):
        out = run("--dp", "8", "--cp", str(cp), "--steps", "2", "--global-batch-size", "256", "--json")
        assert out.returncode == 0, out.stderr
        rows = [json.loads(line) for line in out.stdout.splitlines()]
        assert {r["scheduler"] for r in rows} >= {"dynamic", "dynamic_packed"}
        for r in rows:
            assert r["invariants_ok"] is True, r
            if r["scheduler"] == "dynamic_packed":
                assert r["layout"] == "packed"
                assert r["padding_efficiency"] >= floor, r
                padded = next(x for x in rows if x["set"] == r["set"] and x["scheduler"] == "dynamic")
                assert r["padding_efficiency"] >= padded["padding_efficiency"]
