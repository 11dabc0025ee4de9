"""Which per-token policy fields (``advantages``, ``old_logprobs``, ``ref_logprobs``,
``rollout_logprobs``) a run reads
from its rows, and the checks every value passes before it can reach a loss.

Up to 2026-12 unknown row fields were silently ignored, so an RL row with advantages trained as
plain cross-entropy. Now a cross-entropy run refuses them (naming the field and ``loss.type``), a
policy run requires the ones its ``loss.*`` settings need, and any other field is counted and
listed once at start-up as ignored.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from .errors import DataFormatError
from .sample import POLICY_FIELDS

# Row keys every run understands (the token source and the loss mask / weight).
# weight_version: the policy version an asynchronous loop's rollout was sampled with (metadata,
# read by nothing; backend/rl/async_loop.py).
BASE_KEYS = ("text", "input_ids", "messages", "loss_mask", "loss_weight", "weight_version")


@dataclass(frozen=True)
class RowFields:
    """What a reader does with the policy fields of a row."""

    read: tuple[str, ...] = ()  # loaded into Sample
    required: tuple[str, ...] = ()  # a row without one stops the load
    refuse: tuple[str, ...] = POLICY_FIELDS  # a row with one stops the load (it would be ignored)
    why: str = "loss.type=cross_entropy"  # the setting that decided it, for messages


# Tools that carry whatever fields rows have (tools/preprocess_data.py, tools/compute_logprobs.py).
PASS_THROUGH = RowFields(read=POLICY_FIELDS, refuse=(), why="")


def row_fields(loss_cfg, *, lora: bool = False) -> RowFields:
    """The fields a training run with ``loss_cfg`` (the ``loss`` config section) needs. ``lora``
    (``model.lora.rank`` > 0): the KL penalty's reference is the base, computed, not read."""
    if loss_cfg is None or loss_cfg.type == "cross_entropy":
        return RowFields()
    if loss_cfg.type == "value":
        needed = ["returns"] + (["old_values"] if loss_cfg.value_clip else [])
        why = "loss.type=value" + (", loss.value_clip>0" if loss_cfg.value_clip else "")
        return RowFields(read=tuple(needed), required=tuple(needed), refuse=(), why=why)
    needed = ["advantages"]
    why = ["loss.type=policy"]
    if loss_cfg.old_logprobs == "data":
        needed.append("old_logprobs")
        why.append("loss.old_logprobs=data")
    if loss_cfg.kl_coef > 0 and not loss_cfg.reference_checkpoint and not lora:
        needed.append("ref_logprobs")
        why.append("loss.kl_coef>0 without loss.reference_checkpoint")
    if loss_cfg.old_logprobs == "rollout":
        needed.append("rollout_logprobs")
        why.append("loss.old_logprobs=rollout")
    elif getattr(loss_cfg, "rollout_correction", "none") != "none":
        needed.append("rollout_logprobs")
        why.append(f"loss.rollout_correction={loss_cfg.rollout_correction}")
    # The sampler's log-probabilities are read whenever rows carry them: the mismatch metrics.
    read = tuple(dict.fromkeys([*needed, "rollout_logprobs"]))
    return RowFields(read=read, required=tuple(needed), refuse=(), why=", ".join(why))


VALUE_FIELDS = ("returns", "old_values")


def refusal(name: str, fields: RowFields) -> str:
    kind, loss = ("a value-loss", "value") if name in VALUE_FIELDS else ("a policy-gradient", "policy")
    return (
        f"'{name}' is {kind} field, but {fields.why} would ignore it: set loss.type={loss} "
        f"(docs/guides/policy-loss.md) or remove the field"
    )


def check_row_keys(row: dict, fields: RowFields, where: str, json_key: str, ignored: Counter | None) -> None:
    """Refused fields stop the load; required ones must be there; the rest are counted in ``ignored``."""
    for name in fields.refuse:
        if name in row:
            raise DataFormatError(f"{where}: {refusal(name, fields)}")
    for name in fields.required:
        if name not in row:
            raise DataFormatError(
                f"{where}: no '{name}' field, which {fields.why} needs (keys: {', '.join(row) or 'none'})"
            )
    if ignored is not None:
        known = {*BASE_KEYS, json_key, *fields.read}
        ignored.update(k for k in row if k not in known)


def check_finite_where_used(name: str, values: np.ndarray, mask: np.ndarray | None, where: str) -> None:
    """Values at loss tokens (t >= 1 with loss_mask 1) must be finite; the others are never read."""
    used = np.ones(len(values), dtype=bool) if mask is None else mask.astype(bool).copy()
    used[:1] = False
    bad = np.flatnonzero(used & ~np.isfinite(values))
    if len(bad):
        t = int(bad[0])
        raise DataFormatError(
            f"{where}: '{name}' is {values[t]} at token {t}, a loss token (loss_mask 1): values must be finite where "
            f"the loss counts ({len(bad)} such token(s))"
        )


def _as_float(v) -> float:
    try:
        return float(v)
    except OverflowError:  # an integer beyond any float
        return math.inf


def parse_field(name: str, value, n: int, mask: np.ndarray | None, where: str) -> np.ndarray:
    """A row's ``name`` as float32[n]: a list of n numbers (null where unused), or, for
    ``advantages``, one number for the whole sample."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if name == "advantages" and is_number:
        with np.errstate(over="ignore"):
            out = np.full(n, _as_float(value), dtype=np.float64).astype(np.float32)
    elif isinstance(value, list):
        if len(value) != n:
            raise DataFormatError(
                f"{where}: '{name}' has {len(value)} entries for {n} tokens (one per token like loss_mask; entry 0 "
                f"is never used)"
            )
        if not all(v is None or (isinstance(v, int | float) and not isinstance(v, bool)) for v in value):
            raise DataFormatError(f"{where}: '{name}' must be a list of numbers (null where the loss mask is 0)")
        with np.errstate(over="ignore"):  # beyond float32: inf, refused below where it is used
            out = np.asarray([np.nan if v is None else _as_float(v) for v in value], np.float64).astype(np.float32)
    else:
        kind = "a number or a list of numbers" if name == "advantages" else "a list of numbers"
        raise DataFormatError(f"{where}: '{name}' must be {kind}, one per token")
    check_finite_where_used(name, out, mask, where)
    return out


def format_ignored(ignored: dict[str, int]) -> str:
    """``id (120 rows), source (120 rows)``: the start-up summary's list of fields nothing reads."""
    return ", ".join(f"{k} ({v} row{'s' if v != 1 else ''})" for k, v in sorted(ignored.items()))


def with_logprobs(row: dict, logprobs, field: str) -> dict:
    """``row`` with ``field`` (old_logprobs / ref_logprobs / rollout_logprobs) set from a forward pass's n-1 values
    (log p of tokens 1..n-1): aligned like loss_mask, entry 0 null (token 0 is never a target)."""
    if field not in POLICY_FIELDS or field == "advantages":
        raise ValueError(f"--merge-as {field}: expected old_logprobs, ref_logprobs or rollout_logprobs")
    return {**row, field: [None, *(float(x) for x in logprobs)]}
