"""PPO's critic: the value loss and GAE against plain computations, and a value model through
Hugging Face (``transformers``' token classification with one label is the yardstick):

- ``value_token_terms`` is 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2) per loss token;
- GAE against a plain loop, with masked tokens inside a response and rows of different lengths;
- import from a ``transformers`` ``Qwen3ForTokenClassification`` (one label) gives its values
  within 1e-5; an import from a causal LM keeps its decoder and initialises the head;
- export (``tools/export_hf.py``'s library call) writes a directory
  ``AutoModelForTokenClassification`` loads, reproducing the backend's values within 1e-5.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from backend.config import load_config, validate
from backend.config.schema import LossConfig
from backend.loss.value import value_token_terms
from backend.rl.advantages import gae
from tests.conftest import TINY


def test_value_terms_are_the_clipped_formula():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(3, 9, generator=g, dtype=torch.float64, requires_grad=True)
    ret = torch.randn(3, 9, generator=g, dtype=torch.float64)
    old = v.detach() + 0.8 * torch.randn(3, 9, generator=g, dtype=torch.float64)
    mask = (torch.rand(3, 9, generator=g) > 0.3).double()
    weight = mask * (0.5 + torch.rand(3, 9, generator=g, dtype=torch.float64))
    for c in (0.0, 0.2):
        terms = value_token_terms(
            v,
            loss_mask=mask,
            loss_weight=weight,
            returns=ret,
            old_values=old,
            cfg=LossConfig(type="value", value_clip=c),
        )
        for i in range(3):
            for t in range(9):
                if not mask[i, t]:
                    assert float(terms["objective"][i, t]) == 0.0
                    continue
                x, r, o = float(v[i, t]), float(ret[i, t]), float(old[i, t])
                if c:
                    clipped = o + max(-c, min(c, x - o))
                    want = 0.5 * max((x - r) ** 2, (clipped - r) ** 2)
                    assert bool(terms["clipped"][i, t]) == ((clipped - r) ** 2 > (x - r) ** 2)
                else:
                    want = 0.5 * (x - r) ** 2
                assert float(terms["objective"][i, t]) == pytest.approx(float(weight[i, t]) * want, rel=1e-12)
    assert 0 < float(terms["clipped"].sum()) < float(mask.sum())  # both kinds: not vacuous


def _plain_gae(rewards, values, mask, gamma, lam):
    """The textbook recursion over the trained tokens only (masked ones skipped), written out."""
    trained = [t for t in range(len(rewards)) if mask[t]]
    adv = {}
    for k in range(len(trained) - 1, -1, -1):
        t = trained[k]
        nxt = trained[k + 1] if k + 1 < len(trained) else None
        v_next = values[nxt] if nxt is not None else 0.0
        a_next = adv[nxt] if nxt is not None else 0.0
        adv[t] = rewards[t] + gamma * v_next - values[t] + gamma * lam * a_next
    return [adv.get(t, 0.0) for t in range(len(rewards))]


@pytest.mark.parametrize("length, masked", [(1, ()), (6, ()), (9, (2, 3, 7)), (12, (0, 11))])
def test_gae_against_a_plain_loop(length, masked):
    rng = np.random.default_rng(length)
    rewards, values = rng.normal(size=length), rng.normal(size=length)
    mask = np.ones(length, dtype=bool)
    mask[list(masked)] = False
    for gamma, lam in ((1.0, 0.95), (0.9, 1.0), (0.99, 0.0)):
        adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
        want = _plain_gae(rewards, values, mask, gamma, lam)
        assert np.allclose(adv, want, rtol=1e-12, atol=1e-12)
        assert np.allclose(ret[mask], adv[mask] + values[mask]) and np.all(ret[~mask] == 0)
    if length > 1 and not masked:  # lam = 1, gamma = 1: the advantage is the return-to-go minus the value
        adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
        assert np.allclose(adv, np.cumsum(rewards[::-1])[::-1] - values)


@pytest.fixture(scope="module")
def token_classifier(tmp_path_factory):
    """A tiny random Qwen3 token classifier (one label) and a causal LM, saved with save_pretrained."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3ForTokenClassification

    root = tmp_path_factory.mktemp("value_hf")
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    critic = Qwen3ForTokenClassification(Qwen3Config(num_labels=1, **kw)).eval()
    critic.score.bias.data.fill_(0.25)  # a bias that is not its initial 0: the import must read it
    critic.save_pretrained(root / "critic")
    lm = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
    lm.save_pretrained(root / "lm")
    return root, critic, lm


