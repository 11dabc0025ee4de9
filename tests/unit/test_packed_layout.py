"""The packed layout's pure pieces on CPU: collate (positions, labels, segment facts, the CP cut)
and the index arithmetic of the per-sequence SDPA and Transformer Engine paths, checked against
the masks the SDPA paths use."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.batching import Microbatch, round_up, segment_lengths
from backend.data.collate import collate, cp_shard, cp_unshard, packed_cp_index, packed_cp_unshard
from backend.data.sample import Sample
from backend.model.attention.layout import (
    cumulative,
    gathered_to_global,
    packed_real_key_index,
    te_global_order_index,
    te_padded_cp_chunks,
)


def packed_batch(lengths, cp_size, cp_rank, extra=0):
    rng = np.random.default_rng(0)
    samples = [Sample(tokens=rng.integers(1, 256, size=n)) for n in lengths]
    seg = 2 * cp_size if cp_size > 1 else 1
    row = sum(round_up(n, seg) for n in lengths) + extra
    mb = Microbatch(tuple(range(len(lengths))), row, row // cp_size, sum(lengths), packed=True)
    return samples, collate(samples, list(range(len(lengths))), mb, cp_rank=cp_rank, cp_size=cp_size)


def test_collate_packed_positions_labels_and_segments():
    lengths = [3, 1, 4]
    samples, b = packed_batch(lengths, 1, 0, extra=2)
    assert b.tokens.shape == (1, 10) and b.is_packed
    assert b.position_ids[0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3, 4, 5]
    assert b.segment_ids[0].tolist() == [0, 0, 0, 1, 2, 2, 2, 2, 2, 2]
    assert b.cu_seqlens.tolist() == [0, 3, 4, 8] and b.cu_seqlens_padded.tolist() == [0, 3, 4, 10]
    assert b.valid[0].tolist() == [True] * 8 + [False] * 2
    # Labels never cross a sequence boundary: each sequence's last token predicts nothing.
    assert b.loss_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 1, 0, 0, 0]
    assert b.labels[0, :2].tolist() == samples[0].tokens[1:].tolist()


@pytest.mark.parametrize("cp", [2, 3])
def test_packed_cp_cut_is_per_sequence_and_inverts(cp):
    lengths = [5, 13, 1, 8]
    _, full = packed_batch(lengths, cp, 0, extra=0)  # only the metadata is used below
    segments = segment_lengths(lengths, cp, full.padded_len)
    parts = [packed_batch(lengths, cp, r)[1] for r in range(cp)]
    for p in parts:
        assert p.tokens.shape[1] == full.padded_len // cp
    row = packed_cp_unshard([p.tokens for p in parts], segments)
    offsets = cumulative(segments)
    rng = np.random.default_rng(0)
    for i, n in enumerate(lengths):
        expected = rng.integers(1, 256, size=n)
        assert row[0, offsets[i] : offsets[i] + n].tolist() == expected.tolist()
    # Rank r's first tokens: chunk r of sequence 0, i.e. positions [r*C, (r+1)*C).
    chunk = segments[0] // (2 * cp)
    for r, p in enumerate(parts):
        assert p.position_ids[0, :chunk].tolist() == list(range(r * chunk, (r + 1) * chunk))
    assert (
        gathered_to_global(segments, cp)
        == np.concatenate([packed_cp_index(segments, r, cp) for r in range(cp)]).tolist()
    )


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_real_key_index_selects_every_sequence_in_position_order(cp):
    lengths = [7, 2, 16, 9]
    seg = 2 * cp if cp > 1 else 1
    segments = [round_up(n, seg) for n in lengths]
    global_row = torch.arange(sum(segments))
    gathered = torch.cat([global_row[torch.from_numpy(packed_cp_index(segments, r, cp))] for r in range(cp)])
    picked = gathered[torch.tensor(packed_real_key_index(lengths, segments, cp))]
    offsets = cumulative(segments)
    expected = torch.cat([torch.arange(o, o + n) for o, n in zip(offsets, lengths)])
    assert torch.equal(picked, expected)


@pytest.mark.parametrize("window", [0, 1, 3])
@pytest.mark.parametrize("cp", [2, 3])
def test_te_padded_cp_calls_reproduce_the_padded_mask(cp, window):
    """Two bottom-right calls per rank give every real query exactly the keys the dense padded mask
    allows (causal on global positions, padded keys never), also with a sliding window: TE's
    bottom-right ``window_size=(W - 1, 0)`` keeps the W keys up to the query's own."""
    padded_len = 2 * cp * 5
    seq_lengths = [1, 4, 5, 6, 17, padded_len]
    order = te_global_order_index(padded_len, cp)
    parts = [cp_shard(torch.arange(padded_len)[None], r, cp) for r in range(cp)]
    assert cp_unshard(parts)[0].tolist() == list(range(padded_len))
    rank_major = torch.cat([cp_shard(torch.arange(padded_len)[None], r, cp)[0] for r in range(cp)])
    assert rank_major[torch.tensor(order)].tolist() == list(range(padded_len))
    for r in range(cp):
        local_pos = cp_shard(torch.arange(padded_len)[None], r, cp)[0]
        for call in te_padded_cp_chunks(seq_lengths, padded_len, cp, r):
            a, e = call["local_slice"]
            qpos = local_pos[a:e]
            for b, n in enumerate(seq_lengths):
                q_len, kv_len = call["q_lens"][b], call["kv_lens"][b]
                assert kv_len >= q_len >= 1 and kv_len <= call["kv_end"]
                for t, p in enumerate(qpos.tolist()):
                    if p >= n:  # a padding query: its output is never read
                        continue
                    assert t < q_len
                    diag = t + (kv_len - q_len)  # bottom-right causal: the query's own key
                    te_keys = [u for u in range(kv_len) if u <= diag and (not window or u > diag - window)]
                    dense = [k for k in range(padded_len) if k <= p and k < n and (not window or k > p - window)]
                    assert te_keys == dense


