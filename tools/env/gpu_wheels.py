"""The GPU machine's offline wheelhouse: the declared lists, their check, the install plan.

The GPU machine (one H200, Python 3.12.3, torch 2.11.0+cu130) has no network at all, so what its
image lacks travels as wheels in ``gpu_wheelhouse/`` (26.5 MiB, built here by
tools/env/gpu_wheelhouse.sh). Two committed lists say what is where:

- tools/env/gpu_image_packages.txt: the image's packages (``name`` or ``name==version``);
- tools/env/gpu_wheelhouse.txt: what the wheelhouse holds, one requirement a line with its kind
  (``required``, ``optional`` or ``floor``; see that file).

Subcommands (stdlib plus ``packaging``, so this runs under the image's python3 and here):

- ``verify DIR``: every declared wheel is in DIR once, nothing else is, and every dependency of
  every wheel (markers read for CPython 3.12 on x86-64 Linux) is in DIR or in the image; writes
  DIR/MANIFEST.txt. Exit 1 on a problem.
- ``plan DIR``: run by the interpreter that will import the packages; prints the wheel files to
  install, one a line. Exit 2 naming each missing required wheel.
- ``check-installed``: every dependency of each installed declared package is satisfied. Exit 2.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # the image's pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version

TOOLS = Path(__file__).resolve().parent
IMAGE_LIST = TOOLS / "gpu_image_packages.txt"
WHEELHOUSE_LIST = TOOLS / "gpu_wheelhouse.txt"
KINDS = ("required", "optional", "floor")
# The GPU image's interpreter, for reading dependency markers from this (3.11) machine.
TARGET_ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "os_name": "posix",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}


@dataclass(frozen=True)
class Entry:
    """One line of tools/env/gpu_wheelhouse.txt."""

    requirement: Requirement
    kind: str
    sdist: bool = False

    @property
    def name(self) -> str:
        return canonicalize_name(self.requirement.name)


def _lines(path: Path):
    for n, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if line:
            yield n, line


def read_image_packages(path: Path = IMAGE_LIST) -> dict[str, Version | None]:
    """The image's packages: canonical name -> version where it was read, else None."""
    out: dict[str, Version | None] = {}
    for _, line in _lines(path):
        name, _, version = line.partition("==")
        out[canonicalize_name(name)] = Version(version) if version else None
    return out


def read_wheelhouse_list(path: Path = WHEELHOUSE_LIST) -> list[Entry]:
    entries = []
    for n, line in _lines(path):
        spec, kind, *flags = line.split()
        if kind not in KINDS or flags not in ([], ["sdist"]):
            raise ValueError(f"{path}:{n}: expected 'REQUIREMENT {'|'.join(KINDS)} [sdist]', got {line!r}")
        entries.append(Entry(Requirement(spec), kind, bool(flags)))
    return entries


