"""The RL step's fast paths compute what the paths before them computed, to FP32 rounding:

- SDPA: a packed row's sequences batched by length (``causal_groups``, one causal call per group)
  against one call per sequence, and right-padded rows under the causal kernel against the dense
  mask: outputs and q / k / v gradients of real tokens within 1e-5;
- the generator: a prompt prefilled once for its n samples against n prefills (the same sampled
  tokens, log-probabilities within 1e-5); ``sample_rows`` against ``torch.multinomial`` (the same
  draws, bit for bit); ``inverse_cdf_rows`` draws each id at its probability (200,000 draws,
  within 5 standard deviations) and never an id of probability 0;
- reward calls in one thread: values in order, the first failing call named.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from backend.generators.hf import HFGenerator, inverse_cdf_rows, sample_rows
from backend.model.attention import sdpa
from backend.model.attention.context import AttentionContext
from backend.model.attention.masks import dense_mask
from backend.rl.reward import RewardError, score_all


def _packed_ctx(lengths, pads, tail):
    row = sum(pads) + tail
    pos = torch.zeros(1, row, dtype=torch.long)
    seg = torch.full((1, row), -1, dtype=torch.long)
    valid = torch.zeros(1, row, dtype=torch.bool)
    at = 0
    for i, (n, p) in enumerate(zip(lengths, pads)):
        pos[0, at : at + n] = torch.arange(n)
        seg[0, at : at + p] = i
        valid[0, at : at + n] = True
        at += p
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_pad = torch.tensor([0, *torch.tensor(pads).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionContext(positions=pos, valid=valid, segment_ids=seg, cu_seqlens=cu, cu_seqlens_padded=cu_pad)


def _attend(fast: bool, q, k, v, make_ctx):
    """The kernel's output and the gradients of a fixed weighting of its real outputs."""
    old = sdpa.CAUSAL_FAST_PATHS
    sdpa.CAUSAL_FAST_PATHS = fast
    try:
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        ctx = make_ctx()
        out = sdpa.sdpa_attention(q, k, v, ctx, 0.3)
        weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape) * ctx.valid[:, None, :, None]
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        return out * ctx.valid[:, None, :, None], grads
    finally:
        sdpa.CAUSAL_FAST_PATHS = old


@pytest.mark.parametrize("seed", range(4))
def test_packed_sequences_batched_by_length_equal_one_call_each(seed):
    rnd = random.Random(seed)
    lengths = [rnd.randint(1, 40) for _ in range(rnd.randint(2, 40))] + [300, 2, 290][: seed % 4]
    pads = [n + rnd.choice([0, 0, 1, 3]) for n in lengths]  # some sequences padded, some not
    tail = rnd.choice([0, 5])  # padding after the last sequence, or none
    make = lambda: _packed_ctx(lengths, pads, tail)  # noqa: E731
    ctx = make()
    s = ctx.positions.shape[1]
    g = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(1, 4, s, 8, generator=g),
        torch.randn(1, 2, s, 8, generator=g),
        torch.randn(1, 2, s, 8, generator=g),
    )
    fast_out, fast_grads = _attend(True, q, k, v, make)
    slow_out, slow_grads = _attend(False, q, k, v, make)
    assert fast_out.shape == slow_out.shape
    assert (fast_out - slow_out).abs().max() <= 1e-5
    for a, b in zip(fast_grads, slow_grads):
        assert (a - b).abs().max() <= 1e-5


def test_causal_groups_cover_every_real_place_once_and_bound_the_padding():
    lengths, starts = [12, 3, 300, 11, 290, 5], [0, 12, 15, 315, 326, 616]
    groups, order = sdpa.causal_groups(lengths, starts, row=630)
    real_outputs = sum(len(real) for _, _, _, real in groups)
    assert real_outputs == sum(lengths)
    covered = {starts[i] + t for i, n in enumerate(lengths) for t in range(n)}
    assert sorted(p for p in range(630) if order[p] != real_outputs) == sorted(covered)
    assert all(order[p] == real_outputs for p in range(621, 630))  # the row's tail: the zero slot
    for g, longest, gather, real in groups:
        assert len(gather) == g * longest and len(real) <= len(gather)
    # the 300 and 290 share a group; the short ones do not pad to 300
    assert sorted(longest for _, longest, _, _ in groups) == [12, 300]
    # a sequence of no token is left out (its places, none, read nothing)
    groups, order = sdpa.causal_groups([0, 5], [0, 0], row=6)
    assert [(g, n, gather) for g, n, gather, _ in groups] == [(1, 5, [0, 1, 2, 3, 4])] and order == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("lengths", [(7, 7, 7), (1, 30, 12, 29)])
