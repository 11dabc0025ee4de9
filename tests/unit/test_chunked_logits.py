"""Logits never whole (``model.logits_chunk_tokens``, backend/model/output.py): the same numbers.

- ``ChunkedLogprobs`` against plain autograd through log_softmax(h W^T / T): log-probabilities,
  entropy and the gradients of hidden states and weight, for chunk sizes that divide the tokens
  and that do not, at temperature 1 and 0.7, with a vocabulary limit (padding rows get no
  gradient and never enter the softmax);
- the real trainer (FSDP2, dynamic batching, CPU): cross-entropy and the policy loss (entropy
  bonus in the loss) give the unchunked losses, gradient norms and weights within FP32 rounding,
  tied and untied embeddings, a padded vocabulary (the byte tokenizer's end of document: 257 ids
  in 384 rows);
- on a model with Qwen3's 151,936-token vocabulary the memory probe measures a per-token cost
  with chunking well under half of the unchunked one.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend.config import load_config, validate
from backend.distributed.fsdp import full_tensor
from backend.model.forward import output_settings
from backend.model.output import chunked_logprobs
from tests.conftest import TINY
from tests.helpers.in_process import train_in_process


def _reference(h, w, labels, temperature, limit):
    logp = torch.log_softmax((h @ w[:limit].t()) / temperature, dim=-1)
    return logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 5, 12, 64])
@pytest.mark.parametrize("temperature, limit", [(1.0, None), (0.7, 37)])
def test_chunked_function_equals_autograd_through_log_softmax(chunk, temperature, limit):
    g = torch.Generator().manual_seed(chunk)
    h = torch.randn(12, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, limit or 50, (12,), generator=g)
    coef_lp, coef_h = (
        torch.randn(12, generator=g, dtype=torch.float64),
        torch.randn(12, generator=g, dtype=torch.float64),
    )
    lp, ent = chunked_logprobs(h, w, labels, chunk=chunk, temperature=temperature, vocab_limit=limit, entropy="grad")
    (coef_lp * lp + coef_h * ent).sum().backward()
    got = (lp.detach(), ent.detach(), h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    ref_lp, ref_ent = _reference(h, w, labels, temperature, limit)
    (coef_lp * ref_lp + coef_h * ref_ent).sum().backward()
    for a, b in zip(got, (ref_lp.detach(), ref_ent.detach(), h.grad, w.grad)):
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-6)  # the logits in FP32, the reference in FP64
    if limit:
        assert torch.all(got[3][limit:] == 0)  # padding rows: no gradient


def _rows(path, count=24, seed=0, policy=False):
    rng = np.random.default_rng(seed)
    with path.open("w") as f:
        for _ in range(count):
            n = int(rng.integers(12, 90))
            mask = [0] * 4 + [1] * (n - 4)
            row = {"input_ids": rng.integers(0, 256, n).tolist(), "loss_mask": mask}
            if policy:
                row["advantages"] = float(rng.normal())
            f.write(json.dumps(row) + "\n")
    return path


def _train(world, tmp_path, chunk: int, extra: list[str]):
    overrides = [
        "train.dynamic_batch_enable=true",
        "train.max_tokens_per_gpu=256",
        "data.max_seq_length=128",
        "train.global_batch_size=12",
        "train.train_iters=2",
        f"model.logits_chunk_tokens={chunk}",
        *extra,
    ]
    rows, trainer = train_in_process(world, tmp_path / f"chunk{chunk}", overrides)
    weights = torch.cat([full_tensor(p.detach()).reshape(-1) for p in trainer.model.parameters()])
    return rows, weights, trainer.model


SETTINGS = {
    "ce_tied": [],
    "ce_untied": ["model.tie_embeddings=false"],
    "ce_padded_vocab": ["data.append_eod=true"],  # 257 ids in 384 rows
    "policy_entropy": [
        "loss.type=policy",
        "loss.old_logprobs=detach",
        "loss.entropy_coef=0.01",
        "loss.temperature=0.7",
        "model.tie_embeddings=false",
    ],
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_the_trainer_gives_the_unchunked_numbers(world, tmp_path, setting):
    extra = list(SETTINGS[setting])
    if setting != "ce_tied":
        extra.append(f"data.path={_rows(tmp_path / 'rows.jsonl', policy=setting.startswith('policy'))}")
        if setting.startswith("ce"):
            extra.append("data.valid_fraction=0")
    results = {chunk: _train(world, tmp_path, chunk, extra) for chunk in (0, 7, 100)}  # 7 divides no row
    base_rows, base_weights, model = results[0]
    if setting == "ce_padded_vocab":
        assert output_settings(model).vocab_limit == 257 and model.embedding.word_embeddings.weight.shape[0] == 384
    keys = ["loss", "grad_norm"] + (["pg_loss", "entropy"] if setting.startswith("policy") else [])
    for chunk in (7, 100):
        rows, weights, _ = results[chunk]
        for a, b in zip(rows, base_rows):
            for key in keys:
                assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (chunk, key)
        assert float((weights - base_weights).norm() / base_weights.norm()) <= 1e-6


def test_the_probe_measures_the_output_layer_per_token_cost_falling(world):
    """A 1 x 64 model with Qwen3's 151,936-token vocabulary: without chunking the logits (and their
    softmax and gradient) cost at least 608 KB a token; with 64-token chunks the probe's fitted cost a
    token is well under half of that (the chunk's buffers are a constant, not a per-token cost)."""
    from backend.model.factory import build_model
    from backend.train.memory_meter import MemoryMeter, resident_tensors
    from backend.train.memory_probe import probe_memory
    from backend.train.optim import build_optimizer

    fits = {}
    for chunk in (0, 64):
        cfg = validate(
            load_config(
                TINY,
                [
                    "model.vocab_size=151936",
                    "model.num_layers=1",
                    "data.max_seq_length=256",
                    "train.dynamic_batch_enable=true",
                    "train.max_tokens_per_gpu=auto",
                    "train.memory_limit_gib=8",
                    f"model.logits_chunk_tokens={chunk}",
                ],
            )
        )
        built = build_model(cfg, world, tokenizer_vocab=256)
        assert output_settings(built.model).vocab_limit is None  # a vocabulary the user sized: every row in the softmax
        optimizer = build_optimizer(built.model, cfg.optimizer)
        meter = MemoryMeter(world.device, resident_tensors(built.model, optimizer))
        fits[chunk] = probe_memory(built.model, optimizer, cfg, world, backend=built.attention_backend, meter=meter)
    whole, chunked = fits[0].fit.b, fits[64].fit.b
    assert whole > 151936 * 4  # at least one FP32 copy of the logits, a token
    assert chunked < 0.5 * whole, (chunked, whole)
    assert fits[64].budget >= fits[0].budget, (fits[64].budget, fits[0].budget)
    print(f"bytes a token: {whole:,.0f} whole, {chunked:,.0f} chunked; budgets {fits[0].budget} -> {fits[64].budget}")


@pytest.mark.parametrize("entropy", ["", "grad"])
def test_bf16_gradients_match_the_unchunked_path_on_confident_tokens(entropy):
    """BF16 compute, labels the model is confident of (p ~ 0.999): the logits' gradient g (1 - p_y)
    must be formed in FP32 before rounding (BF16 steps are 2^-8 near 1, so a rounded p_y of 1 would
    zero the label's term and bias every gradient). Against autograd through the unchunked path."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(24, 32, generator=g).bfloat16()
    w = (0.1 * torch.randn(70, 32, generator=g)).bfloat16()
    labels = torch.randperm(70, generator=g)[:24]
    w[labels] += 0.45 * h.float().sign().bfloat16()  # each token's own label row aligned with it: confident
    coef = torch.randn(24, generator=g)
    grads = {}
    for name in ("unchunked", "chunked"):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if name == "chunked":
            lp, ent = chunked_logprobs(hh, ww, labels, chunk=5, entropy=entropy or "")
        else:
            logp = torch.log_softmax((hh @ ww.t()).float(), dim=-1)
            lp, ent = logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
        loss = (coef * lp).sum() + (0.3 * ent.sum() if entropy else 0.0)
        loss.backward()
        grads[name] = (hh.grad.float(), ww.grad.float(), lp.detach())
    p_label = grads["unchunked"][2].exp()
    assert float(p_label.median()) > 0.99 and float(p_label.max()) < 1.0  # confident, not saturated
    for a, b in zip(grads["chunked"][:2], grads["unchunked"][:2]):
        assert float((a - b).norm() / b.norm()) < 0.02, float((a - b).norm() / b.norm())


def test_a_fused_kernel_is_refused_by_name_where_it_cannot_run(world):
    """model.logits_fused_kernel=liger on CPU (Liger's kernels are Triton, CUDA only): a config
    error naming the key, never a silent fall-back; unknown kernels are refused by validation.
    The kernel itself is compared with the chunked path in tests/gpu (a CUDA device)."""
    from backend.config import ConfigError
    from backend.model.factory import build_model

    cfg = validate(load_config(TINY, ["model.logits_fused_kernel=liger"]))
    with pytest.raises(ConfigError, match="model.logits_fused_kernel=liger: .*CUDA"):
        build_model(cfg, world, tokenizer_vocab=256)
    with pytest.raises(ConfigError, match="model.logits_fused_kernel='other': allowed values are none, liger"):
        validate(load_config(TINY, ["model.logits_fused_kernel=other"]))