def test_te_attention_arguments_for_sinks_and_windows():
    """What the te kernel asks Transformer Engine for (the calls themselves are GPU tests)."""
    from backend.model.attention.te import te_attention_kwargs, te_cp_comm_type

    new_te = {"softmax_type", "window_size"}
    plain = te_attention_kwargs(2, 0.125, window=0, sinks=False, accepted=set())
    assert "window_size" not in plain and "softmax_type" not in plain and plain["num_gqa_groups"] == 2
    oss = te_attention_kwargs(2, 0.125, window=128, sinks=True, accepted=new_te)
    assert oss["window_size"] == (127, 0) and oss["softmax_type"] == "learnable"
    with pytest.raises(RuntimeError, match="Transformer Engine >= 2.8"):
        te_attention_kwargs(2, 0.125, window=0, sinks=True, accepted={"window_size"})
    assert te_cp_comm_type(window=0, sinks=False, num_heads=6, num_kv=3, cp_size=4) == "p2p"
    assert te_cp_comm_type(window=128, sinks=True, num_heads=64, num_kv=8, cp_size=2) == "a2a"
    with pytest.raises(RuntimeError, match="divisible by parallel.context_parallel_size=4"):
        te_cp_comm_type(window=128, sinks=False, num_heads=6, num_kv=3, cp_size=4)


class _ReadsOffset(torch.nn.Module):
    """Like TE's DotProductAttention(softmax_type="learnable"): registers ``softmax_offset`` (left
    uninitialised: NaN here) and reads ``self.softmax_offset`` in forward."""

    def __init__(self):
        super().__init__()
        self.register_parameter("softmax_offset", torch.nn.Parameter(torch.full((3,), float("nan"))))

    def forward(self, x):
        return x * self.softmax_offset.reshape(1, -1)


