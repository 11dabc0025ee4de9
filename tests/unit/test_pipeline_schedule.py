"""Pipeline parallelism's pure parts: the 1F1B order, its in-flight bound and modelled bubble, the
stage split, the whole-model names of a stage's parameters, and the config's refusals by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backend.config import ConfigError, load_config, validate
from backend.distributed.parallel_dims import ParallelDims
from backend.distributed.pipeline import in_flight, modelled_bubble, one_f_one_b, pipeline_order
from backend.model.pipeline_stage import StageNames


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 8])
def test_1f1b_runs_every_microbatch_once_each_way_in_order(stages, microbatches):
    for stage in range(stages):
        order = one_f_one_b(microbatches, stages, stage)
        assert [j for op, j in order if op == "F"] == list(range(microbatches))
        assert [j for op, j in order if op == "B"] == list(range(microbatches))
        assert all(order.index(("F", j)) < order.index(("B", j)) for j in range(microbatches))
        # warm-up (p - 1 - s forwards) and the steady state's first forward come before the first backward
        assert order.index(("B", 0)) == min(stages - stage, microbatches)
        assert in_flight(microbatches, stages, stage) == min(stages - stage, microbatches)


def test_the_modelled_bubble_is_the_textbook_one_for_equal_microbatches():
    for stages, m in ((2, 4), (4, 8), (4, 1), (3, 12)):
        assert modelled_bubble([1.0] * m, stages) == pytest.approx((stages - 1) / (m + stages - 1))
    assert modelled_bubble([5.0, 1.0, 1.0, 1.0], 2) > modelled_bubble([1.0, 1.0, 1.0, 5.0], 2) * 0.5
    assert modelled_bubble([3.0], 1) == 0.0


def test_stage_split_keeps_the_remainder_off_the_ends():
    assert ParallelDims(world_size=4, pp=4).stage_layers(10) == [2, 3, 3, 2]
    assert ParallelDims(world_size=3, pp=3).stage_layers(7) == [2, 3, 2]
    assert ParallelDims(world_size=2, pp=2).stage_layers(4) == [2, 2]
    dims = ParallelDims(world_size=2, pp=2, pipeline_layers=(3, 1))
    assert dims.stage_layers(4) == [3, 1] and dims.stage_range(1, 4) == (3, 1)
    # pp slowest in the rank layout: stage s holds ranks s * (world / pp) ...
    assert [ParallelDims(world_size=8, tp=2, pp=2).coords(r)["pp"] for r in range(8)] == [0] * 4 + [1] * 4


def test_a_stage_names_its_parameters_as_the_whole_model_does():
    last = StageNames(stage=1, stages=2, first=3, count=2, tied=True)
    assert (
        last.whole("decoder.layers.0.self_attention.linear_qkv.weight")
        == "decoder.layers.3.self_attention.linear_qkv.weight"
    )
    assert last.local("decoder.layers.4.mlp.linear_fc1.weight") == "decoder.layers.1.mlp.linear_fc1.weight"
    assert last.local("decoder.layers.2.mlp.linear_fc1.weight") is None  # the first stage's
    assert last.whole("output_layer.weight") is None  # the tied copy is never written
    assert last.source("output_layer.weight") == last.local.__self__.source("output_layer.weight")
    assert last.source("output_layer.weight") == "embedding.word_embeddings.weight"
    assert last.local("embedding.word_embeddings.weight") == "output_layer.weight"
    first = StageNames(stage=0, stages=2, first=0, count=3, tied=True)
    assert first.local("decoder.final_layernorm.weight") is None and first.tied_copy is None
    untied = StageNames(stage=1, stages=2, first=3, count=2, tied=False)
    assert untied.whole("output_layer.weight") == "output_layer.weight"
    assert untied.local("embedding.word_embeddings.weight") is None


@pytest.mark.parametrize(
    "overrides, world, expected",
    [
        (["parallel.pipeline_parallel_size=3"], 3, "parallel.pipeline_parallel_size=3: at most model.num_layers=2"),
        (
            ["parallel.pipeline_parallel_size=2", "parallel.pipeline_layers=[2,1]"],
            2,
            "parallel.pipeline_layers=[2, 1]: one count >= 1 per stage (2), summing to model.num_layers=2",
        ),
        (["parallel.pipeline_parallel_size=2"], 3, "pipeline parallel size 2 must divide the world size 3"),
        (
            ["parallel.pipeline_parallel_size=2", "model.num_moe_experts=4", "parallel.expert_parallel_size=4"],
            4,
            "parallel.expert_parallel_size=4: must divide the 2 ranks of a pipeline stage",
        ),
        (
            ["parallel.pipeline_parallel_size=2", "parallel.pipeline_order=fastest"],
            2,
            "parallel.pipeline_order",
        ),
    ],
)
def test_pipeline_refusals_name_the_key(overrides, world, expected):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides), world_size=world)
    assert expected in str(e.value)


def test_forward_only_passes_are_taken_under_pipelining():
    """Validation, recomputed old and reference log-probabilities run through the stages."""
    for extra in (
        ["train.eval_interval=5", "data.valid_fraction=0.1", "train.forward_max_tokens_per_gpu=512"],
        ["loss.type=policy", "loss.old_logprobs=recompute", "data.path=r.jsonl"],
    ):
        validate(load_config(None, ["parallel.pipeline_parallel_size=2", *extra]), world_size=2)


def test_rl_workers_and_the_memory_probe_are_taken_under_pipelining():
    pp2 = ["parallel.pipeline_parallel_size=2"]
    validate(load_config(None, pp2), world_size=2, from_memory=True)
    validate(
        load_config(None, [*pp2, "train.dynamic_batch_enable=true", "train.max_tokens_per_gpu=auto"]), world_size=2
    )


@settings(max_examples=200, deadline=None)
@given(costs=st.lists(st.integers(1, 5000), min_size=1, max_size=24), stages=st.integers(1, 6))
def test_the_pipeline_order_is_a_permutation_never_modelled_worse_than_the_plan(costs, stages):
    order = pipeline_order(costs, stages)
    assert sorted(order) == list(range(len(costs)))
    assert modelled_bubble([costs[j] for j in order], stages) <= modelled_bubble(costs, stages)
    assert pipeline_order(costs, stages, "plan") == list(range(len(costs)))


def test_small_microbatches_go_to_the_ends_when_that_shortens_the_step():
    costs = [4096, 4096, 4096, 4096, 512, 256]  # the dynamic planner's tail: the short leftovers last
    order = pipeline_order(costs, 4)
    assert order[0] == 5 and order[-1] == 4 and order[1:-1] == [0, 1, 2, 3]
    assert modelled_bubble([costs[j] for j in order], 4) < modelled_bubble(costs, 4)
