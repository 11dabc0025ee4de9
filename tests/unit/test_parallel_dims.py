"""ParallelDims: the one place the world's split is stated and checked (no torch needed)."""

from __future__ import annotations

import pytest

from backend.config import ConfigError, load_config, validate
from backend.distributed.parallel_dims import ParallelDims


def test_sizes_and_layout():
    dims = ParallelDims(world_size=8, cp=2, ep=4)
    assert (dims.dp, dims.cp, dims.ep, dims.tp, dims.pp) == (4, 2, 4, 1, 1)
    assert dims.sizes() == {"world_size": 8, "dp": 4, "cp": 2, "ep": 4, "tp": 1, "pp": 1}
    # rank = dp_rank x cp + cp_rank (megatron-core's order); EP groups are blocks of ep ranks
    for rank in range(8):
        where = dims.coords(rank)
        assert rank == where["dp"] * 2 + where["cp"]
        assert where["ep"] == rank % 4 and where["tp"] == 0 and where["pp"] == 0
    assert [dims.coords(r)["dp"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize(
    "dims, experts, expected",
    [
        (ParallelDims(world_size=4, cp=3), None, "parallel.context_parallel_size=3: must divide the world size 4"),
        (ParallelDims(world_size=1, cp=2), None, "launch with torchrun --nproc-per-node 2"),
        (ParallelDims(world_size=2, ep=2), 0, "parallel.expert_parallel_size=2: needs an MoE model"),
        (ParallelDims(world_size=4, ep=4), 6, "must divide model.num_moe_experts=6"),
        (ParallelDims(world_size=6, ep=4), 8, "parallel.expert_parallel_size=4: must divide the world size 6"),
    ],
)
def test_errors_name_the_key(dims, experts, expected):
    errors = dims.errors(num_moe_experts=experts)
    assert any(expected in e for e in errors), errors
    with pytest.raises(ValueError, match="must|needs"):
        dims.validate(num_moe_experts=experts)


def test_valid_sizes_have_no_errors():
    assert ParallelDims(world_size=8, cp=2, ep=2).errors(num_moe_experts=4) == []
    assert ParallelDims(world_size=1).validate() is not None


def test_config_validation_uses_the_same_check():
    cfg = load_config(None, ["parallel.context_parallel_size=3"])
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=4)
    assert ParallelDims(world_size=4, cp=3).errors()[0] in str(e.value)


def test_groups_exist_only_after_build():
    dims = ParallelDims(world_size=2)
    with pytest.raises(RuntimeError, match="init_distributed"):
        dims.group("loss")
    with pytest.raises(ValueError, match="purposes are"):
        dims.group("everything")


def test_the_world_has_its_groups(world):
    """A one-process world: every purpose answers, sizes of one dimension give None groups."""
    import torch.distributed as dist

    dims = world.dims
    assert dims.sizes()["world_size"] == 1
    assert dims.group("cp") is None and dims.group("ep") is None and dims.group("tp") is None
    assert dist.get_world_size(dims.group("loss")) == 1 and dims.group("world") is dist.group.WORLD
    assert dims.mesh("fsdp").size() == 1


def test_tensor_parallel_layout_and_alignment():
    """TP ranks are consecutive (fastest-varying); with sequence parallelism a row splits tp ways."""
    dims = ParallelDims(world_size=8, cp=2, tp=2)
    assert (dims.dp, dims.sp) == (2, 2)
    for rank in range(8):
        where = dims.coords(rank)
        assert rank == (where["dp"] * 2 + where["cp"]) * 2 + where["tp"]
    assert [dims.coords(r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert ParallelDims(world_size=2, tp=2, sequence_parallel=False).sp == 1


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (["parallel.tensor_parallel_size=3"], 3, "must divide model.num_attention_heads=4"),
        (["parallel.tensor_parallel_size=4"], 4, "must divide model.num_query_groups=2 (KV heads are split over TP"),
        (["parallel.tensor_parallel_size=2", "model.ffn_hidden_size=99"], 2, "must divide the FFN size 99"),
        (["parallel.tensor_parallel_size=2"], 3, "context x tensor parallel size 2 must divide the world size 3"),
        (["parallel.tensor_parallel_size=0"], 1, "parallel.tensor_parallel_size=0: must be >= 1"),
    ],
)
def test_tensor_parallel_errors_name_the_key(overrides, world, expected):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides), world_size=world)
    assert expected in str(e.value)


def test_tensor_parallel_takes_sinks_and_the_critic():
    """Sinks split with their heads and a critic's head is whole on every TP rank: no refusal."""
    for extra in (["model.attention_sinks=true"], ["model.head=value", "loss.type=value"], ["rl.advantage=gae"]):
        validate(load_config(None, ["parallel.tensor_parallel_size=2", *extra]), world_size=2)


def test_tensor_parallel_takes_moe_with_sequence_parallelism_and_refuses_it_without_by_name():
    assert ParallelDims(world_size=4, tp=2, ep=2).errors(num_moe_experts=4) == []
    errors = ParallelDims(world_size=2, tp=2, sequence_parallel=False).errors(num_moe_experts=4)
    assert any("under TP need parallel.sequence_parallel=true" in e for e in errors), errors


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("cp, sp, multiple", [(1, 2, 2), (1, 4, 4), (2, 2, 8)])
def test_every_planned_length_is_a_multiple_of_the_sp_cp_alignment(layout, cp, sp, multiple):
    """Odd lengths are padded up to tp (x 2cp), never dropped; priced over cp x sp GPUs."""
    from backend.batching import plan_dynamic, plan_fixed

    lengths = [1, 3, 5, 7, 9, 11, 13, 33, 65, 127]
    for plan in (
        plan_dynamic(lengths, dp_size=2, cp_size=cp, sp_size=sp, max_tokens_per_gpu=64, layout=layout),
        plan_fixed(lengths, dp_size=2, cp_size=cp, sp_size=sp, micro_batch_size=2, layout=layout),
    ):
        mbs = [mb for rank in plan.ranks for mb in rank if mb.indices]
        assert sorted(i for mb in mbs for i in mb.indices) == list(range(len(lengths)))
        assert all(mb.padded_len % multiple == 0 for mb in mbs)
        per_row = [mb.padded_len if layout == "packed" else mb.padded_len * len(mb.indices) for mb in mbs]
        assert [mb.cost for mb in mbs] == [n // (cp * sp) for n in per_row]
