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
