"""Pipeline parallelism (``parallel.pipeline_parallel_size``), real gloo ranks, 1F1B with every
activation shape taken from the plan:

- PP 4 with two middle stages trains like PP 1 (a 4-layer model, 2 steps).
- PP 2 trains like PP 1 (3 steps): padded cross-entropy with tied embeddings, packed policy loss
  with entropy and chunked logits with untied embeddings, a fixed plan; dp 2 x pp 2, tp 2 x pp 2
  and cp 2 x pp 2 on 4 ranks against the same dp / tp / cp without pipelining. Loss within 1e-6
  relative, gradient cosine >= 0.999999, weights within 2e-5 (Adam after 3 steps, as the TP / CP
  arms). Each stage runs half of the decoder layers.
- A step with fewer microbatches than stages runs (its bubble reported); stages whose plans differ
  are refused by name, not hung.
- Checkpoints in the whole model's layout: PP 2 resumes at PP 2 bitwise and at PP 1 within
  rounding; the export of a PP 2 checkpoint equals the PP 1 run's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from backend.bench.compare import compare, run_arm
from backend.distributed.launch import torchrun_command
from tests.conftest import REPO, TINY
from tests.helpers.subprocess_env import subprocess_env

from .harness import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 3


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    from backend.bench.rl_rows import rl_rows, write_rows

    return write_rows(tmp_path_factory.mktemp("pp_rows") / "rows.jsonl", rl_rows(16, seed=8, max_len=150))


def _arms(tmp_path, overrides: list[str], nproc: int, name: str) -> tuple[dict, dict]:
    """The same run on ``nproc`` ranks without pipelining and on 2 x ``nproc`` ranks at PP 2."""
    ref = run_arm(str(TINY), overrides, nproc=nproc, steps=STEPS, out_dir=tmp_path, name=f"{name}_pp1")
    pp2 = [*overrides, "parallel.pipeline_parallel_size=2"]
    return ref, run_arm(str(TINY), pp2, nproc=2 * nproc, steps=STEPS, out_dir=tmp_path, name=f"{name}_pp2")


def _same_training(ref: dict, other: dict, pp: int = 2) -> None:
    result = compare(ref, other)
    print({k: result[k] for k in ("loss_rel_diff", "grad_cosine", "max_param_diff")})
    assert other["pipeline_parallel_size"] == pp and ref["pipeline_parallel_size"] == 1
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["grad_cosine"] >= 0.999999, result
    assert result["max_param_diff"] <= 2e-5, result
    assert other["stage_layers"] == [1, 1] and ref["stage_layers"] == [2]  # half of the decoder a stage


TWO_RANK_ARMS = {
    "padded_ce_tied": [],
    "packed_policy_chunked_untied_recompute": [
        "loss.type=policy",
        "loss.old_logprobs=recompute",  # forward-only log-probabilities through the stages
        "loss.entropy_coef=0.01",
        "loss.temperature=0.7",
        "model.logits_chunk_tokens=7",
        "model.tie_embeddings=false",
        "train.dynamic_batch_layout=packed",
    ],
    "fixed_ce": ["train.dynamic_batch_enable=false", "train.micro_batch_size=4"],
    # PPO's critic: the value head on the last stage, the value loss (clipped) there
    "critic_value_packed": ["model.head=value", "loss.type=value", "train.dynamic_batch_layout=packed"],
}
#: A GPT-OSS-style model: MoE (4 experts, top 2, its router's auxiliary loss), sinks, windows.
MOE = [
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.moe_aux_loss_coeff=0.01",
    "model.attention_sinks=true",
    "model.sliding_window=64",
    "model.attention_backend=sdpa",
    "train.dynamic_batch_layout=packed",
]


@pytest.mark.parametrize("name", list(TWO_RANK_ARMS))
def test_pp2_trains_like_pp1(tmp_path, rows, name):
    overrides = list(TWO_RANK_ARMS[name])
    if "loss.type=policy" in overrides:
        overrides.append(f"data.path={rows}")
    if "loss.type=value" in overrides:
        from .test_value_equivalence import _rows

        overrides.append(f"data.path={_rows(tmp_path / 'value_rows.jsonl')}")
    _same_training(*_arms(tmp_path, overrides, 1, name))


@pytest.mark.parametrize(
    "layout", [[], ["parallel.tensor_parallel_size=2"], ["parallel.context_parallel_size=2"]], ids=["dp2", "tp2", "cp2"]
)
def test_four_ranks_with_pp2_train_like_two_without(tmp_path, layout):
    _same_training(*_arms(tmp_path, ["train.dynamic_batch_layout=packed", *layout], 2, "packed"))


def test_moe_at_pp2_trains_like_pp1_and_with_ep2_inside_the_stages(tmp_path):
    """MoE layers on every stage, each stage's router auxiliary loss in its own backward (and its
    metric summed over the stages once); then ep 2 x pp 2 on 4 ranks like ep 2 on 2."""
    ref, other = _arms(tmp_path, MOE, 1, "moe")
    _same_training(ref, other)
    assert other["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-6) and min(ref["moe_aux_loss"]) > 0
    _same_training(*_arms(tmp_path, [*MOE, "parallel.expert_parallel_size=2"], 2, "moe_ep2"))


def test_four_stages_with_middle_ones_train_like_one(tmp_path):
    """PP 4 on a 4-layer model: two middle stages (no embedding, no output layer, no tied copy)."""
    overrides = ["model.num_layers=4", "train.dynamic_batch_layout=packed"]
    ref = run_arm(str(TINY), overrides, nproc=1, steps=2, out_dir=tmp_path, name="pp1")
    other = run_arm(
        str(TINY), [*overrides, "parallel.pipeline_parallel_size=4"], nproc=4, steps=2, out_dir=tmp_path, name="pp4"
    )
    result = compare(ref, other)
    assert result["loss_rel_diff"] <= 1e-6 and result["grad_cosine"] >= 0.999999, result
    assert result["max_param_diff"] <= 2e-5, result
    assert other["stage_layers"] == [1, 1, 1, 1]


def _train(run_dir, *extra, nproc=2):
    cmd = torchrun_command(
        nproc,
        "-m",
        "backend.train",
        str(TINY),
        f"logger.run_dir={run_dir}",
        "logger.log_interval=1000",
        *extra,
    )
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(OMP_NUM_THREADS="1")
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pp2_checkpoints_resume_at_any_pp_and_export_the_whole_model(tmp_path):
    pp2 = ["parallel.pipeline_parallel_size=2"]
    evaluated = ["data.valid_fraction=0.05", "train.eval_interval=2"]  # validation: forward-only through the stages
    whole2 = _train(tmp_path / "whole_pp2", *pp2, "train.train_iters=4", *evaluated)
    whole1 = _train(tmp_path / "whole_pp1", "train.train_iters=4", *evaluated, nproc=1)
    evals2, evals1 = ([r for r in rows if r.get("event") == "eval"] for rows in (whole2, whole1))
    assert [r["step"] for r in evals2] == [2, 4] and len(evals1) == 2
    for a, b in zip(evals2, evals1):
        assert abs(a["valid_loss"] - b["valid_loss"]) <= 1e-6 * abs(b["valid_loss"])
    whole2, whole1 = ([r for r in rows if r.get("event") is None] for rows in (whole2, whole1))
    for a, b in zip(whole2, whole1):  # PP 2 against PP 1 (the arms above compare gradients and weights too)
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]) and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
    assert all(0 <= r["pipeline_bubble"] < 1 and 0 < r["pipeline_bubble_modelled"] < 1 for r in whole2)
    part = tmp_path / "part"
    _train(part, *pp2, "train.train_iters=2", "checkpoint.interval=2", *evaluated)
    other = tmp_path / "part_pp1"
    shutil.copytree(part, other)
    same = [r for r in _train(part, *pp2, "train.train_iters=4", *evaluated) if r.get("event") is None]
    assert [(r["loss"], r["grad_norm"]) for r in same[2:]] == [(r["loss"], r["grad_norm"]) for r in whole2[2:]]
    moved = [r for r in _train(other, "train.train_iters=4", *evaluated, nproc=1) if r.get("event") is None]
    for a, b in zip(moved[2:], whole1[2:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]) and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5
    from safetensors.torch import load_file

    exported = {}
    for name, run in (("pp2", part), ("pp1", tmp_path / "whole_pp1")):
        step = run / "checkpoints" / "step_00000004"
        out = tmp_path / f"export_{name}"
        done = subprocess.run(
            [sys.executable, "tools/export_hf.py", str(step), "--output", str(out), "--dtype", "fp32"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        exported[name] = load_file(out / "model.safetensors")
    assert sorted(exported["pp2"]) == sorted(exported["pp1"])
    worst = max(float((exported["pp2"][k] - exported["pp1"][k]).abs().max()) for k in exported["pp1"])
    assert worst <= 2e-5, worst


def test_fewer_microbatches_than_stages_run(tmp_path):
    rows = _train(
        tmp_path / "run", "parallel.pipeline_parallel_size=2", "train.global_batch_size=2", "train.train_iters=2"
    )
    assert [r["num_microbatches"] for r in rows] == [1, 1]
    assert all(r["pipeline_bubble_modelled"] == pytest.approx(0.5) for r in rows)  # 1 microbatch, 2 stages


def _disagreeing_plans(rank: int, world: int):
    import types

    import torch.distributed as dist

    from backend.distributed.pipeline import PipelineShapeError, check_shapes

    env = types.SimpleNamespace(pp_size=2, pp_rank=rank, group=lambda purpose: dist.group.WORLD)
    shapes = [(64, 2, 32), (128, 1, 32)] if rank == 0 else [(64, 2, 32), (96, 1, 32)]
    try:
        check_shapes(shapes, env, step=7)
    except PipelineShapeError as e:
        return str(e)
    return None


def test_stages_whose_plans_differ_are_refused_by_name(tmp_path):
    errors = run_ranks(_disagreeing_plans, 2, tmp_path)
    assert errors[0] == (
        "step 7: pipeline stage 1 plans microbatch 1 as (96, 1, 32) (tokens, rows, hidden), stage 0 as (128, 1, 32): "
        "the stages of one pipeline must hold the same plan"
    )
    assert errors[1] is not None and "pipeline stage 0 plans microbatch 1 as (128, 1, 32)" in errors[1]
    assert torch.distributed.is_available()


def _weight_streams(rank: int, world: int):
    from backend.config import load_config, validate
    from backend.distributed.setup import init_from_config
    from backend.model.factory import build_model
    from backend.rl.weights import hf_weights, weight_metadata

    out, env = {}, None
    for tied in (True, False):
        overrides = [f"model.tie_embeddings={str(tied).lower()}", f"parallel.pipeline_parallel_size={world}"]
        cfg = validate(load_config(str(TINY), overrides), world)
        env = env or init_from_config(cfg)  # the same groups for both models
        built = build_model(cfg, env, tokenizer_vocab=256)
        stream = {name: t.clone() for name, t in hf_weights(built.model, built.fields)}
        meta = weight_metadata(built.model, built.fields)
        out[tied] = stream, meta, sorted(n for n, _ in built.model.named_parameters())
    return out


def test_the_weight_stream_at_pp2_is_the_whole_models(tmp_path):
    """The RL weight stream under pipelining (tied and untied embeddings): every stage streams its
    own layers under Hugging Face names, every rank yields the whole model's tensors, bitwise those
    of one process."""
    one = run_ranks(_weight_streams, 1, tmp_path)[0]
    r0, r1 = run_ranks(_weight_streams, 2, tmp_path)
    for tied in (True, False):
        whole, meta1, _ = one[tied]
        (s0, meta0, names0), (s1, _, names1) = r0[tied], r1[tied]
        assert list(s0) == list(whole) == list(s1)  # the whole model's names, in its order
        assert all(torch.equal(s0[k], whole[k]) and torch.equal(s1[k], whole[k]) for k in whole)
        assert meta0 == meta1 == [(k, t.dtype, tuple(t.shape)) for k, t in whole.items()]
        assert not any("layers.1." in n for n in names0) and not any("embedding" in n for n in names1)
    assert "lm_head.weight" in one[False][0] and "lm_head.weight" not in one[True][0]


def _rl(run_dir, *extra, nproc):
    demo = REPO / "configs" / "grpo_demo.yaml"
    args = [
        "-m",
        "backend.rl",
        str(demo),
        f"logger.run_dir={run_dir}",
        "logger.log_interval=1000",
        "train.train_iters=2",
    ]
    cmd = torchrun_command(nproc, *args, *extra) if nproc > 1 else [sys.executable, *args, *extra]
    out = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(OMP_NUM_THREADS="1")
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_rl_loop_at_pp2_trains_as_at_pp1(tmp_path):
    """GRPO through the stages: rollouts from the streamed weights (the loop checks every sync on
    its probe sequence), the same rewards and updates as one process; the asynchronous loop too."""
    pp2 = ["parallel.pipeline_parallel_size=2"]
    one = _rl(tmp_path / "pp1", nproc=1)
    two = _rl(tmp_path / "pp2", *pp2, nproc=2)
    for a, b in zip(one, two, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["tokens"] == b["tokens"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["weight_sync_bytes"] == a["weight_sync_bytes"] > 0
    lagged = _rl(tmp_path / "async", *pp2, "rl.max_staleness=1", nproc=2)
    assert [r["step"] for r in lagged] == [1, 2] and all(r["grad_norm"] > 0 for r in lagged)


def _gathers_per_step(rank: int, world: int, tmp: str):
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from backend.config import load_config, validate
    from backend.distributed.setup import init_from_config
    from backend.train.trainer import Trainer

    gathers = [0]
    unshard = FSDPParamGroup.unshard

    def counted(self, *args, **kwargs):
        gathers[0] += not self.is_unsharded and self._all_gather_result is None
        return unshard(self, *args, **kwargs)

    FSDPParamGroup.unshard = counted
    overrides = [f"logger.run_dir={tmp}/run", "parallel.pipeline_parallel_size=2", "train.train_iters=1"]
    cfg = validate(load_config(str(TINY), [*overrides, "train.max_tokens_per_gpu=256"]), world)
    trainer = Trainer(cfg, init_from_config(cfg))
    trainer.train()
    groups = sum(
        1
        for m in trainer.model.modules()
        if getattr(m, "_get_fsdp_state", None) and m._get_fsdp_state()._fsdp_param_group
    )
    return gathers[0], groups


def test_fsdp2_gathers_a_stage_once_per_step(tmp_path):
    """dp 2 x pp 2: each FSDP2 parameter group of a stage is gathered once in a step of several
    microbatches (not once per forward and again per backward) and resharded after the last."""
    for gathers, groups in run_ranks(_gathers_per_step, 4, tmp_path, str(tmp_path)):
        assert groups == 2 and gathers == groups, (gathers, groups)  # one layer and the stage's root


def _adversarial_at_pp2(rank: int, world: int, tmp: str):
    from pathlib import Path

    from backend.bench.memory_adversary import run_phase
    from backend.config import load_config, validate
    from backend.distributed.setup import init_from_config

    overrides = ["parallel.pipeline_parallel_size=2", "train.memory_limit_gib=0.05", "train.memory_meter=always"]
    env = init_from_config(validate(load_config(str(TINY), overrides), world))
    return [run_phase(str(TINY), overrides, kind, 2, Path(tmp), env) for kind in ("long", "short")]


def test_every_stage_stays_under_the_probes_prediction(tmp_path):
    """train.max_tokens_per_gpu=auto at PP 2: the probe measures each stage with its in-flight
    microbatches (stage 0 holds two), and windows of only maximum-length rows and of only short
    rows, trained at the budget it resolves, measure under the prediction on every stage."""
    phases = run_ranks(_adversarial_at_pp2, 2, tmp_path, str(tmp_path), timeout=400)[0]
    for phase in phases:
        print({k: phase[k] for k in ("phase", "budget", "worst_ratio", "worst_peak_bytes")})
        assert phase["within_prediction"] and phase["final_budget"] == phase["budget"], phase
        assert phase["budget"] < 16 * 256  # the memory limit binds, not the window's tokens
        assert all(s["peak_memory_bytes"] <= 0.05 * 2**30 * 0.9 for s in phase["steps"])
