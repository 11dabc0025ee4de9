"""The model and its attention backends on CPU: padding, flex vs sdpa, forward-only log-probs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .harness import run_ranks

pytestmark = pytest.mark.distributed


def model_checks(rank: int, world: int):
    from backend.batching import Microbatch, PlanArgs, make_planner
    from backend.config import load_config
    from backend.data.collate import collate
    from backend.data.sample import Sample
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.model.forward import token_losses
    from backend.train.forward_only import compute_logprobs

    env = init_distributed(1)
    base = ["model.hidden_size=64", "model.num_layers=2", "data.max_seq_length=128", "train.seed=7"]
    rng = np.random.default_rng(0)
    samples = [Sample(tokens=rng.integers(0, 256, size=n)) for n in (5, 37, 1, 64, 12, 90, 3)]

    def build(backend):
        cfg = load_config(None, [*base, f"model.attention_backend={backend}"])
        return build_model(cfg, env, tokenizer_vocab=256, training=False).model

    out = {}
    with torch.no_grad():
        sdpa, flex = build("sdpa"), build("flex")
        # One padded microbatch holding every sample, against each sample alone and unpadded.
        mb = Microbatch(indices=tuple(range(len(samples))), padded_len=96, cost=0, tokens=0)
        batch = collate(samples, list(range(len(samples))), mb)
        padded_sdpa = token_losses(sdpa, batch.tokens, batch.labels, batch.position_ids, batch.valid)
        padded_flex = token_losses(flex, batch.tokens, batch.labels, batch.position_ids, batch.valid)
        valid = batch.valid
        out["flex_vs_sdpa"] = float((padded_sdpa - padded_flex)[valid].abs().max())
        worst = 0.0
        for i, s in enumerate(samples):
            one = collate([s], [i], Microbatch(indices=(0,), padded_len=len(s.tokens), cost=0, tokens=0))
            alone = token_losses(sdpa, one.tokens, one.labels, one.position_ids, one.valid)
            worst = max(worst, float((alone[0] - padded_sdpa[i, : len(s.tokens)]).abs().max()))
        out["padding_vs_alone"] = worst
        out["backend_names"] = (
            type(sdpa.decoder.layers[0].self_attention.core_attention).__name__,
            type(flex.decoder.layers[0].self_attention.core_attention).__name__,
        )

    # Forward-only through the data-parallel (FSDP) model, planned under a small budget.
    model = build("sdpa")
    planner = make_planner("dynamic", PlanArgs(dp_size=env.dp_size, max_tokens_per_gpu=128))
    logprobs = compute_logprobs(model, samples, env, planner)
    reference = []
    with torch.no_grad():
        for i, s in enumerate(samples):
            one = collate([s], [i], Microbatch(indices=(0,), padded_len=len(s.tokens), cost=0, tokens=0))
            reference.append(
                (-token_losses(model, one.tokens, one.labels, one.position_ids, one.valid))[
                    0, : len(s.tokens) - 1
                ].numpy()
            )
    out["logprob_lengths"] = [len(x) for x in logprobs]
    out["logprob_diff"] = max(float(np.abs(a - b).max(initial=0.0)) for a, b in zip(logprobs, reference))
    out["num_microbatches"] = planner([len(s.tokens) for s in samples]).num_microbatches
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(model_checks, 2, tmp_path_factory.mktemp("model"))


def test_flex_forward_equals_sdpa_forward_on_cpu(results):
    for r in results:
        assert r["backend_names"] == ("SdpaCoreAttention", "FlexCoreAttention")
        assert r["flex_vs_sdpa"] <= 1e-5


def test_right_padding_does_not_change_valid_positions(results):
    for r in results:
        assert r["padding_vs_alone"] <= 1e-5


def test_forward_only_logprobs_match_unpadded_forwards_in_caller_order(results):
    for r in results:
        assert r["logprob_lengths"] == [4, 36, 0, 63, 11, 89, 2]
        assert r["num_microbatches"] > 1  # the forward budget really split the samples
        assert r["logprob_diff"] <= 1e-5
    assert results[0]["logprob_diff"] == results[1]["logprob_diff"]


def test_flex_refuses_to_train_on_cpu():
    from backend.model.attention import resolve_backend

    with pytest.raises(RuntimeError, match="flex trains only on CUDA"):
        resolve_backend("flex", device=torch.device("cpu"), training=True)
    with pytest.raises(RuntimeError, match="te needs CUDA and Transformer Engine"):
        resolve_backend("te", device=torch.device("cpu"))
    assert resolve_backend("auto", device=torch.device("cpu")) == "sdpa"