def test_right_padded_rows_under_the_causal_kernel_equal_the_dense_mask(lengths):
    b, s = len(lengths), max(lengths)
    valid = torch.arange(s)[None, :] < torch.tensor(lengths)[:, None]

    def make():
        return AttentionContext(positions=torch.arange(s).repeat(b, 1), valid=valid)

    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(b, 4, s, 8, generator=g),
        torch.randn(b, 2, s, 8, generator=g),
        torch.randn(b, 2, s, 8, generator=g),
    )
    fast_out, fast_grads = _attend(True, q, k, v, make)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(make()), scale=0.3, enable_gqa=True)
    slow_out, slow_grads = _attend(False, q, k, v, make)
    assert torch.equal(slow_out, ref * valid[:, None, :, None])
    assert (fast_out - slow_out).abs().max() <= 1e-5
    for a, b_ in zip(fast_grads, slow_grads):
        assert (a - b_).abs().max() <= 1e-5


def test_sample_rows_draws_what_multinomial_draws():
    for trial in range(20):
        prompts, n, vocab = 5, 4, 300 + trial
        logits = torch.randn(prompts * n, vocab) * 3
        logits[:, vocab - 5 :] = float("-inf")
        probs = torch.log_softmax(logits, -1).exp()
        seeds = [1000 * trial + p for p in range(prompts)]
        want = torch.cat(
            [
                torch.multinomial(probs[p * n : (p + 1) * n], 1, generator=torch.Generator().manual_seed(s))
                for p, s in enumerate(seeds)
            ]
        ).squeeze(1)
        got = sample_rows(probs, [torch.Generator().manual_seed(s) for s in seeds], n)
        assert torch.equal(got, want)


def test_inverse_cdf_draws_each_id_at_its_probability_and_never_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3 - 1e-4, 1e-4, 0.0])
    draws = 200_000
    g = torch.Generator().manual_seed(0)
    tokens = inverse_cdf_rows(probs.expand(draws, -1), torch.rand(draws, generator=g, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    sigma = (draws * probs.double() * (1 - probs.double())).sqrt()
    assert ((counts - draws * probs.double()).abs() <= 5 * sigma + 1e-9).all(), counts.tolist()
    assert counts[probs == 0].sum() == 0
    edges = inverse_cdf_rows(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64))
    assert edges.tolist() == [1, 5]  # the first and the last id of positive probability
    with pytest.raises(ValueError, match="not finite"):
        inverse_cdf_rows(torch.tensor([[0.5, float("nan")]]), torch.tensor([0.3], dtype=torch.float64))


def test_a_prompt_prefilled_once_samples_what_n_prefills_sample():
    from tests.helpers.hf_tiny import tiny_hf_config

    cfg = tiny_hf_config("qwen3").to_dict()
    torch.manual_seed(0)
    gen = HFGenerator(cfg, stop_token_ids=[3])
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    out = {}
    for shared in (True, False):
        gen.share_prompt_prefill = shared
        out[shared] = gen.generate_batch(prompts, 6, 1.0, 10, seeds=[1, 2, 3])
    del gen.share_prompt_prefill
    for a_list, b_list in zip(out[True], out[False]):
        for a, b in zip(a_list, b_list):
            assert a.token_ids == b.token_ids and a.stopped == b.stopped
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) <= 1e-5


def test_reward_calls_in_one_thread_keep_their_order_and_name_the_failing_call():
    def reward(prompt, response, row):
        if response == "bad":
            raise ValueError("no")
        return len(response)

    calls = [("p", r, {}, f"sample {i}") for i, r in enumerate(["a", "bb", "ccc"])]
    assert score_all(reward, "r.py:reward", calls, timeout_s=5) == [1.0, 2.0, 3.0]
    assert score_all(reward, "r.py:reward", calls, timeout_s=0) == [1.0, 2.0, 3.0]
    bad = [*calls[:2], ("p", "bad", {}, "sample 2"), ("p", "d", {}, "sample 3")]
    for timeout in (5, 0):
        with pytest.raises(
            RewardError, match=r"raised ValueError: no at \S*test_causal_fast_paths.py:\d+ \(on sample 2\)"
        ):
            score_all(reward, "r.py:reward", bad, timeout_s=timeout)


def test_a_timed_out_batch_makes_no_further_call_and_names_the_hung_one():
    import time

    called = []

    def reward(prompt, response, row):
        called.append(response)
        if response == "slow":
            time.sleep(1.0)
        return 1.0

    calls = [("p", r, {}, f"sample {i}") for i, r in enumerate(["a", "slow", "b", "c"])]
    with pytest.raises(RewardError, match=r"no result after 0\.[3-9] s \(rl.reward_timeout_s=0.3\) on sample 1"):
        score_all(reward, "r.py:reward", calls, timeout_s=0.3)
    assert score_all(reward, "r.py:reward", [("p", "d", {}, "sample 0")], timeout_s=5) == [1.0]  # a new thread
    time.sleep(1.2)  # the hung call has returned by now: its batch was cancelled
    assert called == ["a", "slow", "d"]
