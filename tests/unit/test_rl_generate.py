"""The in-process generator fed by the worker's weight stream (one gloo process, CPU, FP32):

- after a weight load its logits equal a ``transformers`` model loaded from the exported
  directory (``tools/export_hf.py``'s library call), bitwise;
- sampling is a function of the seed; the sampler's log-probabilities are the trainer's to FP32
  rounding, for one prompt and for a left-padded batch of prompts; ids past the tokenizer's vocabulary are never sampled; stop ids end a response;
- a weight stream with a missing, unknown or misshapen tensor is refused, naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.bench.rl_rows import rl_rows
from backend.generators.hf import HFGenerator
from backend.rl import PolicyWorker
from tests.conftest import TINY

OVERRIDES = [
    "loss.type=policy",
    "loss.old_logprobs=detach",
    "data.max_seq_length=128",
    "train.dynamic_batch_enable=true",
    "train.max_tokens_per_gpu=512",
    "optimizer.lr=0.01",
    "scheduler.warmup_iters=0",
]
PROMPT = list(b"def add(a, b):")


@pytest.fixture(scope="module")
def trained(world, tmp_path_factory, embedded_cache):
    """A worker after one step (so the weights are not the initial ones) and a generator synced to it."""
    run = tmp_path_factory.mktemp("rl_generate")
    worker = PolicyWorker.from_config(TINY, [*OVERRIDES, f"logger.run_dir={run}"], env=world)
    rows = rl_rows(8, seed=4, max_len=60)
    for r in rows:
        del r["old_logprobs"], r["ref_logprobs"]
    worker.train_step(rows)
    gen = HFGenerator.from_worker(worker)
    yield worker, gen, run
    worker.close()


def test_generator_logits_equal_transformers_on_the_exported_directory(trained, world, tmp_path):
    from transformers import AutoModelForCausalLM

    from backend.checkpoint.hf_export import export_checkpoint

    worker, gen, _ = trained
    step_dir = worker.save()
    out = export_checkpoint(step_dir, worker.cfg, tmp_path / "hf", world, dtype="fp32")
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([PROMPT + list(b" return a + b\n")])
    with torch.no_grad():
        want = reference(input_ids=ids).logits.float()
    assert torch.equal(gen.logits(ids), want)


def test_sampling_follows_the_seed_and_reports_the_trainers_logprobs(trained):
    worker, gen, _ = trained
    a = gen.generate(PROMPT, 6, 0.7, 12, seed=3)
    b = gen.generate(PROMPT, 6, 0.7, 12, seed=3)
    c = gen.generate(PROMPT, 6, 0.7, 12, seed=4)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert all(len(x.token_ids) == len(x.logprobs) == 12 and not x.stopped for x in a)
    # At T = 1 the sampler's distribution is the policy's: its log-probabilities are the worker's.
    ones = gen.generate(PROMPT, 4, 1.0, 12, seed=5)
    rows = [{"input_ids": PROMPT + x.token_ids} for x in ones]
    for x, lp in zip(ones, worker.logprobs(rows)):
        assert np.max(np.abs(np.asarray(x.logprobs) - lp[len(PROMPT) :])) <= 2e-6
    # At T = 0.7 the sampler's are log softmax(logits / 0.7): the worker's at that temperature.
    rows = [{"input_ids": PROMPT + x.token_ids} for x in a]
    for x, lp in zip(a, worker.logprobs(rows, temperature=0.7)):
        assert np.max(np.abs(np.asarray(x.logprobs) - lp[len(PROMPT) :])) <= 2e-6


def test_a_batch_of_prompts_samples_each_as_alone_and_reports_the_trainers_logprobs(trained):
    """generate_batch: prompts of different lengths left-padded into one batch; each prompt's
    draws come from its own seed (its samples as when generated alone, up to a flip where FP32
    rounding of the padded batch moves a probability across a draw), and every sampled token's
    log-probability is the trainer's at T = 1."""
    worker, gen, _ = trained
    prompts = [PROMPT, list(b"x = "), list(b"class Point:\n    def __init__(self")]
    seeds = [11, 12, 13]
    batch = gen.generate_batch(prompts, 4, 1.0, 10, seeds)
    alone = [gen.generate(p, 4, 1.0, 10, seed=s) for p, s in zip(prompts, seeds)]
    assert [len(b) for b in batch] == [4, 4, 4]
    same = sum(x.token_ids == y.token_ids for b, a in zip(batch, alone) for x, y in zip(b, a))
    assert same >= 10, same  # 12 responses; rounding may flip a late draw, not the seeds' streams
    for prompt, completions in zip(prompts, batch):
        rows = [{"input_ids": prompt + x.token_ids} for x in completions]
        for x, lp in zip(completions, worker.logprobs(rows)):
            assert np.max(np.abs(np.asarray(x.logprobs) - lp[len(prompt) :])) <= 2e-5
    assert gen.generate_batch([], 4, 1.0, 10, []) == []


