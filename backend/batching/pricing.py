"""How many tokens a microbatch puts on one GPU, and the argument checks every planner shares.

With context parallelism of size c, a sequence is cut into 2c chunks and CP rank i keeps chunks
i and 2c-1-i (load-balanced causal attention). So a sequence must be padded to a multiple of 2c,
and to the user's ``pad_to_multiple``: m = lcm(pad_to_multiple, 2c), or m = pad_to_multiple when
c = 1. A microbatch of n sequences padded to length L then holds n * roundup(L, m) / c tokens on
each GPU: that, not the unpadded token count, is what the budget limits.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence


def pad_multiple(pad_to_multiple: int, cp_size: int, sp_size: int = 1) -> int:
    """The multiple every sequence is padded to: lcm(pad_to_multiple, 2*cp*sp), or
    lcm(pad_to_multiple, sp) at cp 1. ``sp_size``: the sequence-parallel split (the tensor-parallel
    size with sequence parallelism, else 1): each CP rank's local row, L / cp, is cut into sp
    equal parts between the TP regions (torchtitan's ``seq_len_divisor = tp * 2 * cp``)."""
    if cp_size == 1:
        return math.lcm(pad_to_multiple, sp_size)
    return math.lcm(pad_to_multiple, 2 * cp_size * sp_size)


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def microbatch_cost(num_sequences: int, padded_len: int, cp_size: int) -> int:
    """Tokens one GPU holds for a microbatch: n rows of padded_len, each split over cp ranks (the
    planner passes its ``cut``, cp x sp, when sequence parallelism splits the rows further)."""
    return num_sequences * padded_len // cp_size


def attention_area(num_sequences: int, padded_len: int) -> int:
    """Query x key pairs a padded microbatch's attention covers (before the CP cut): rows * L^2."""
    return num_sequences * padded_len * padded_len


def check_positive_int(name: str, value: object) -> int:
    """Reject bools, floats and non-positive values with a ValueError that names the argument."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value}")
    return value


def check_lengths(lengths: Sequence[int]) -> list[int]:
    """Every length an integer >= 1 (numpy integers accepted); the window not empty."""
    out = list(lengths)
    if not out:
        raise ValueError("lengths must not be empty: a window needs at least one sequence")
    if all(type(n) is int for n in out) and min(out) >= 1:
        return out
    for i, n in enumerate(out):
        try:
            value = operator.index(n)
        except TypeError:
            value = None
        if isinstance(n, bool) or value is None or value < 1:
            raise ValueError(f"lengths[{i}] = {n!r}: every sequence length must be an integer >= 1")
        out[i] = value
    return out


def smallest_budget(pad_to_multiple: int, cp_size: int, sp_size: int = 1) -> int:
    """The least max_tokens_per_gpu that holds one sequence: a row padded to the multiple, over cp x sp."""
    return microbatch_cost(1, pad_multiple(pad_to_multiple, cp_size, sp_size), cp_size * sp_size)


def check_budget(max_tokens_per_gpu: object, multiple: int, cp_size: int) -> int:
    """The budget must hold at least the smallest microbatch: one row padded to the multiple."""
    budget = check_positive_int("max_tokens_per_gpu", max_tokens_per_gpu)
    smallest = microbatch_cost(1, multiple, cp_size)
    if budget < smallest:
        raise ValueError(
            f"max_tokens_per_gpu={budget} is below the smallest possible microbatch: one sequence "
            f"padded to {multiple} tokens (lcm of pad_to_multiple and 2*cp_size*sp_size) over cp_size*sp_size={cp_size} "
            f"holds {smallest} tokens per GPU; use max_tokens_per_gpu >= {smallest}"
        )
    return budget
