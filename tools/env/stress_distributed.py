#!/usr/bin/env python3
"""Run multi-process test modules again and again under load; report every failure, aborts first.

A gloo rank that aborts at exit (``terminate called without an active exception``, exit -6) shows
only on a loaded machine: one module failed once in a fresh clone's suite and passed 3 of 3 runs
alone. This tool runs each module ``--passes`` times in a row, one pytest process at a time, with
``--hog`` busy processes beside it (default: one per core, so the ranks fight for every core), and
classifies each failed run by what its output says:

- ``abort``: a rank killed by a signal (``exited with codes [-6]``, ``terminate called``);
- ``hang``: a rank that did not finish within the harness's time limit;
- ``timeout``: the whole pytest run exceeded ``--timeout``;
- ``fail``: anything else (an assertion, a traceback).

Not part of the suite (minutes per pass); run it after touching process groups, teardown or any
collective. Prints a table and, with --json, one JSON object.

    python tools/env/stress_distributed.py [MODULE ...] [--passes 3] [--hog N] [--timeout 900] [--json]

MODULE defaults to every ``tests/distributed/test_*.py``; ``-k EXPR`` narrows each run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ABORT = re.compile(r"exited with codes \[-\d|terminate called|Aborted|SIGABRT|core dumped")
HANG = re.compile(r"did not finish within")


def classify(rc: int | None, output: str) -> str:
    """``ok``, ``abort``, ``hang``, ``timeout`` or ``fail`` for one pytest run (see the module docstring)."""
    if rc is None:
        return "timeout"
    if ABORT.search(output):
        return "abort"
    if HANG.search(output):
        return "hang"
    return "ok" if rc == 0 else "fail"


def start_hog(n: int) -> list[subprocess.Popen]:
    """``n`` processes that spin on a core each until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL) for _ in range(n)]


def run_module(module: str, k: str | None, timeout: float) -> tuple[int | None, float, str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module]
    if k:
        cmd += ["-k", k]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        return done.returncode, time.monotonic() - t0, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        return None, time.monotonic() - t0, out


def excerpt(output: str, lines: int = 12) -> str:
    """The lines that say what went wrong (the abort or error lines and the summary)."""
    keep = [
        line
        for line in output.splitlines()
        if ABORT.search(line) or HANG.search(line) or line.startswith(("E ", "FAILED", "ERROR")) or " passed" in line
    ]
    return "\n".join(keep[-lines:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modules", nargs="*", help="test modules (default: every tests/distributed/test_*.py)")
    p.add_argument("--passes", type=int, default=3, help="runs of each module")
    p.add_argument("--hog", type=int, default=os.cpu_count() or 1, help="busy processes beside the tests (0: none)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one pytest run may take")
    p.add_argument("-k", default=None, help="pytest -k expression for every run")
    p.add_argument("--json", action="store_true", help="print one JSON object after the table")
    args = p.parse_args(argv)
    modules = args.modules or sorted(
        str(m.relative_to(REPO)) for m in (REPO / "tests" / "distributed").glob("test_*.py")
    )

    runs = []
    hog = start_hog(args.hog)
    try:
        for n in range(args.passes):
            for module in modules:
                rc, seconds, output = run_module(module, args.k, args.timeout)
                kind = classify(rc, output)
                runs.append({"module": module, "pass": n, "rc": rc, "seconds": round(seconds, 1), "result": kind})
                if kind != "ok":
                    runs[-1]["excerpt"] = excerpt(output)
                print(f"pass {n} {module}: {kind} ({seconds:.0f} s)", file=sys.stderr, flush=True)
    finally:
        for proc in hog:
            proc.kill()
            proc.wait()

    print(f"{'module':60} {'runs':>5} {'ok':>4} {'abort':>6} {'hang':>5} {'fail':>5} {'timeout':>8} {'median s':>9}")
    summary = {}
    for module in modules:
        mine = [r for r in runs if r["module"] == module]
        counts = {kind: sum(r["result"] == kind for r in mine) for kind in ("ok", "abort", "hang", "fail", "timeout")}
        times = sorted(r["seconds"] for r in mine)
        summary[module] = {"runs": len(mine), **counts, "median_s": times[len(times) // 2] if times else None}
        print(
            f"{module:60} {len(mine):>5} {counts['ok']:>4} {counts['abort']:>6} {counts['hang']:>5} "
            f"{counts['fail']:>5} {counts['timeout']:>8} {summary[module]['median_s']:>9}"
        )
    failures = [r for r in runs if r["result"] != "ok"]
    for r in failures:
        print(f"\n--- {r['module']} pass {r['pass']}: {r['result']} (rc {r['rc']})\n{r.get('excerpt', '')}")
    if args.json:
        print(json.dumps({"passes": args.passes, "hog": args.hog, "modules": summary, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
