"""Comparing two FP32 sums by the scale of what they sum, not by their value.

An objective such as the policy loss is a near-cancelling sum: -0.0094 made of per-token terms of
order 0.5. Two FP32 evaluations of it (another plan, another CPU's kernels) differ by rounding of
the *terms*, about 1e-7 of their absolute sum, so a tolerance relative to the cancelled result is
relative to noise: 1e-6 of 0.0094 failed on one x86 CPU and passed on another. A float64
reference bounds the error by ``rel x sum |term|`` (mean absolute term x token count, scaled
like the sum); that is the bound used here.
"""

from __future__ import annotations


def close_by_scale(got: float, want: float, scale: float, *, rel: float = 1e-6) -> bool:
    """|got - want| <= rel x scale, ``scale`` the sum of the absolute terms (same normalisation)."""
    return abs(got - want) <= rel * abs(scale)


def assert_close_by_scale(got: float, want: float, scale: float, *, rel: float = 1e-6, what="") -> None:
    assert close_by_scale(got, want, scale, rel=rel), (
        f"{what}: {got!r} vs {want!r}: |diff| {abs(got - want):.3g} > {rel:g} x {abs(scale):.4g} "
        f"(the sum of the absolute terms)"
    )
