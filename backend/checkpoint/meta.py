"""A checkpoint's ``meta.json``, read as untrusted input and validated field by field.

The file says which step a checkpoint is, how the scheduler and the data stream stood, and the
run's config. Each value is used for arithmetic or file names (``metrics.jsonl`` is rewound to
``step``; the scheduler's ``last_epoch`` feeds the learning rate), so a crafted value must be
refused at the door, not fail later: a ``step`` of -1 would drop every metrics row, ``"../x"`` is
no step, a ``last_epoch`` of 10**400 overflows the learning-rate arithmetic, and a 200,000-deep
document exhausts the parser's recursion. Any such file is a ``CheckpointError`` naming it, so
resume falls back to the previous checkpoint.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from backend.errors import CheckpointError

from .files import MAX_META_JSON_BYTES, read_regular

META = "meta.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")

#: The largest count (steps, samples, ranks) a meta.json may hold.
MAX_COUNT = 10**15

#: The data stream's state (``DataIterator.state_dict``): each key's type.
_SAMPLER = {"consumed": int, "seed": int, "num_samples": int, "global_batch_size": int, "shuffle": bool}


class CheckpointMetaError(CheckpointError):
    """A meta.json that is not one this backend writes."""


def _count(value: Any, lowest: int = 0) -> bool:
    return type(value) is int and lowest <= value <= MAX_COUNT


def _type_name(value: Any) -> str:
    return type(value).__name__


def read_meta(path: str | Path) -> dict:
    """A checkpoint's validated meta.json (``path`` is the step directory)."""
    file = Path(path) / META
    try:
        meta = json.loads(read_regular(file, MAX_META_JSON_BYTES).decode("utf-8"))
    except CheckpointError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, MemoryError) as e:
        raise CheckpointMetaError(f"{file}: unreadable checkpoint metadata ({type(e).__name__})") from None
    validate_meta(meta, file)
    return meta


def _valid_digests(d: Any) -> bool:
    files = d.get("files") if isinstance(d, dict) else None
    return (
        d.get("algorithm") == "xxh3_128"
        and isinstance(files, dict)
        and len(files) <= 100_000
        and all(
            isinstance(k, str)
            and 0 < len(k) <= 255
            and "/" not in k
            and isinstance(v, str)
            and re.fullmatch(r"[0-9a-f]{32}", v)
            for k, v in files.items()
        )
    )