def wheels_in(folder: Path) -> dict[str, list[tuple[Version, Path]]]:
    found: dict[str, list[tuple[Version, Path]]] = {}
    for path in sorted(Path(folder).glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(path.name)
        found.setdefault(canonicalize_name(name), []).append((version, path))
    return found


def wheel_requires(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as zf:
        meta = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = email.parser.BytesParser().parsebytes(zf.read(meta), headersonly=True)
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def needed(requires: list[Requirement], extras: frozenset[str], env: dict | None) -> list[Requirement]:
    """The requirements that apply with these extras (markers evaluated in env, else here)."""
    out = []
    for req in requires:
        if req.marker is None:
            out.append(req)
            continue
        for extra in extras | {""}:
            if req.marker.evaluate({**(env or {}), "extra": extra} if env else {"extra": extra}):
                out.append(req)
                break
    return out


def _pick(entry: Entry, wheels: dict[str, list[tuple[Version, Path]]]) -> Path | None:
    fits = [p for v, p in wheels.get(entry.name, []) if entry.requirement.specifier.contains(v, prereleases=True)]
    return fits[-1] if fits else None


def verify(folder: Path, entries: list[Entry], image: dict[str, Version | None]) -> tuple[list[str], list[str]]:
    """Problems (each a sentence) and notes (image packages relied on, with the ranges needed)."""
    wheels = wheels_in(folder)
    problems = []
    declared = {e.name: e for e in entries}
    for e in entries:
        have = wheels.get(e.name, [])
        if not have:
            problems.append(f"no wheel for {e.requirement} ({e.kind})")
        elif len(have) > 1:
            problems.append(f"{len(have)} wheels for {e.name}: keep one ({', '.join(p.name for _, p in have)})")
        elif _pick(e, wheels) is None:
            problems.append(f"{have[0][1].name} does not satisfy {e.requirement}")
    problems += [f"{ps[0][1].name} is not in {WHEELHOUSE_LIST.name}" for n, ps in wheels.items() if n not in declared]

    relied: dict[str, list[str]] = {}
    todo = [(e.name, frozenset()) for e in entries if e.name in wheels]
    seen = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name not in wheels:
            continue
        seen.add((name, extras))
        for req in needed(wheel_requires(wheels[name][0][1]), extras, TARGET_ENV):
            dep = canonicalize_name(req.name)
            if dep in wheels and dep not in image:
                version = wheels[dep][0][0]
                if not req.specifier.contains(version, prereleases=True):
                    problems.append(f"{name} needs {req}, the wheelhouse has {dep} {version}")
                todo.append((dep, frozenset(req.extras)))
            elif dep in image:
                if str(req.specifier):
                    relied.setdefault(dep, []).append(f"{req.specifier} ({name})")
                known = image[dep]
                floor = declared.get(dep)
                if known is not None and not req.specifier.contains(known, prereleases=True) and floor is None:
                    problems.append(f"{name} needs {req}, the image has {dep} {known} and the wheelhouse none")
                if floor is not None and dep in wheels:
                    floor_version = wheels[dep][0][0]
                    if not req.specifier.contains(floor_version, prereleases=True):
                        problems.append(f"{name} needs {req}, the floor wheel is {dep} {floor_version}")
                    todo.append((dep, frozenset(req.extras)))
            else:
                problems.append(f"{name} needs {req}, which neither the image nor the wheelhouse holds")
    notes = [f"{dep} {', '.join(sorted(set(r)))}" for dep, r in sorted(relied.items())]
    return problems, notes


def write_manifest(folder: Path, entries: list[Entry], notes: list[str]) -> Path:
    wheels = wheels_in(folder)
    rows = []
    total = 0
    for e in entries:
        path = _pick(e, wheels)
        size = path.stat().st_size if path else 0
        total += size
        rows.append(f"{path.name if path else '-'}\t{size}\t{e.kind}\t{e.requirement}")
    text = [
        "# gpu_wheelhouse: wheel<TAB>bytes<TAB>kind<TAB>declared requirement (tools/env/gpu_wheelhouse.txt)",
        f"# total {total} bytes ({total / 2**20:.1f} MiB), {len(rows)} wheels, for CPython 3.12 x86-64 Linux",
        *rows,
        "# image packages relied on, with the ranges these wheels need (versions unread there):",
        *(f"# {n}" for n in notes),
    ]
    out = Path(folder) / "MANIFEST.txt"
    out.write_text("\n".join(text) + "\n")
    return out


def _installed(name: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(name))
    except importlib.metadata.PackageNotFoundError:
        return None


def plan(folder: Path, entries: list[Entry]) -> tuple[list[Path], list[str], list[str]]:
    """Wheel files to install for this interpreter, missing required wheels, and warnings."""
    wheels = wheels_in(folder) if Path(folder).is_dir() else {}
    files, missing, warnings = [], [], []
    for e in entries:
        if e.kind == "floor":
            have = _installed(e.name)
            if have is not None and e.requirement.specifier.contains(have, prereleases=True):
                continue
            why = f"this interpreter has {e.name} {have}" if have else f"this interpreter lacks {e.name}"
            path = _pick(e, wheels)
            if path is None:
                missing.append(f"{e.requirement} ({why})")
            else:
                files.append(path)
        else:
            path = _pick(e, wheels)
            if path is not None:
                files.append(path)
            elif e.kind == "required":
                missing.append(str(e.requirement))
            else:
                warnings.append(str(e.requirement))
    if warnings:
        # An optional set is useful only whole: wandb without pydantic does not import.
        opt = {e.name for e in entries if e.kind == "optional"}
        files = [f for f in files if canonicalize_name(parse_wheel_filename(f.name)[0]) not in opt]
        shown = ", ".join(warnings[:3]) + (f" and {len(warnings) - 3} more" if len(warnings) > 3 else "")
        warnings = [f"optional wheels missing ({shown}): wandb not installed; logger.wandb.enable=true runs would fail"]
    return files, missing, warnings


def check_installed(entries: list[Entry]) -> list[str]:
    """Unsatisfied dependencies of the declared packages this interpreter sees."""
    problems = []
    for e in entries:
        have = _installed(e.name)
        if have is None:
            if e.kind == "required":
                problems.append(f"{e.name} is not installed")
            continue
        if not e.requirement.specifier.contains(have, prereleases=True):
            problems.append(f"{e.name} {have} is installed, {e.requirement} was expected")
        for req in needed([Requirement(r) for r in importlib.metadata.requires(e.name) or []], frozenset(), None):
            dep = _installed(req.name)
            if dep is None or not req.specifier.contains(dep, prereleases=True):
                problems.append(f"{e.name} needs {req}, found {req.name} {dep or 'missing'}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("verify").add_argument("folder", type=Path)
    sub.add_parser("plan").add_argument("folder", type=Path)
    sub.add_parser("check-installed")
    sub.add_parser("sdists", help="print the declared sdist-only requirements")
    args = p.parse_args(argv)
    entries = read_wheelhouse_list()

    if args.cmd == "sdists":
        print("\n".join(str(e.requirement) for e in entries if e.sdist))
        return 0
    if args.cmd == "verify":
        problems, notes = verify(args.folder, entries, read_image_packages())
        for line in problems:
            print(f"gpu_wheels verify: {line}", file=sys.stderr)
        if not problems:
            print(f"gpu_wheels verify: wrote {write_manifest(args.folder, entries, notes)}")
        return 1 if problems else 0
    if args.cmd == "plan":
        files, missing, warnings = plan(args.folder, entries)
        for line in warnings:
            print(f"gpu_install_offline: warning: {line}", file=sys.stderr)
        if missing:
            print(
                f"gpu_install_offline: missing wheels in {args.folder}: {', '.join(missing)}. "
                "Build the folder with tools/env/gpu_wheelhouse.sh on a machine with network and carry it.",
                file=sys.stderr,
            )
            return 2
        print("\n".join(str(f) for f in files))
        return 0
    problems = check_installed(entries)
    for line in problems:
        print(f"gpu_install_offline: {line}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