def test_vocabulary_limit_and_stop_ids(trained):
    worker, _, _ = trained
    gen = HFGenerator(worker.hf_config(), vocab_limit=100, stop_token_ids=[ord(" "), ord("\n")])
    gen.load_weights(worker.hf_weights())
    out = gen.generate(PROMPT, 16, 1.0, 20, seed=1)
    assert all(t < 100 for x in out for t in x.token_ids)
    for x in out:
        inner = x.token_ids[:-1]
        assert not ({ord(" "), ord("\n")} & set(inner))  # nothing after the first stop id
        assert x.stopped == (x.token_ids[-1] in (ord(" "), ord("\n")))
    assert any(x.stopped for x in out) and any(len(x.token_ids) < 20 for x in out)


def test_a_bad_weight_stream_is_refused_naming_the_tensor(trained):
    worker, gen, _ = trained
    pairs = list(worker.hf_weights())
    with pytest.raises(KeyError, match="lacked 1 parameter"):
        gen.load_weights(pairs[1:])
    with pytest.raises(KeyError, match="no parameter 'model.bogus.weight'"):
        gen.load_weights([*pairs, ("model.bogus.weight", torch.zeros(1))])
    name, tensor = pairs[0]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        gen.load_weights([(name, tensor[:-1]), *pairs[1:]])
    stats = gen.load_weights(pairs)  # a complete stream still loads
    assert stats.tensors == len(pairs) and stats.bytes == sum(t.numel() * 4 for _, t in pairs)


def test_an_imported_checkpoints_sampler_covers_the_trainers_softmax(world, tmp_path, embedded_cache):
    """A checkpoint's rows past its tokenizer's ids (Qwen3: 151,936 rows for 151,669 tokens; here
    300 rows for a 10-id tokenizer) are in the trainer's softmax, as in transformers and vLLM, so the
    sampler draws from them too: its log-probabilities are the trainer's, not a renormalised subset's."""
    from tests.conftest import REPO
    from tests.helpers.hf_tiny import tiny_hf_model

    tiny_hf_model("qwen3", tmp_path / "ckpt", tokenizer=True)
    worker = PolicyWorker.from_config(
        str(REPO / "tests" / "configs" / "hf_tiny.yaml"),
        [
            f"model.hf_checkpoint={tmp_path / 'ckpt'}",
            "loss.type=policy",
            "loss.old_logprobs=detach",
            f"logger.run_dir={tmp_path / 'run'}",
        ],
        env=world,
    )
    try:
        assert worker.sampling_vocab is None and worker.tokenizer.vocab_size < worker.hf_config()["vocab_size"]
        gen = HFGenerator.from_worker(worker)
        prompt = worker.tokenizer.encode("hello")
        out = gen.generate(prompt, 4, 1.0, 8, seed=1)
        for x, lp in zip(out, worker.logprobs([{"input_ids": prompt + x.token_ids} for x in out])):
            assert np.max(np.abs(np.asarray(x.logprobs) - lp[len(prompt) :])) <= 2e-6
    finally:
        worker.close()
