"""The documentation says only what the code does: the site builds strictly, the generated
references are current, and every config key, command, flag and YAML block the pages show exists.

Pages: README.md and docs/**/*.md. A dotted key (``train.max_tokens_per_gpu``) must be a leaf key
or a section of the schema; a ```bash block's commands must name an existing module, tool or file
and only flags its argparse accepts, and its ``key=value`` overrides existing keys; a ```yaml
block must merge into the schema (unknown keys and wrong types fail as a run's config would).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from backend.config.schema import Config
from tests.conftest import REPO
from tools.docs import gen_reference

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
#: a dotted key as prose writes it: section.key[.key], not part of a path, module or file name
KEY = re.compile(rf"(?<![\w./-])((?:{'|'.join(SECTIONS)})(?:\.[a-z_][a-z0-9_]*)+)(?![\w/(-])")
FILE_SUFFIXES = {
    "jsonl",
    "json",
    "py",
    "yaml",
    "yml",
    "sbatch",
    "bin",
    "idx",
    "md",
    "png",
    "parquet",
    "safetensors",
    "pt",
    "sh",
    "txt",
    "distcp",
    "log",
}


def _leaves(node, prefix: str = "") -> set[str]:
    out = set()
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        out |= {key, *(_leaves(value, key + ".") if dataclasses.is_dataclass(value) else ())}
    return out


KEYS = _leaves(Config())


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def test_generated_references_are_current():
    assert gen_reference.stale_pages() == [], "run python tools/docs/gen_reference.py"


def test_every_config_key_has_a_meaning_in_the_reference():
    rows = gen_reference.config_keys()  # raises UndocumentedKey for a field without its comment
    leaves = {k for k in KEYS if not dataclasses.is_dataclass(_value(k))}
    assert {r["key"] for r in rows} == leaves
    assert all(r["meaning"].strip() for r in rows)
    page = (REPO / "docs" / "reference" / "config.md").read_text()
    assert all(f"| `{key}` |" in page for key in leaves)


def _value(key: str):
    node = Config()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def test_every_metric_in_the_reference():
    from backend.logging.metric_keys import METRICS, undocumented

    page = (REPO / "docs" / "reference" / "metrics.md").read_text()
    assert all(f"| `{key}` |" in page for key in METRICS)
    assert all(unit and meaning for unit, meaning in METRICS.values())
    assert undocumented([{"loss": 1.0, "made_up_metric": 2}]) == {"made_up_metric"}  # the check can fail


def test_mkdocs_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs-material) is not installed: EXTRAS=...,docs")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_readme_is_a_front_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for command in (
        "bash tools/setup_env.sh && .venv/bin/python -m backend.train configs/quickstart.yaml",
        "bash tools/setup_env.sh && .venv/bin/python -m pytest -q",
    ):
        assert command in readme


def _dotted_keys(text: str) -> set[str]:
    found = set()
    for match in KEY.finditer(text):
        key = match.group(1).rstrip(".")
        if key.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # train.jsonl, reward.py: a file, not a key
            continue
        found.add(key)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_dotted_key_a_page_names_exists(page):
    text = page.read_text()
    unknown = sorted(k for k in _dotted_keys(text) if k not in KEYS and not _wildcard(k))
    assert not unknown, f"{page.relative_to(REPO)} names keys the schema does not have: {unknown}"


def _wildcard(key: str) -> bool:
    """``loss.*``-style prose is caught by the regex as the section alone: a section is a key."""
    return key in SECTIONS


def test_the_key_check_can_fail():
    assert _dotted_keys("set `train.max_tokens_per_gpu` and train.made_up, not backend.train.cli or train.jsonl") == {
        "train.max_tokens_per_gpu",
        "train.made_up",
    }


@cache
def _help(module: str) -> str:
    prog = next((run for run, mod in gen_reference.COMMANDS if mod == module), module)
    return gen_reference.command_help(module, prog)


def _module_of(words: list[str]) -> tuple[str | None, list[str]]:
    """(the module whose main runs, the words after it) for a python / torchrun / tools command."""
    if "-m" in words:
        i = words.index("-m")
        return words[i + 1], words[i + 2 :]
    for i, w in enumerate(words):
        if w.startswith("tools/") and w.endswith(".py"):
            return "tools." + w[:-3].replace("/", ".").removeprefix("tools."), words[i + 1 :]
    return None, words


def _check_command(line: str) -> list[str]:
    problems = []
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return problems
    head = Path(words[0]).name
    if head in ("bash", "sbatch", "srun") and len(words) > 1 and "/" in words[1]:
        script = next((w for w in words[1:] if w.startswith("tools/")), None)
        if script and not (REPO / script).is_file():
            problems.append(f"{script}: no such file")
        return problems
    if head.startswith("backend-"):
        return problems  # console scripts: the same mains as tools/ (test_layout checks them)
    if head not in ("python", "python3", "torchrun"):
        return problems
    module, rest = _module_of(words)
    if module is None:
        return problems
    if module.startswith("tools."):
        path = REPO / (module.replace(".", "/") + ".py")
        if not path.is_file():
            return [f"{module}: no such tool"]
        tools = {run.split()[-1]: mod for run, mod in gen_reference.COMMANDS if "tools/" in run}
        if str(path.relative_to(REPO)) not in tools:
            return problems  # benchmarks: their own --help is their reference
        module = tools[str(path.relative_to(REPO))]
    elif importlib.util.find_spec(module) is None:
        return [f"{module}: no such module"]
    if module in ("pytest", "mkdocs", "pip", "venv"):
        return problems
    module = {"backend.train": "backend.train.cli", "backend.rl": "backend.rl.cli"}.get(module, module)
    known = set(re.findall(r"--[a-z][a-z0-9-]*", _help(module)))
    for w in rest:
        flag = w.split("=")[0]
        if flag.startswith("--") and flag not in known:
            problems.append(f"{module}: no flag {flag}")
        elif "=" in w and not w.startswith("-") and re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", w.split("=")[0]):
            if w.split("=")[0] not in KEYS:
                problems.append(f"{module}: override of unknown key {w.split('=')[0]}")
    return problems


def _commands(text: str) -> list[str]:
    out = []
    for block in _blocks(text, "bash"):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            for part in re.split(r"&&|\|\||;|\|", line):
                if part.strip() and not part.strip().startswith("#"):
                    out.append(part.strip())
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_a_page_shows_exists_with_its_flags(page):
    problems = [f"{line!r}: {p}" for line in _commands(page.read_text()) for p in _check_command(line)]
    assert not problems, "\n".join(problems)


def test_the_command_check_can_fail():
    assert _check_command("python -m backend.train configs/quickstart.yaml --print-config train.train_iters=3") == []
    assert _check_command("python tools/export_hf.py --no-such-flag") == [
        "backend.commands.export_hf: no flag --no-such-flag"
    ]
    assert _check_command("python -m backend.train c.yaml train.no_such_key=1") == [
        "backend.train.cli: override of unknown key train.no_such_key"
    ]
    assert _check_command("python tools/no_such_tool.py") != []


def _yaml_problem(block: str) -> str | None:
    data = yaml.safe_load(block)
    if not isinstance(data, dict):
        return "not a mapping of sections"
    data.pop("defaults", None)
    base = OmegaConf.structured(Config)
    OmegaConf.set_struct(base, True)
    try:
        OmegaConf.merge(base, OmegaConf.create(data))
    except Exception as e:  # noqa: BLE001 - OmegaConf's key and type errors, reported with the block
        return str(e).splitlines()[0]
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_yaml_block_a_page_shows_parses_as_a_config(page):
    problems = [p for block in _blocks(page.read_text(), "yaml") if (p := _yaml_problem(block))]
    assert not problems, problems


def test_the_yaml_check_can_fail():
    assert _yaml_problem("train: {max_tokens_per_gpu: 4096}") is None
    assert _yaml_problem("train: {no_such_key: 1}") is not None
    assert _yaml_problem("train: {train_iters: many}") is not None
