"""GPT-OSS MXFP4 expert weights -> dense tensors in the training dtype.

Released GPT-OSS checkpoints store each MoE projection of every layer as two tensors:

- ``<proj>_blocks``: uint8 [E, rows, G, 16]. Every byte packs two FP4 (e2m1) codes, the LOW
  nibble first: byte j of a block holds elements 2j (low 4 bits) and 2j + 1 (high 4 bits), so a
  block of 16 bytes is 32 consecutive elements of one row.
- ``<proj>_scales``: uint8 [E, rows, G]. One E8M0 exponent per 32-element block, biased by 127:
  the block's elements are multiplied by 2 ** (scale - 127).

A code's value is sign * {0, 0.5, 1, 1.5, 2, 3, 4, 6}[code & 7] with the sign in bit 3 (codes
8..15 are the negatives of 0..7; code 8 is -0.0). Row r of the dense matrix is the G blocks of
row r concatenated: ``rows x (G * 32)``.

The dense [E, rows, cols] is the *output-major* layout ([out_features, in_features] per expert,
as ``nn.Linear`` stores it). Transformers' ``GptOssExperts`` and our ``GroupedExperts`` keep the
transpose, [E, in, out] (``gate_up_proj`` [E, hidden, 2I], ``down_proj`` [E, I, hidden]):
``hf_expert_layout`` gives that. GPT-OSS's ``gate_up_proj`` interleaves gate and up along the 2I
axis (gate at even, up at odd indices); ``hf.gpt_oss`` de-interleaves for ``GroupedExperts``.

Values are exact: an FP4 value times a power of two is representable in FP32 and BF16 over the
exponent range checkpoints use. The arithmetic repeats transformers'
``integrations.mxfp4.convert_moe_packed_tensors`` (a table lookup in the target dtype, then
``torch.ldexp``), so the results are bitwise equal to it in FP32 and BF16 (tested), including
its edge cases (scale 255 = 2**128 overflows to inf, and to NaN for zero codes).
"""

from __future__ import annotations

import torch

#: e2m1 code -> value; index = the 4-bit code (bit 3 is the sign).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

#: Elements per scaling block (MX block size) and packed bytes per block.
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
E8M0_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *, chunk_rows: int = 1 << 20
) -> torch.Tensor:
    """Dense ``[..., rows, G * 32]`` in ``dtype`` from ``blocks`` [..., rows, G, 16] and ``scales`` [..., rows, G].

    Output-major ([out, in] per expert for GPT-OSS's checkpoint tensors). Works on any device;
    ``chunk_rows`` bounds the temporary index tensors (in blocks of 32 elements), so a 20B model's
    largest expert tensor (an [32, 5760, 90, 16] ``gate_up_proj_blocks``) needs no more than a few
    hundred MB beyond its output.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_BYTES:
        raise ValueError(
            f"MXFP4 blocks must end in a dimension of {BLOCK_BYTES} bytes, got shape {tuple(blocks.shape)}"
        )
    if tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"MXFP4 scales {tuple(scales.shape)} do not match blocks {tuple(blocks.shape)} (expected blocks[..., :-1])"
        )
    lead = blocks.shape[:-2]
    n_blocks = blocks.numel() // BLOCK_BYTES
    flat_blocks = blocks.reshape(n_blocks, BLOCK_BYTES)
    flat_exp = scales.reshape(n_blocks, 1)
    table = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(n_blocks, BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, n_blocks, chunk_rows):
        stop = min(start + chunk_rows, n_blocks)
        packed = flat_blocks[start:stop]
        dense = out[start:stop].view(stop - start, BLOCK_BYTES, 2)
        dense[..., 0] = table[(packed & 0x0F).long()]  # low nibble: the even element
        dense[..., 1] = table[(packed >> 4).long()]  # high nibble: the odd element
        exponent = flat_exp[start:stop].to(torch.int32) - E8M0_BIAS
        torch.ldexp(out[start:stop], exponent, out=out[start:stop])
    return out.reshape(*lead, blocks.shape[-2] * BLOCK)  # explicit width: an empty shard (0 experts) too


def hf_expert_layout(dense: torch.Tensor) -> torch.Tensor:
    """[E, out, in] -> [E, in, out] (transformers' ``GptOssExperts`` parameter layout), contiguous."""
    return dense.transpose(-1, -2).contiguous()


def dequantize_gpt_oss_expert(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """A GPT-OSS checkpoint's ``*_blocks`` / ``*_scales`` pair -> the dense tensor transformers names
    ``gate_up_proj`` [E, hidden, 2I] or ``down_proj`` [E, I, hidden] (in-major, bitwise as transformers)."""
    return hf_expert_layout(dequantize_mxfp4(blocks, scales, dtype))


def is_mxfp4_name(name: str) -> bool:
    """True for a checkpoint tensor that is half of an MXFP4 pair (``..._blocks`` or ``..._scales``)."""
    return name.endswith("_blocks") or name.endswith("_scales")


def mxfp4_pair(name: str) -> tuple[str, str, str]:
    """``model.layers.0.mlp.experts.gate_up_proj`` -> (its blocks name, its scales name, the dense name)."""
    base = name.removesuffix("_blocks").removesuffix("_scales")
    return f"{base}_blocks", f"{base}_scales", base
