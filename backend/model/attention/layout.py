"""Pure index arithmetic of attention layouts: packed rows under the CP cut, Transformer Engine's
padded CP calls, and each layer's sliding window (no torch, tested on CPU against the masks).

A packed microbatch is one row of n sequences back to back; sequence i occupies
[cu_seqlens_padded[i], cu_seqlens_padded[i+1]) of the row (global offsets, before the CP cut),
its first cu_seqlens[i+1] - cu_seqlens[i] tokens real. Under CP size c every sequence is cut into
2c chunks and CP rank r holds chunks r and 2c-1-r of EVERY sequence, so the local row holds
sequence i at [cu_seqlens_padded[i] / c, cu_seqlens_padded[i+1] / c).
"""

from __future__ import annotations

from backend.batching import cp_ranges


def gathered_to_global(segments: list[int], cp_size: int) -> list[int]:
    """For each token of the CP-gathered packed row (CP ranks' local rows concatenated in rank
    order), its offset in the global row."""
    out: list[int] = []
    for rank in range(cp_size):
        for start, end in cp_ranges(segments, cp_size, rank):
            out.extend(range(start, end))
    return out


def packed_real_key_index(seq_lengths: list[int], segments: list[int], cp_size: int) -> list[int]:
    """Indices into the CP-gathered row of every sequence's real tokens, sequence after sequence,
    in position order (sequence i's keys then sit at cu_seqlens[i]:cu_seqlens[i+1])."""
    inverse = [0] * sum(segments)
    for gathered, global_offset in enumerate(gathered_to_global(segments, cp_size)):
        inverse[global_offset] = gathered
    out, offset = [], 0
    for n, seg in zip(seq_lengths, segments):
        out.extend(inverse[offset : offset + n])
        offset += seg
    return out


def te_padded_cp_chunks(seq_lengths: list[int], padded_len: int, cp_size: int, cp_rank: int) -> list[dict]:
    """The two TE calls of a padded microbatch under CP, as plain numbers (tested on CPU).

    Rank r holds query chunks r and 2c-1-r (chunk length C = padded_len / 2c) of every row. The
    call for chunk j takes queries [j*C, (j+1)*C) and the gathered keys [0, (j+1)*C) in global
    order, causal bottom-right: query t of the chunk sees keys up to j*C + t. Per row, q_lens are
    the real queries in the chunk (at least 1: a chunk of padding still runs one query, whose
    output no loss reads) and kv_lens the real keys up to the chunk's end.
    """
    chunk = padded_len // (2 * cp_size)
    out = []
    for half, j in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        q_lens = [max(1, min(chunk, n - j * chunk)) for n in seq_lengths]
        kv_lens = [min(n, (j + 1) * chunk) for n in seq_lengths]
        kv_lens = [max(k, q) for k, q in zip(kv_lens, q_lens)]  # bottom-right needs kv >= q
        out.append(
            {
                "local_slice": (half * chunk, (half + 1) * chunk),
                "chunk_index": j,
                "kv_end": (j + 1) * chunk,
                "q_lens": q_lens,
                "kv_lens": kv_lens,
            }
        )
    return out


def te_global_order_index(padded_len: int, cp_size: int) -> list[int]:
    """Indices into a CP-gathered padded row (rank order) that put its tokens in global order."""
    gathered = gathered_to_global([padded_len], cp_size)
    inverse = [0] * padded_len
    for i, g in enumerate(gathered):
        inverse[g] = i
    return inverse


def cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def layer_window(window_size: tuple[int, int] | None, window_attn_skip_freq, layer_number: int) -> int:
    """Our ``window`` for one layer from megatron-core's ``window_size`` / ``window_attn_skip_freq``.

    ``layer_number`` is 1-based (megatron-core's). ``window_size = (W - 1, 0)`` -> W; None or a
    layer the skip pattern makes full -> 0. Megatron-core's rule: skip_freq N makes every N-th layer
    full (GPT-OSS: N = 2, layers 1, 3, ... sliding, i.e. HF ``layer_types`` starting with
    ``sliding_attention``); a list gives 1 (sliding) / 0 (full) per layer.
    """
    if not window_size:
        return 0
    left, right = window_size
    if right != 0 or left < 0:
        raise ValueError(f"window_size={window_size!r}: only causal windows (W - 1, 0) are supported")
    if window_attn_skip_freq is None:
        sliding = True
    elif isinstance(window_attn_skip_freq, int):
        sliding = layer_number % window_attn_skip_freq != 0
    else:
        sliding = bool(window_attn_skip_freq[layer_number - 1])
    return left + 1 if sliding else 0
