"""Expert parallelism's pure pieces: the expert-major regrouping of received rows, and the config
checks that name ``parallel.expert_parallel_size``."""

from __future__ import annotations

import pytest
import torch

from backend.config import ConfigError, load_config, validate
from backend.model.expert_parallel import expert_major_order


@pytest.mark.parametrize("seed", range(5))
def test_expert_major_order_matches_a_plain_loop(seed):
    g = torch.Generator().manual_seed(seed)
    ep, el = 1 + seed % 4, 1 + (seed * 7) % 3
    recv = torch.randint(0, 4, (ep, el), generator=g)  # zeros included: a source with no rows for an expert
    rows, start = {}, 0
    for s in range(ep):  # the received buffer: source-major, then its rows for each local expert
        for j in range(el):
            rows[(s, j)] = list(range(start, start + int(recv[s, j])))
            start += int(recv[s, j])
    expected = [i for j in range(el) for s in range(ep) for i in rows[(s, j)]]
    assert expert_major_order(recv).tolist() == expected


MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.attention_backend=sdpa"]


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["parallel.expert_parallel_size=2"], 2, "needs an MoE model"),
        ([*MOE, "parallel.expert_parallel_size=3"], 3, "must divide model.num_moe_experts=4"),
        ([*MOE, "parallel.expert_parallel_size=4"], 2, "must divide the world size 2"),
        ([*MOE, "parallel.expert_parallel_size=0"], 1, "parallel.expert_parallel_size"),
    ],
)
def test_config_errors_name_the_key(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world)
    assert "parallel.expert_parallel_size" in str(err.value) and message in str(err.value)


def test_a_valid_expert_parallel_config():
    cfg = validate(load_config(None, [*MOE, "parallel.expert_parallel_size=2"]), 4)
    assert cfg.parallel.expert_parallel_size == 2


def test_ep_imbalance_counts_each_rank_s_received_rows():
    """Two EP groups of 2 ranks with opposite hot ranks: pooled over the world they would look
    balanced (1.0), but rank 0 and rank 3 each receive 3/4 of their group's rows."""
    from backend.model.moe_stats import ep_imbalance

    every = torch.zeros(4, 1, 4)  # [world, layers, E]; EP rank 0 holds experts 0-1, EP rank 1 experts 2-3
    every[0, 0] = every[1, 0] = torch.tensor([3.0, 0.0, 1.0, 0.0])  # group 0: rank 0 gets 6, rank 1 gets 2
    every[2, 0] = every[3, 0] = torch.tensor([0.0, 1.0, 0.0, 3.0])  # group 1: rank 2 gets 2, rank 3 gets 6
    assert ep_imbalance(every, 2) == pytest.approx(6 / 4)
    assert ep_imbalance(torch.ones(4, 2, 4), 2) == pytest.approx(1.0)


def test_the_probe_routing_keeps_the_router_gradient():
    """Every token to the first k experts, with the router's own top-k probabilities (so the backward
    saves what a real step's does)."""
    from backend.model.moe_stats import MoEStats, _to_first_rank

    logits = torch.randn(5, 4, requires_grad=True)
    probs = torch.softmax(logits, -1)
    stats = MoEStats(routers=[], coeff=0.0, topk=2, num_experts=4, ep_size=2)
    new, routing = _to_first_rank(probs, torch.zeros(5, 4, dtype=torch.bool), stats)
    assert routing[:, :2].all() and not routing[:, 2:].any()
    assert new.requires_grad and torch.equal(new[:, :2], probs.topk(2, -1).values) and not new[:, 2:].any()
