"""GPT-OSS MXFP4 dequantisation equals transformers' own, bit for bit (FP32 and BF16)."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.mxfp4 as mxfp4  # noqa: E402

from backend.model.hf.mxfp4 import (
    dequantize_gpt_oss_expert,
    dequantize_mxfp4,
    hf_expert_layout,
    mxfp4_pair,
)


def _random_pair(experts=3, rows=40, groups=4, seed=0, full_range=False):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), generator=g, dtype=torch.uint8)
    lo, hi = (0, 256) if full_range else (110, 135)  # checkpoints' scales sit around 2**-17 .. 2**8
    scales = torch.randint(lo, hi, (experts, rows, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("full_range", [False, True])
def test_bitwise_equal_to_transformers(dtype, full_range):
    blocks, scales = _random_pair(full_range=full_range)
    ref = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    ours = dequantize_gpt_oss_expert(blocks, scales, dtype)
    assert ours.dtype == ref.dtype == dtype and ours.shape == ref.shape == (3, 4 * 32, 40)
    # Bitwise: compare the raw bits (NaN == NaN and -0.0 != +0.0 included).
    int_type = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(ours.view(int_type), ref.view(int_type))
    # Chunking does not change a bit.
    chunked = hf_expert_layout(dequantize_mxfp4(blocks, scales, dtype, chunk_rows=7))
    assert torch.equal(chunked.view(int_type), ref.view(int_type))


def test_layout_by_hand():
    """Low nibble first, one E8M0 exponent per 32 elements, output-major rows."""
    blocks = torch.zeros(1, 1, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0, 0] = 0x92  # low nibble 2 -> +1.0 (element 0), high nibble 9 -> -0.5 (element 1)
    blocks[0, 0, 1, 15] = 0x7F  # low 15 -> -6.0 (element 62), high 7 -> +6.0 (element 63)
    scales = torch.tensor([[[128, 125]]], dtype=torch.uint8)  # 2**1 for block 0, 2**-2 for block 1
    dense = dequantize_mxfp4(blocks, scales, torch.float32)
    assert dense.shape == (1, 1, 64)
    assert dense[0, 0, :2].tolist() == [2.0, -1.0]
    assert dense[0, 0, 62:].tolist() == [-1.5, 1.5]
    assert int((dense != 0).sum()) == 4


def test_refusals_and_names():
    blocks, scales = _random_pair()
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :-1])
    with pytest.raises(TypeError, match="uint8"):
        dequantize_mxfp4(blocks.to(torch.int32), scales)
    assert mxfp4_pair("model.layers.3.mlp.experts.down_proj_scales") == (
        "model.layers.3.mlp.experts.down_proj_blocks",
        "model.layers.3.mlp.experts.down_proj_scales",
        "model.layers.3.mlp.experts.down_proj",
    )


def test_an_empty_expert_shard_dequantises_to_an_empty_tensor():
    """An FSDP2 rank can hold no experts (32 experts over 24 ranks: shards of 2, the last ones 0)."""
    blocks = torch.zeros(0, 6, 3, 16, dtype=torch.uint8)
    scales = torch.zeros(0, 6, 3, dtype=torch.uint8)
    assert dequantize_mxfp4(blocks, scales, torch.float32).shape == (0, 6, 96)
