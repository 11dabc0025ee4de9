"""The policy loss in the trainer, one process (gloo world of one), FP32 on CPU:

- a forward-only pass (recomputed or reference log-probabilities, validation) leaves the next
  step's gradient as it was (FSDP2 resharded after it);
- old_logprobs=detach gives exactly REINFORCE: the gradient of the weighted cross-entropy with
  loss_weight = advantage;
- the KL to a reference equal to the policy is 0;
- NaN where the loss mask is 0 changes nothing;
- minibatches_per_rollout=2 with recompute equals a run whose rows carry the same old
  log-probabilities (step 1's ratios are exactly 1, step 2's differ by the first update only);
- a reference model from loss.reference_checkpoint gives the step-1 objective of rows that carry
  that model's ref_logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.bench.rl_rows import rl_rows, write_rows
from backend.checkpoint.store import load_model_weights
from backend.config import load_config, validate
from backend.data.build import build_dataset
from backend.data.iterator import StepData, collate_plan, planner_from_config
from backend.data.jsonl import InMemoryDataset
from backend.data.row_fields import row_fields, with_logprobs
from backend.data.sample import Sample
from backend.logging.metrics import read_metrics
from backend.model.factory import build_model
from backend.train.forward_only import compute_logprobs, fill_logprobs
from backend.train.step import forward_backward
from backend.train.trainer import Trainer
from tests.conftest import TINY
from tests.helpers.tolerance import assert_close_by_scale

WINDOW = 8


def _cfg(rows, *extra):
    base = [
        f"data.path={rows}",
        "data.max_seq_length=160",
        f"train.global_batch_size={WINDOW}",
        "loss.type=policy",
        "train.dynamic_batch_enable=true",
        "train.max_tokens_per_gpu=256",
        "checkpoint.resume=false",
        "logger.log_interval=1000",
    ]
    return validate(load_config(TINY, [*base, *extra]))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy_rows")
    return write_rows(tmp / "rows.jsonl", rl_rows(2 * WINDOW, seed=5, max_len=100))


def _window(dataset, cfg, env, ids=None) -> StepData:
    ids = np.arange(WINDOW) if ids is None else ids
    plan = planner_from_config(cfg.train, env.dims)([int(n) for n in dataset.lengths[ids]])
    counts = dataset.loss_token_counts[ids]
    return StepData(
        ids,
        plan,
        collate_plan(dataset, ids, plan, dp_rank=env.dp_rank, cp_rank=env.cp_rank, cp_size=env.cp_size),
        int(counts.sum()),
        int(np.count_nonzero(counts)),
    )


def _grad(model) -> torch.Tensor:
    return torch.cat(
        [(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).reshape(-1) for p in model.parameters()]
    ).double()


@pytest.fixture(scope="module")
def policy_model(world, rows):
    cfg = _cfg(rows, "loss.kl_coef=0.1")
    dataset, tok = build_dataset(cfg.data, row_fields(cfg.loss))
    return cfg, dataset, build_model(cfg, world, tokenizer_vocab=tok.vocab_size).model


def _grad_of(model, data, env, loss_cfg) -> tuple[dict, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = forward_backward(model, data, env, loss_cfg=loss_cfg)
    return out, _grad(model)


def test_a_forward_only_pass_leaves_the_next_gradient_unchanged(world, policy_model, monkeypatch):
    """FSDP2's root module keeps its parameters unsharded after a forward with no backward; the
    reshard in ``forward_only`` puts them back. FSDP2 wraps the model here as over several ranks
    (one FP32 rank alone trains the plain module, where the bug cannot arise)."""
    from backend.distributed import fsdp

    cfg, dataset, _ = policy_model
    monkeypatch.setattr(fsdp, "uses_fsdp", lambda env, *, bf16: True)
    _, tok = build_dataset(cfg.data, row_fields(cfg.loss))
    model = build_model(cfg, world, tokenizer_vocab=tok.vocab_size).model
    assert isinstance(model, fsdp.FSDPModule)
    _, before = _grad_of(model, _window(dataset, cfg, world), world, cfg.loss)
    fill_logprobs(model, _window(dataset, cfg, world).microbatches, world, "old_logprobs")
    _, after = _grad_of(model, _window(dataset, cfg, world), world, cfg.loss)
    assert torch.equal(before, after)  # without the reshard: embedding gradient x2


def test_detach_is_reinforce_weighted_cross_entropy(world, policy_model, rows):
    cfg, dataset, model = policy_model
    detach = _cfg(rows, "loss.old_logprobs=detach").loss
    out, grad = _grad_of(model, _window(dataset, cfg, world), world, detach)
    assert out["ratio_min"] == out["ratio_max"] == 1.0 and out["clipfrac"] == 0.0
    weighted = InMemoryDataset(
        [Sample(s.tokens, s.loss_mask, loss_weight=s.advantages) for s in (dataset[i] for i in range(len(dataset)))],
        "weighted",
    )
    ce_out, ce_grad = _grad_of(model, _window(weighted, cfg, world), world, None)
    # the objective's value is -mean(A) (ratio 1); its gradient is the weighted cross-entropy's
    samples = [dataset[i] for i in range(WINDOW)]
    used = [s.advantages[1:][s.loss_mask[1:] > 0].astype(np.float64) for s in samples]
    tokens = sum(len(a) for a in used)
    minus_mean_a = -sum(float(a.sum()) for a in used) / tokens
    # judged by mean |A| (the terms' scale): -mean(A) itself cancels
    assert_close_by_scale(out["loss"], minus_mean_a, sum(float(np.abs(a).sum()) for a in used) / tokens)
    cos = float(torch.dot(grad, ce_grad) / (grad.norm() * ce_grad.norm()))
    assert cos >= 0.999999 and float((grad - ce_grad).norm() / ce_grad.norm()) <= 1e-5


def test_kl_is_zero_when_the_reference_is_the_policy(world, policy_model):
    cfg, dataset, model = policy_model
    data = _window(dataset, cfg, world)
    fill_logprobs(model, data.microbatches, world, "ref_logprobs")
    out, _ = _grad_of(model, data, world, cfg.loss)
    assert out["kl"] == 0.0


@pytest.mark.parametrize("method", ["tis", "icepop", "seq_tis", "seq_mask_tis"])
def test_the_samplers_own_numbers_change_nothing(world, policy_model, method):
    """rollout_logprobs and old_logprobs both the policy's own (at T = 0.7): every correction weight
    is 1, so objective and gradient are bitwise the uncorrected ones, and every mismatch measure
    is at its no-mismatch value (differences 0, NeMo-RL's multiplicative error 1)."""
    import dataclasses

    cfg, dataset, model = policy_model
    loss = dataclasses.replace(cfg.loss, temperature=0.7, rollout_correction_floor=0.5)
    corrected = dataclasses.replace(loss, rollout_correction=method)
    results = []
    for loss_cfg in (loss, corrected):
        data = _window(dataset, cfg, world)
        fill_logprobs(model, data.microbatches, world, "old_logprobs", temperature=0.7)
        fill_logprobs(model, data.microbatches, world, "rollout_logprobs", temperature=0.7)
        results.append(_grad_of(model, data, world, loss_cfg))
    (plain, grad_plain), (out, grad) = results
    assert out["loss"] == plain["loss"] and torch.equal(grad, grad_plain)
    assert out["rollout_correction_share"] == 0.0 and out["ratio_min"] == out["ratio_max"] == 1.0
    assert out["rollout_logprob_abs_diff"] == out["rollout_logprob_abs_diff_max"] == out["rollout_kl"] == 0.0
    assert out["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-12)


def test_nan_where_masked_changes_nothing(world, policy_model, rows, tmp_path):
    cfg, dataset, model = policy_model
    zeros = [json.loads(line) for line in Path(rows).read_text().splitlines()]
    for row in zeros:
        for key in ("old_logprobs", "ref_logprobs"):
            row[key] = [0.0 if v is None else v for v in row[key]]
    clean, _ = build_dataset(_cfg(write_rows(tmp_path / "zeros.jsonl", zeros)).data, row_fields(cfg.loss))
    assert any(np.isnan(dataset[i].old_logprobs).any() for i in range(WINDOW))
    out_nan, grad_nan = _grad_of(model, _window(dataset, cfg, world), world, cfg.loss)
    out_zero, grad_zero = _grad_of(model, _window(clean, cfg, world), world, cfg.loss)
    assert out_nan == out_zero and torch.equal(grad_nan, grad_zero)


def _train(cfg, world) -> tuple[list[dict], torch.Tensor, Trainer]:
    trainer = Trainer(cfg, world)
    trainer.train()
    trainer.metrics.close()
    steps, _ = read_metrics(Path(cfg.logger.run_dir) / "metrics.jsonl")
    params = torch.cat(
        [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1) for p in trainer.model.parameters()]
    )
    return steps, params.double(), trainer


def _term_scales(rows: Path) -> dict[str, float]:
    """Mean |value| of each per-token field over the loss tokens of the first window's rows."""
    source = [json.loads(line) for line in Path(rows).read_text().splitlines()][:WINDOW]
    out = {}
    for field in ("advantages", "old_logprobs"):
        values = []
        for row in source:
            n, mask, v = len(row["input_ids"]), row["loss_mask"], row.get(field)
            if v is None:
                continue
            v = [v] * n if not isinstance(v, list) else v
            values += [abs(v[t]) for t in range(1, n) if mask[t]]
        out[field] = sum(values) / max(1, len(values))
    return out


def _merged(rows, model, cfg, world, field, out: Path) -> Path:
    """``rows`` with ``field`` computed by ``model`` (the offline tool's library calls)."""
    dataset, _ = build_dataset(cfg.data, row_fields(None) if False else row_fields(cfg.loss))
    samples = [dataset[i] for i in range(len(dataset))]
    planner = planner_from_config(cfg.train, world.dims, forward=True)
    logprobs = compute_logprobs(model, samples, world, planner)
    source = [json.loads(line) for line in Path(rows).read_text().splitlines()]
    return write_rows(out, [with_logprobs(r, lp, field) for r, lp in zip(source, logprobs)])


def test_recomputed_old_logprobs_over_two_minibatches_equal_supplied_ones(world, rows, tmp_path):
    common = ["train.train_iters=2", "scheduler.type=constant", "scheduler.warmup_iters=0", "optimizer.lr=0.001"]
    recompute = _cfg(
        rows,
        *common,
        "loss.old_logprobs=recompute",
        "loss.minibatches_per_rollout=2",
        f"logger.run_dir={tmp_path / 'a'}",
    )
    steps_a, params_a, trainer = _train(recompute, world)
    assert steps_a[0]["ratio_min"] == steps_a[0]["ratio_max"] == 1.0  # recomputed from these very weights
    assert steps_a[1]["ratio_max"] > 1.0 or steps_a[1]["ratio_min"] < 1.0  # the first update moved them
    # the same old log-probabilities, computed offline from the same initial weights and carried by the rows
    init = build_model(recompute, world, tokenizer_vocab=trainer.tokenizer.vocab_size).model
    supplied_rows = _merged(rows, init, recompute, world, "old_logprobs", tmp_path / "with_old.jsonl")
    supplied = _cfg(supplied_rows, *common, f"logger.run_dir={tmp_path / 'b'}")
    steps_b, params_b, _ = _train(supplied, world)
    # Signed window means (loss, pg_loss ~ -A r; approx_kl = old - lp) judged by their terms' scale:
    # mean |A| and mean |old log-probability| over the loss tokens; clipfrac is a share of tokens.
    scale = _term_scales(supplied_rows)
    scale = {"loss": scale["advantages"], "pg_loss": scale["advantages"], "approx_kl": scale["old_logprobs"]}
    for a, b in zip(steps_a, steps_b):
        for key in ("loss", "pg_loss", "approx_kl"):
            assert_close_by_scale(a[key], b[key], scale[key], rel=1e-5, what=key)
        for key in ("clipfrac", "ratio_min", "ratio_max"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    assert float((params_a - params_b).abs().max()) <= 1e-5


def test_reference_checkpoint_equals_rows_carrying_its_logprobs(world, rows, tmp_path):
    # a reference that differs from the initial policy: one trained step
    first = _cfg(
        rows,
        "train.train_iters=1",
        "optimizer.lr=0.05",
        "scheduler.warmup_iters=0",
        f"logger.run_dir={tmp_path / 'ref'}",
    )
    _, _, trainer = _train(first, world)
    ckpt = tmp_path / "ref" / "checkpoints"
    by_model = _cfg(
        rows,
        "train.train_iters=1",
        "loss.kl_coef=0.1",
        f"loss.reference_checkpoint={ckpt}",
        f"logger.run_dir={tmp_path / 'm'}",
    )
    steps_m, _, _ = _train(by_model, world)
    ref_model = build_model(
        first, world, tokenizer_vocab=trainer.tokenizer.vocab_size, training=False, empty=True
    ).model
    load_model_weights(ref_model, ckpt / "step_00000001")
    carried = _merged(rows, ref_model, first, world, "ref_logprobs", tmp_path / "with_ref.jsonl")
    by_rows = _cfg(carried, "train.train_iters=1", "loss.kl_coef=0.1", f"logger.run_dir={tmp_path / 'r'}")
    steps_r, _, _ = _train(by_rows, world)
    assert steps_m[0]["kl"] > 1e-6  # the reference really differs from the policy
    # the objective (-A r + 0.1 KL, A of both signs) by its terms' scale
    scale = _term_scales(carried)["advantages"] + 0.1 * steps_m[0]["kl"]
    assert_close_by_scale(steps_m[0]["loss"], steps_r[0]["loss"], scale, what="objective")
    assert steps_m[0]["kl"] == pytest.approx(steps_r[0]["kl"], rel=1e-5)
