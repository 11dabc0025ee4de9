"""Ready for the GPU machine (one H200, Python 3.12, no network) without having one here.

The wheelhouse itself is not downloaded in CI: these tests read the declared lists
(tools/env/gpu_image_packages.txt, tools/env/gpu_wheelhouse.txt), run tools/env/gpu_check.sh on this CPU
machine (exit 3 with its reason) and the offline installer against an empty folder (exit 2 naming
the missing wheel) and against a folder of stand-in wheels, with every index pointed at a closed
port: about 5 s in all.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_wheels", REPO / "tools" / "env" / "gpu_wheels.py")
gpu_wheels = sys.modules.setdefault("gpu_wheels", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(gpu_wheels)  # registered first: its dataclass looks its module up

IMAGE = gpu_wheels.read_image_packages()
ENTRIES = gpu_wheels.read_wheelhouse_list()
CARRIED = {e.name: e for e in ENTRIES}
# Anything that tried the network would meet a closed port (and fail) instead of PyPI.
OFFLINE_ENV = {
    **os.environ,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_EXTRA_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_FIND_LINKS": "http://127.0.0.1:9/links",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "http_proxy": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
}


def _pinned(entry) -> str | None:
    specs = list(entry.requirement.specifier)
    return specs[0].version if len(specs) == 1 and specs[0].operator == "==" else None


def test_every_runtime_dependency_reaches_the_gpu_machine():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in map(Requirement, deps):
        name = canonicalize_name(dep.name)
        assert name in IMAGE or name in CARRIED, f"{dep}: neither in the GPU image nor in the wheelhouse"
        known = IMAGE.get(name) or (
            _pinned(CARRIED[name]) if name in CARRIED and CARRIED[name].kind != "floor" else None
        )
        if known is not None:
            assert dep.specifier.contains(str(known), prereleases=True), f"{dep}: the GPU machine gets {known}"
    assert {"torch", "numpy", "pyyaml", "tokenizers"} <= IMAGE.keys()
    assert {"megatron-core", "omegaconf", "wandb"} <= {e.name for e in ENTRIES if e.kind != "floor"}


def test_gpu_check_tools_are_in_the_image():
    for req in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]:
        name = canonicalize_name(Requirement(req).name)
        assert name in IMAGE or name == "ruff", f"dev extra {name} is not in the GPU image"


def test_wheelhouse_list_is_consistent():
    assert len(CARRIED) == len(ENTRIES), "a package is listed twice"
    for e in ENTRIES:
        if e.kind == "floor":
            assert e.name in IMAGE, f"{e.name} is a floor entry but the image does not list it"
        else:
            assert e.name not in IMAGE, f"{e.name} is in the image: carry it only as a floor entry"
            assert _pinned(e), f"{e.requirement}: pin what the image lacks (==)"
    ignored = (REPO / ".gitignore").read_text().split()
    assert "gpu_wheelhouse/" in ignored and ".gpu_site/" in ignored


def test_carried_packages_need_only_what_the_image_or_wheelhouse_holds():
    """Read each carried package's dependencies from this environment where the pinned version
    is installed here (the same release, so the same metadata), markers as on the GPU."""
    checked = 0
    for e in ENTRIES:
        try:
            here = importlib.metadata.version(e.name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if here != _pinned(e):
            continue
        requires = [Requirement(r) for r in importlib.metadata.requires(e.name) or []]
        for req in gpu_wheels.needed(requires, frozenset(), gpu_wheels.TARGET_ENV):
            dep = canonicalize_name(req.name)
            assert dep in IMAGE or dep in CARRIED, f"{e.name} needs {req}: add it to tools/env/gpu_wheelhouse.txt"
        checked += 1
    if not checked:
        pytest.skip("no pinned wheelhouse package is installed here at its pinned version")


def test_gpu_check_exits_3_with_its_reason_on_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: tools/env/gpu_check.sh would run the whole check")
    out = subprocess.run(
        ["bash", str(REPO / "tools" / "env" / "gpu_check.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
        env={**OFFLINE_ENV, "PYTHON": sys.executable},
        timeout=120,
    )
    assert out.returncode == 3, out.stdout + out.stderr
    assert "no CUDA device" in out.stdout and "sees no CUDA device" in out.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["summary.txt"]
    assert "no CUDA device" in (tmp_path / "summary.txt").read_text()


def _install(wheelhouse: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "tools" / "env" / "gpu_install_offline.sh"), "--wheelhouse", str(wheelhouse)]
        + ["--python", sys.executable, "--target", str(target)],
        capture_output=True,
        text=True,
        env=OFFLINE_ENV,
        timeout=120,
    )


def test_offline_install_names_the_missing_wheel(tmp_path):
    empty = tmp_path / "wheelhouse"
    empty.mkdir()
    out = _install(empty, tmp_path / "site")
    assert out.returncode == 2, out.stdout + out.stderr
    required = [str(e.requirement) for e in ENTRIES if e.kind == "required"]
    assert "megatron-core==0.16.1" in required
    assert "missing wheels" in out.stderr
    for spec in required:
        assert spec in out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "site").exists()


def _stand_in_wheel(folder: Path, name: str, version: str, requires: list[str], modules: list[str]) -> None:
    """A pure wheel that installs like the real one: same name, version and dependencies."""
    dist = f"{name.replace('-', '_')}-{version}"
    files = {m: b"" for m in modules}
    files[f"{dist}.dist-info/METADATA"] = "\n".join(
        ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    ).encode()
    files[f"{dist}.dist-info/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
        for path, data in files.items()
    ]
    files[f"{dist}.dist-info/RECORD"] = ("\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        for path, data in files.items():
            zf.writestr(path, data)


def test_offline_install_from_a_folder_of_wheels(tmp_path):
    """Stand-ins for the required wheels (the real ones are cp312, this may be 3.11): installed into
    the target folder only, torch left alone, the optional wandb set reported missing."""
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    modules = {"megatron-core": ["megatron/__init__.py", "megatron/core/__init__.py"]}
    requires = {"megatron-core": ["torch>=2.6.0", "numpy", "packaging>=24.2"], "omegaconf": ["PyYAML>=5.1.0"]}
    for e in ENTRIES:
        if e.kind == "required":
            module = modules.get(e.name, [f"{e.name.replace('-', '_')}/__init__.py"])
            _stand_in_wheel(wheelhouse, e.name, _pinned(e), requires.get(e.name, []), module)
    target = tmp_path / "site"
    out = _install(wheelhouse, target)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "optional wheels missing (wandb==" in out.stderr
    installed = sorted(p.name for p in target.glob("*.dist-info"))
    assert installed == sorted(
        f"{e.name.replace('-', '_')}-{_pinned(e)}.dist-info" for e in ENTRIES if e.kind == "required"
    )
    assert not (target / "torch").exists()