def validate_meta(meta: Any, file: Path) -> None:
    def bad(what: str) -> CheckpointMetaError:
        return CheckpointMetaError(f"{file}: checkpoint metadata {what}")

    if not isinstance(meta, dict):
        raise bad(f"is a {_type_name(meta)}, not an object")
    missing = [k for k in ("step", "scheduler", "dp_size", "cp_size", "data") if k not in meta]
    if missing:
        raise bad(f"lacks {', '.join(missing)}")
    unknown = sorted(
        set(meta)
        - {"step", "scheduler", "world_size", "dp_size", "cp_size", "parallel", "data", "wandb_run_id", "config"}
        - {"caller_state", "nonfinite_steps", "digests", "lora_base"}
    )
    if unknown:
        raise bad(f"holds {len(unknown)} unknown key(s) (e.g. {unknown[0][:40]!r})")
    if not _count(meta["step"]):
        raise bad(f"has step of type {_type_name(meta['step'])} outside 0..{MAX_COUNT:,}")
    match = STEP_DIR.match(file.parent.name)
    if match and int(match.group(1)) != meta["step"]:
        raise bad(f"says step {meta['step']}, but its directory is {file.parent.name}")
    for key in ("dp_size", "cp_size", "world_size"):
        if key in meta and not _count(meta[key], 1):
            raise bad(f"has {key} of type {_type_name(meta[key])} outside 1..{MAX_COUNT:,}")
    if "digests" in meta and not _valid_digests(meta["digests"]):
        raise bad("has digests that are not {algorithm: xxh3_128, files: {name: hex digest}}")
    base = meta.get("lora_base")  # a LoRA checkpoint's base: {"source", "digest"} (lora_base.py)
    if base is not None and not (
        isinstance(base, dict)
        and set(base) == {"source", "digest"}
        and all(isinstance(v, str) and len(v) <= 4096 for v in base.values())
    ):
        raise bad("has a lora_base that is not {source, digest} strings")
    if "nonfinite_steps" in meta and not _count(meta["nonfinite_steps"]):
        raise bad("has nonfinite_steps that is not a count")
    parallel = meta.get("parallel")  # every dimension's size (written since ParallelDims; absent before)
    if parallel is not None and not (
        isinstance(parallel, dict)
        and len(parallel) <= 16
        and all(isinstance(k, str) and len(k) <= 32 and _count(v, 1) for k, v in parallel.items())
    ):
        raise bad("has a parallel entry that is not an object of sizes (1..)")
    if not isinstance(meta["scheduler"], dict):
        raise bad("has a scheduler state that is not an object")
    if meta["data"] is not None:  # null: written by a worker fed from memory (no data.path stream)
        _check_sampler(meta["data"], bad, "data")
    # A worker's caller's own state (the RL loop's prompt stream), handed back as it was saved:
    # any JSON object; the caller checks its fields (``check_sampler_state``).
    if meta.get("caller_state") is not None and not isinstance(meta["caller_state"], dict):
        raise bad("has a caller_state that is not an object")
    if _depth(meta.get("caller_state")) > 8:
        raise bad("has a caller_state nested deeper than 8 levels")
    if meta.get("wandb_run_id") is not None and not (
        isinstance(meta["wandb_run_id"], str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", meta["wandb_run_id"])
    ):
        raise bad("has a wandb_run_id that is not a run id (letters, digits, '-' and '_')")
    if "config" in meta and not isinstance(meta["config"], dict):
        raise bad("has a config that is not an object")
    if _depth(meta.get("config")) > 8:  # our config nests 3 deep (loss.*, model.rope_scaling.*)
        raise bad("has a config nested deeper than 8 levels")


def check_sampler_state(data: Any, file: str | Path, where: str) -> dict:
    """``data`` as a window sampler's state (``{'sampler': {...}}``), or a ``CheckpointMetaError``
    naming ``file`` and ``where``; returns the inner sampler state."""
    _check_sampler(data, lambda what: CheckpointMetaError(f"{file}: checkpoint metadata {what}"), where)
    return data["sampler"]


def _check_sampler(data: Any, bad, where: str) -> None:
    """A window sampler's state (``{'sampler': {consumed, seed, ...}}``), each value in range."""
    sampler = data.get("sampler") if isinstance(data, dict) and set(data) == {"sampler"} else None
    if not isinstance(sampler, dict) or set(sampler) - {"blend"} != set(_SAMPLER):
        raise bad(f"has a {where} state that is not {{'sampler': {{{', '.join(_SAMPLER)}}}}}")
    if "blend" in sampler:  # data.blend's sampler: its sources' sizes and normalised weights
        blend = sampler["blend"]
        sizes, weights = (blend.get("sizes"), blend.get("weights")) if isinstance(blend, dict) else (None, None)
        if (
            set(blend or {}) != {"sizes", "weights"}
            or not isinstance(sizes, list)
            or not isinstance(weights, list)
            or len(sizes) != len(weights)
            or not all(type(n) is int and 0 < n <= MAX_COUNT for n in sizes)
            or not all(type(w) is float and 0 < w <= 1 for w in weights)
        ):
            raise bad(f"has a {where}.sampler.blend that is not {{sizes: [counts], weights: [fractions]}}")
    for key, kind in _SAMPLER.items():
        value = sampler[key]
        if type(value) is not kind or (kind is int and not -MAX_COUNT <= value <= MAX_COUNT):
            raise bad(f"has {where}.sampler.{key} of type {_type_name(value)} (expected {kind.__name__} in range)")
    if sampler["consumed"] < 0:
        raise bad(f"has a negative {where}.sampler.consumed")


def _depth(value: Any) -> int:
    """How deeply a JSON value nests (iteratively: the value may nest thousands deep)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _same_shape(saved: Any, current: Any) -> bool:
    """A saved scheduler value of the current value's kind: a finite number, a bool, None, or a
    list of the same length whose items match (the param groups' learning rates, lambdas)."""
    if isinstance(current, bool) or current is None:
        return type(saved) is type(current)
    if isinstance(current, int):
        return type(saved) is int and abs(saved) <= MAX_COUNT
    if isinstance(current, float):
        return type(saved) in (int, float) and math.isfinite(saved) and abs(saved) <= 1e30
    if isinstance(current, list):
        return isinstance(saved, list) and len(saved) == len(current) and all(map(_same_shape, saved, current))
    if isinstance(current, dict):
        return (
            isinstance(saved, dict)
            and set(saved) <= set(current)
            and all(_same_shape(saved[k], current[k]) for k in saved)
        )
    return False


def restore_scheduler(scheduler, saved: dict, file: Path) -> None:
    """``scheduler.load_state_dict`` from the keys the scheduler itself has, each checked against
    the kind of its current value (no other key is copied onto the scheduler)."""
    current = scheduler.state_dict()
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise CheckpointMetaError(f"{file}: the scheduler state holds unknown key(s) (e.g. {unknown[0][:40]!r})")
    for key, value in saved.items():
        if not _same_shape(value, current[key]):
            raise CheckpointMetaError(
                f"{file}: the scheduler state's {key} is a {_type_name(value)} unlike this scheduler's (or out of range)"
            )
    if type(saved.get("last_epoch", 0)) is int and saved.get("last_epoch", 0) < -1:
        raise CheckpointMetaError(f"{file}: the scheduler state's last_epoch is below -1")
    scheduler.load_state_dict({**current, **saved})
