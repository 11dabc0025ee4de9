"""The house rules, checked on the import graph: the arrows between packages run one way.

batching/ is pure (no torch, no filesystem), data/ never imports the model or the trainer,
logging/ never imports the trainer, and nothing in the library imports the benchmarks.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "backend"


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports resolved against the package)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join([*base, node.module] if node.module else base))
            else:
                out.add(node.module)
    return out


def files(subpackage: str) -> list[Path]:
    return sorted((PACKAGE / subpackage).rglob("*.py"))


FORBIDDEN = {
    "batching": ("torch", "os", "pathlib", "shutil", "glob", "io", "sysconfig", "backend.data", "backend.model"),
    "data": ("backend.model", "backend.train", "backend.bench", "backend.logging"),
    "logging": ("backend.train", "backend.bench"),
    "config": ("torch", "backend.model", "backend.train", "backend.data"),
    "model": ("backend.train", "backend.bench", "backend.data"),
    "distributed": ("backend.model", "backend.train", "backend.bench"),
    "train": ("backend.bench",),
}


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_imports_run_one_way(subpackage):
    bad = []
    for path in files(subpackage):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[subpackage]):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


def test_one_place_builds_models():
    """Only the model factory calls the GPT builder; every tool and test goes through it."""
    callers = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "tools").rglob("*.py"), *(REPO / "tests").rglob("*.py")]:
        if path.name in {"builder.py", "factory.py", "test_layout.py"}:
            continue
        if "build_gpt(" in path.read_text(encoding="utf-8"):
            callers.append(str(path.relative_to(REPO)))
    assert callers == []


def test_installed_console_script_prints_the_config():
    script = Path(sys.executable).parent / "backend-train"
    if not script.exists():
        pytest.skip(f"the package is not installed in this interpreter's environment ({sys.executable})")
    out = subprocess.run(
        [str(script), str(REPO / "configs" / "quickstart.yaml"), "train.train_iters=7", "--print-config"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ),
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "train_iters: 7" in out.stdout and "dynamic_batch_enable: true" in out.stdout