def test_te_lend_sinks_reads_the_current_tensor_and_keeps_one_parameter():
    """After lending, the module reads the tensor lent last (the gradient reaches it) and no longer
    owns a parameter of that name (the checkpoint holds the sinks once)."""
    from backend.model.attention.te import te_lend_sinks

    module = _ReadsOffset()
    first = torch.nn.Parameter(torch.ones(3))
    te_lend_sinks(module, first)
    assert "softmax_offset" not in dict(module.named_parameters()) and "softmax_offset" not in module.state_dict()
    second = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    te_lend_sinks(module, second)  # FSDP2 swapped the parameter: the module must read the new one
    module(torch.ones(2, 3)).sum().backward()
    assert first.grad is None and second.grad.tolist() == [2.0, 2.0, 2.0]


def test_te_sinks_under_fsdp2_are_one_parameter_of_the_core_attention(tmp_path):
    """The TE kernel's wiring in a real FSDP2 model (one-process gloo world): TE's own offset is
    dropped when the module is built, so FSDP2, the optimizer and the checkpoint see only the core
    attention's ``softmax_offset``; each call lends the unsharded sinks and the gradient reaches
    the sharded parameter."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from backend.model.attention.te import te_lend_sinks

    class Core(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.softmax_offset = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
            self.te = _ReadsOffset()
            te_lend_sinks(self.te, None)  # what te_kernel_factory does at build

        def forward(self, x):
            te_lend_sinks(self.te, self.softmax_offset)
            try:
                return self.te(x)
            finally:
                te_lend_sinks(self.te, None)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        core = fully_shard(Core())
        assert [n for n, _ in core.named_parameters()] == ["softmax_offset"]
        assert list(core.state_dict()) == ["softmax_offset"]
        out = core(torch.ones(2, 3))
        assert out.tolist() == [[1.0, 2.0, 3.0]] * 2
        out.sum().backward()
        assert core.softmax_offset.grad.full_tensor().tolist() == [2.0, 2.0, 2.0]
        assert core.te.__dict__["softmax_offset"] is None  # no reference kept between calls
    finally:
        dist.destroy_process_group()


def test_te_cp_sinks_scale_the_gradient_not_the_value():
    """TE's a2a CP exchange leaves every CP rank with the whole sinks gradient; the data-parallel
    sum over CP ranks must then see 1/cp of it on each (cp 4: 0.25 per element here)."""
    from backend.model.attention.te import te_cp_sinks

    sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0]))
    assert te_cp_sinks(sinks, 1) is sinks
    lent = te_cp_sinks(sinks, 4)
    assert torch.equal(lent, sinks.detach())
    lent.sum().backward()
    assert sinks.grad.tolist() == [0.25, 0.25]


def test_te_packed_refusal_names_the_version_dtype_and_the_way_out():
    """TE versions and dtypes that cannot run sinks/windows on packed rows are refused with the
    keys to change; the ones that can pass."""
    from backend.model.attention.te import te_packed_refusal

    bf16 = torch.bfloat16
    assert te_packed_refusal("2.12.0", window=128, sinks=True, cp_size=2, dtype=bf16) is None
    assert te_packed_refusal("2.10.0", window=128, sinks=False, cp_size=2, dtype=bf16) is None
    assert te_packed_refusal("2.8.0", window=128, sinks=False, cp_size=1, dtype=bf16) is None
    old = te_packed_refusal("2.11.0+cu12", window=0, sinks=True, cp_size=1, dtype=bf16)
    assert "2.12" in old and "2.11.0+cu12" in old and "train.dynamic_batch_layout=padded" in old
    fp32 = te_packed_refusal("2.14.0", window=0, sinks=True, cp_size=1, dtype=torch.float32)
    assert "BF16/FP16" in fp32 and "model.attention_backend=flex" in fp32
    assert "2.10" in te_packed_refusal("2.9.0", window=128, sinks=False, cp_size=2, dtype=bf16)
