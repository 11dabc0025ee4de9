"""RoPE inverse frequencies, computed exactly as transformers does (so imported models match).

A checkpoint trained with scaled RoPE (Llama 3.1's ``llama3``, YaRN) must see the same angles
after import, or its logits drift at every position: for Llama 3.1 (factor 8, wavelengths above
8192 tokens) the low-frequency half of the head dimensions rotates 8x slower than plain RoPE.
These functions repeat transformers' arithmetic step for step in FP32, so the tensors are bitwise
equal to ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` (tested), without importing it.

``inv_freq`` returns ``(inv_freq [head_dim // 2] fp32, attention_factor)``; the attention factor
multiplies cos and sin (YaRN's mscale, e.g. 0.1 * ln(4) + 1 = 1.1386 for factor 4; 1.0 otherwise).
"""

from __future__ import annotations

import math

import torch

from backend.config.hf import SUPPORTED_ROPE_TYPES


def _default(head_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    return 1.0 / (base**exponents)


def _llama3(head_dim: int, base: float, s: dict) -> torch.Tensor:
    inv_freq = _default(head_dim, base)
    factor = s["factor"]
    low_freq_factor = s["low_freq_factor"]
    high_freq_factor = s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, base: float, s: dict, max_position_embeddings: int | None) -> tuple[torch.Tensor, float]:
    factor = s.get("factor")
    original = s["original_max_position_embeddings"]
    if factor is None:  # DeepSeek-style: the context extension ratio is the factor
        if not max_position_embeddings:
            raise ValueError("yarn rope_scaling without 'factor' needs max_position_embeddings")
        factor = max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1
    truncate = s.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (head_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp.to(dtype=torch.float)
    inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv, float(attention_factor)


def inv_freq(
    head_dim: int, base: float, scaling: dict | None = None, *, max_position_embeddings: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] fp32 on the CPU, attention factor for cos and sin).

    ``scaling`` is a HF ``rope_scaling`` / ``rope_parameters`` dict (``rope_type`` or the older
    ``type`` key) or None for plain RoPE. ``max_position_embeddings`` is only read by YaRN
    without a ``factor``.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    base = float(base)
    rope_type = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return _default(head_dim, base), 1.0
    if rope_type == "linear":
        return _default(head_dim, base) / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(head_dim, base, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, base, scaling, max_position_embeddings)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def cos_sin(
    positions: torch.Tensor, inv: torch.Tensor, attention_factor: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, head_dim] in the rotate-half layout, scaled by the attention factor.

    Angles are formed in FP32 (positions up to 2**24 are exact) and cast to ``dtype`` last, as
    transformers does.
    """
    angles = positions.to(torch.float32)[..., None] * inv.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype)
