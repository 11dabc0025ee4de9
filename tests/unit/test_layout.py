"""The house rules, checked on the import graph: the arrows between packages run one way.

batching/ is pure (no torch, no filesystem), data/ never imports the model or the trainer,
logging/ never imports the trainer, and nothing in the library imports the benchmarks. No module
of ``backend`` takes part in an import circle (imports inside functions count: a deferred import
hides a circle, it does not remove it), and the attention package is imported one way, by kernel.
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
    "distributed": ("backend.model", "backend.train", "backend.bench", "backend.config", "backend.data"),
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


#: The rooms of ``backend/``, bottom floor first: a room imports only rooms on floors below its own
#: (imports inside functions included). checkpoint/ and loss/ sit below train/ (the trainer uses
#: them, never the reverse); rl/ sits on train/ and generators/ (the rollout engines, which know
#: nothing of the trainer); bench/ above (tools and tests, never training);
#: commands/ (the user commands behind tools/ and the console scripts) on top.
ROOM_FLOORS = [
    ("errors", "megatron_compat", "batching"),
    ("distributed",),
    ("config",),
    ("data",),
    ("model", "logging"),
    ("checkpoint", "loss"),
    ("train", "generators"),
    ("rl",),
    ("bench",),
    ("commands",),
]


def test_rooms_import_only_rooms_below():
    floor = {room: i for i, rooms in enumerate(ROOM_FLOORS) for room in rooms}
    on_disk = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").is_file()
    }
    assert on_disk - {"__init__"} == set(floor), (
        f"place every room on a floor: {sorted((on_disk - {'__init__'}) ^ set(floor))}"
    )
    bad = []
    for module, targets in import_graph().items():
        room = module.split(".")[1] if "." in module else None
        for target in targets:
            other = target.split(".")[1] if "." in target else None
            if room and other and other != room and floor[other] >= floor[room]:
                bad.append(f"{module} ({room}, floor {floor[room]}) imports {target} ({other}, floor {floor[other]})")
    assert not bad, "\n".join(bad)


def test_train_is_a_room_not_a_drawer():
    """train/ keeps the trainer, the step, optimisation, evaluation, forward-only passes, the
    memory probe and the CLI: at most 12 modules (checkpoints and losses have rooms of their own)."""
    modules = sorted(p.name for p in (PACKAGE / "train").glob("*.py"))
    assert len(modules) <= 12, modules


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """backend module -> the backend modules it imports anywhere in its file (``from pkg import
    sub`` points at the submodule when there is one, else at the package)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join([*base, node.module] if node.module else base) if node.level else node.module
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    if sub in modules:
                        out.add(sub)
                    elif source in modules:
                        out.add(source)
        graph[name] = out - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circle_finder_finds_a_deferred_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_backend():
    found = circles(import_graph())
    assert not found, "import circles (deferred imports count):\n" + "\n".join(" <-> ".join(c) for c in found)


#: The attention package's floors: a file imports only files on floors below its own.
ATTENTION_FLOORS = [("layout", "cp"), ("context",), ("masks",), ("sdpa", "flex", "te"), ("registry",), ("core",)]


def test_attention_package_is_cut_by_kernel_one_way():
    graph = import_graph()
    prefix = "backend.model.attention."
    floor = {name: i for i, names in enumerate(ATTENTION_FLOORS) for name in names}
    on_disk = {p.stem for p in (PACKAGE / "model" / "attention").glob("*.py")} - {"__init__"}
    assert on_disk == set(floor), f"place every attention file on a floor: {sorted(on_disk ^ set(floor))}"
    bad = []
    for name, level in floor.items():
        for target in graph[prefix + name]:
            if target == "backend.model.attention":
                bad.append(f"{name} imports the package itself")
            elif target.startswith(prefix) and floor[target[len(prefix) :]] >= level:
                bad.append(f"{name} imports {target[len(prefix) :]} (same floor or above)")
    assert not bad, bad
    # One kernel table, one compiled FlexAttention.
    sources = {p.name: p.read_text(encoding="utf-8") for p in (PACKAGE / "model").rglob("*.py")}
    assert sum("torch.compile(flex_attention" in text for text in sources.values()) == 1
    assert sum(text.count("KERNELS = {") + text.count("KERNELS: dict") for text in sources.values()) == 1


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


#: Collective helpers and where their group goes: a positional index, or None (keyword only).
NAMED_HELPERS = {
    "dist_sum": 1,
    "dist_max_tensor": 1,
    "all_gather_tensors": 1,
    "all_to_all_counts": 1,
    "check_plan_agreement": 1,
    "dist_max": None,
    "dist_any": None,
    "all_gather_objects": None,
    "check_same_arguments": None,
    "all_to_all_rows": None,
}
#: torch.distributed's collectives (called as dist.X / torch.distributed.X): a group= keyword.
TORCH_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
}


def test_every_collective_call_names_its_group():
    """Every collective in the library and the tools says which ranks it reduces over
    (ParallelDims' groups): a default group would count a token once per tensor-parallel rank."""
    bad, checked = [], 0
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "tools").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            keywords = {k.arg for k in node.keywords}
            owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
            if name in NAMED_HELPERS:
                index = NAMED_HELPERS[name]
                ok = "group" in keywords or (index is not None and len(node.args) > index)
            elif name in TORCH_COLLECTIVES and owner in ("dist", "torch.distributed"):
                ok = "group" in keywords
            else:
                continue
            checked += 1
            if not ok:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:100]}")
    assert checked > 40  # the scan sees the library's collectives
    assert not bad, "collectives without a group:\n" + "\n".join(bad)


#: The tools' paths that launch scripts and users call with their current arguments.
KEPT_TOOL_PATHS = (
    "compute_logprobs.py",
    "export_hf.py",
    "generate.py",
    "probe_memory.py",
    "compare_arms.py",
    "show_data.py",
    "plot_metrics.py",
    "bench_train.py",
    "preprocess_data.py",
    "simulate_batching.py",
    "verify_checkpoint.py",
    "setup_env.sh",
    "slurm/train.sbatch",
)


def test_tools_are_grouped_by_kind():
    """At most 12 files directly in tools/ (the user commands, generate.py the newest, the set-up,
    bench_train), the rest in bench/, plot/, env/, slurm/ and docs/; no script patches sys.path (the
    package is installed)."""
    tools = REPO / "tools"
    top = sorted(p.name for p in tools.iterdir() if p.is_file())
    assert len(top) <= 12, top
    folders = {p.name for p in tools.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert folders <= {"bench", "plot", "env", "slurm", "docs"}, folders
    for kept in KEPT_TOOL_PATHS:
        assert (tools / kept).is_file(), kept
    patched = [str(p.relative_to(REPO)) for p in tools.rglob("*.py") if "sys.path" in p.read_text(encoding="utf-8")]
    assert not patched, patched


def test_user_commands_are_console_scripts():
    """Every user command of tools/ is also an installed console script naming the same main."""
    import importlib
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    for name in (
        "compute_logprobs",
        "export_hf",
        "generate",
        "probe_memory",
        "compare_arms",
        "show_data",
        "plot_metrics",
        "verify_checkpoint",
    ):
        target = scripts[f"backend-{name.replace('_', '-')}"]
        assert target == f"backend.commands.{name}:main"
        assert f"from backend.commands.{name} import main" in (REPO / "tools" / f"{name}.py").read_text()
    for target in scripts.values():
        module, func = target.split(":")
        assert callable(getattr(importlib.import_module(module), func)), target