def _our_values(world, hf_dir, tokens):
    from backend.data.collate import MicrobatchTensors
    from backend.loss.outputs import microbatch_values
    from backend.model.factory import build_model

    cfg = validate(
        load_config(
            TINY, [f"model.hf_checkpoint={hf_dir}", "data.tokenizer=byte", "model.head=value", "loss.type=value"]
        )
    )
    model = build_model(cfg, world, tokenizer_vocab=256, training=False).model
    b, s = tokens.shape
    mb = MicrobatchTensors(
        tokens=tokens,
        labels=tokens,
        loss_mask=torch.ones(b, s),
        loss_weight=torch.ones(b, s),
        position_ids=torch.arange(s)[None].expand(b, s),
        valid=torch.ones(b, s, dtype=torch.bool),
        seq_lengths=torch.full((b,), s),
        sample_ids=torch.arange(b),
        padded_len=s,
    )
    with torch.no_grad():
        return cfg, model, microbatch_values(model, mb, route_rows=mb.sample_ids >= 0)


def test_import_from_a_token_classifier_gives_its_values(world, token_classifier):
    root, critic, _ = token_classifier
    tokens = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    _, _, ours = _our_values(world, root / "critic", tokens)
    with torch.no_grad():
        theirs = critic(input_ids=tokens).logits[..., 0]
    assert float((ours - theirs).abs().max()) <= 1e-5


def test_import_from_a_causal_lm_initialises_the_head(world, token_classifier):
    root, _, lm = token_classifier
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(2))
    cfg, model, values = _our_values(world, root / "lm", tokens)

    def full(t):  # FSDP2 leaves the root's parameters unsharded after a forward
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

    head = model.output_layer
    assert torch.all(full(head.bias) == 0) and 0 < float(full(head.weight).std()) < 0.1
    emb = full(model.embedding.word_embeddings.weight)
    assert torch.equal(emb, lm.model.embed_tokens.weight.detach())  # the decoder is the causal LM's
    assert torch.isfinite(values).all()


def test_export_loads_as_a_token_classifier_with_the_same_values(world, token_classifier, tmp_path):
    """Train the imported critic one step (values move), save, export: transformers reproduces them."""
    from transformers import AutoModelForTokenClassification

    from backend.checkpoint.hf_export import export_checkpoint
    from backend.rl import ValueWorker

    root, _, _ = token_classifier
    rows = []
    rng = np.random.default_rng(3)
    for _ in range(6):
        n = int(rng.integers(8, 30))
        rows.append(
            {
                "input_ids": rng.integers(0, 256, n).tolist(),
                "loss_mask": [0] * 3 + [1] * (n - 3),
                "returns": [None] * 3 + rng.normal(size=n - 3).tolist(),
                "old_values": [0.0] * n,
            }
        )
    overrides = [
        f"model.hf_checkpoint={root / 'critic'}",
        "data.tokenizer=byte",
        "model.head=value",
        "loss.type=value",
        "train.dynamic_batch_enable=true",
        "train.max_tokens_per_gpu=256",
        "optimizer.lr=0.01",
        "scheduler.warmup_iters=0",
        f"logger.run_dir={tmp_path / 'run'}",
    ]
    worker = ValueWorker.from_config(TINY, overrides, env=world)
    try:
        before = worker.values(rows)
        row = worker.train_step(rows)
        after = worker.values(rows)
        assert row["vf_loss"] > 0 and max(float(np.nanmax(np.abs(a - b))) for a, b in zip(after, before)) > 1e-4
        out = export_checkpoint(worker.save(), worker.cfg, tmp_path / "hf", world, dtype="fp32")
    finally:
        worker.close()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForTokenClassification"] and config["num_labels"] == 1
    exported = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32).eval()
    for r, ours in zip(rows, after):
        with torch.no_grad():
            theirs = exported(input_ids=torch.tensor([r["input_ids"]])).logits[0, :-1, 0].numpy()
        assert np.max(np.abs(ours[1:] - theirs)) <= 1e-5  # entry t values the state before token t
