"""The data iterator on real gloo process groups: dp 2 x cp 2 covers an epoch exactly once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.batching import plan_dynamic
from backend.data.collate import cp_unshard
from backend.data.iterator import DataIterator
from backend.data.jsonl import InMemoryDataset
from backend.data.sample import Sample
from backend.data.sampler import WindowSampler

from .harness import run_ranks

pytestmark = pytest.mark.distributed

NUM_SAMPLES, GBS, BUDGET = 48, 16, 96


def make_dataset() -> InMemoryDataset:
    rng = np.random.default_rng(0)
    samples = []
    for i in range(NUM_SAMPLES):
        n = int(rng.integers(1, 90))  # lengths that are often not multiples of 2*cp
        samples.append(Sample(tokens=np.arange(n, dtype=np.int64) % 50 + i))
    return InMemoryDataset(samples, source="synthetic")


def iterate_epoch(rank: int, world: int):
    import functools

    import torch.distributed as dist

    from backend.distributed.plan_check import check_plan_agreement

    cp = 2
    dp_rank, cp_rank = rank // cp, rank % cp
    planner = functools.partial(plan_dynamic, dp_size=world // cp, cp_size=cp, max_tokens_per_gpu=BUDGET)
    it = DataIterator(
        make_dataset(), WindowSampler(NUM_SAMPLES, GBS, seed=5), planner, dp_rank=dp_rank, cp_rank=cp_rank, cp_size=cp
    )
    seen = []
    for step in range(NUM_SAMPLES // GBS):
        data = next(it)
        check_plan_agreement(data.plan, dist.group.WORLD, step=step)
        counts = torch.tensor([len(data.microbatches)])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        assert counts.item() == len(data.microbatches)
        for j, mb in enumerate(data.microbatches):
            seen.append(
                dict(
                    step=step,
                    slot=j,
                    sample_ids=mb.sample_ids.tolist(),
                    tokens=mb.tokens,
                    positions=mb.position_ids,
                    valid=mb.valid,
                    labels=mb.labels,
                    padded_len=mb.padded_len,
                    loss_tokens=data.global_loss_tokens,
                    gpu_tokens=mb.tokens.numel(),
                )
            )
    return dict(dp_rank=dp_rank, cp_rank=cp_rank, seen=seen)


def test_dp2_cp2_epoch_covers_every_sample_once_and_chunks_reassemble(tmp_path):
    results = run_ranks(iterate_epoch, 4, tmp_path)
    dataset = make_dataset()
    by_key = {}
    for res in results:
        for item in res["seen"]:
            by_key.setdefault((res["dp_rank"], item["step"], item["slot"]), {})[res["cp_rank"]] = item
    covered = []
    for parts in by_key.values():
        a, b = parts[0], parts[1]
        assert a["sample_ids"] == b["sample_ids"], "both CP ranks hold the same rows"
        if len(a["sample_ids"]) >= 2:  # the planner's CP price is what each GPU really holds
            assert a["gpu_tokens"] <= BUDGET and b["gpu_tokens"] <= BUDGET
        covered += a["sample_ids"]
        if not a["sample_ids"]:
            assert a["tokens"].shape == (0, 0)
            continue
        tokens = cp_unshard([a["tokens"], b["tokens"]])
        positions = cp_unshard([a["positions"], b["positions"]])
        valid = cp_unshard([a["valid"], b["valid"]])
        assert tokens.shape[1] == a["padded_len"] and a["padded_len"] % 4 == 0
        assert a["tokens"].shape[1] == a["padded_len"] // 2, "each CP rank holds half the row"
        assert torch.equal(positions, torch.arange(a["padded_len"]).expand_as(positions)), "positions stay global"
        for row, sid in enumerate(a["sample_ids"]):
            n = len(dataset[sid].tokens)
            assert torch.equal(tokens[row, :n], torch.from_numpy(dataset[sid].tokens))
            assert not tokens[row, n:].any() and valid[row, :n].all() and not valid[row, n:].any()
        # CP rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2.
        quarter = a["padded_len"] // 4
        assert torch.equal(a["positions"][0, :quarter], torch.arange(quarter))
        assert torch.equal(a["positions"][0, quarter:], torch.arange(3 * quarter, 4 * quarter))
    assert sorted(covered) == list(range(NUM_SAMPLES)), "one epoch = every sample exactly once"


def diverging_plan(rank: int, world: int):
    from backend.distributed.plan_check import PlanMismatchError, check_plan_agreement

    lengths = [10, 20, 30, 40] if rank != 1 else [10, 20, 30, 41]
    plan = plan_dynamic(lengths, dp_size=1, max_tokens_per_gpu=64)
    try:
        check_plan_agreement(plan, torch.distributed.group.WORLD, step=7)
    except PlanMismatchError as e:
        return str(e)
    return None


def test_plan_mismatch_names_the_ranks_instead_of_hanging(tmp_path):
    messages = run_ranks(diverging_plan, 3, tmp_path)
    assert all(m is not None for m in messages)
    assert "at step 7" in messages[0] and "ranks [0, 2]" in messages[0] and "ranks [1]" in messages[0]
