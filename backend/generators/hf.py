"""The embedded generator: a ``transformers`` causal LM in the trainer's process, fed by the
policy's Hugging Face weight stream (never a file), sampling with its own log-probabilities.

Built once from the policy's HF config (``PolicyWorker.hf_config``), then after every optimizer
step ``load_weights(worker.hf_weights())`` copies each ``(HF name, full tensor)`` pair into the
matching parameter: the contract vLLM's ``model.load_weights`` and SGLang's weight updates take,
so ``vllm_local.VLLMGenerator`` is a drop-in on the same stream.

Sampling is plain ancestral sampling from softmax(logits / T) over the tokenizer's ids (ids the
model has beyond the tokenizer's vocabulary, padding rows of the embedding, are never sampled: a
row must hold tokenizer ids. The trainer keeps them out of its softmax too for the rows we padded;
an imported checkpoint's extra rows (Qwen3: 151,669 ids in 151,936 rows) stay in the trainer's
softmax, as in transformers, so their probability mass shows up in the mismatch metrics),
with a KV cache, every prompt's ``n`` samples of a rank in one batch (``generate_batch``: prompts
left-padded), a ``torch.Generator`` seeded per prompt (the same seed gives the same responses on
any rank, in any batch), and
each sampled token's log-probability under that distribution returned beside it: what the
sampler saw, for ``rollout_logprobs``.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from backend.generators.results import Completion, SyncStats  # noqa: F401 (the generators' results, here too)


def checked_stream(
    weights: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]], model: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """The weight stream as given, each pair checked against the generator model's names and
    shapes before it is passed on: an unknown, repeated, misshapen or (at the end) missing tensor
    is an error naming it. Both generators take their weights through it."""
    seen: set[str] = set()
    for name, tensor in weights:
        if name not in shapes:
            raise KeyError(f"generator: no parameter {name!r} in the {model} model")
        if name in seen:
            raise KeyError(f"generator: {name!r} given twice")
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(f"generator: {name} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}")
        seen.add(name)
        yield name, tensor
    missing = sorted(set(shapes) - seen)
    if missing:
        raise KeyError(f"generator: the weight stream lacked {len(missing)} parameter(s): {', '.join(missing[:5])}")


#: Uniforms drawn per prompt and row UNIFORM_CHUNK tokens at a time (one call per prompt then,
#: not per token; 64 x 8 bytes a row held, not max_new_tokens x 8).
UNIFORM_CHUNK = 64


def inverse_cdf_rows(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` [rows, vocab]: the first id whose cumulative probability
    (summed in FP64, so ids of probability 1e-12 keep their share) exceeds ``uniforms`` [rows]
    (in [0, 1)) times the row's total. Exact sampling from the row's distribution, from one
    uniform a row: a multinomial draws a vocabulary's worth of exponentials a row (64 rows x 300
    ids took 0.4 ms a token on one CPU thread; 64 x 151,936, Qwen3's, would take 200 ms). Ids of
    probability 0 are never returned (the search goes past every flat stretch of the sum)."""
    cdf = probs.double().cumsum(dim=-1)
    if not bool(torch.isfinite(cdf[:, -1]).all()):  # what torch.multinomial refuses too
        raise ValueError("generator: the sampling probabilities are not finite (the policy's logits hold NaN or inf)")
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def sample_rows(probs: torch.Tensor, rngs: Sequence[torch.Generator], n: int) -> torch.Tensor:
    """One token per row of ``probs`` [len(rngs) x n, vocab], rows g*n .. g*n+n-1 drawn with
    ``rngs[g]``: ``torch.multinomial(probs[rows], 1, generator=rngs[g])``'s very draws (its
    one-sample path: argmax(p / q), q ~ Exp(1) drawn by the generator over the rows' [n, vocab]
    block), with one division and one argmax for the whole batch instead of a multinomial call
    (and its validity check, a device sync) per prompt: 64 calls were 4.6 ms of the tiny GRPO
    demo's 26 ms generation."""
    q = torch.empty_like(probs)
    for g, rng in enumerate(rngs):
        q[g * n : (g + 1) * n].exponential_(1, generator=rng)
    return torch.div(probs, q, out=q).argmax(dim=-1)


class HFGenerator:
    """A transformers causal LM kept in step with the policy by ``load_weights``."""

    #: Prefill each prompt once and repeat its KV cache for its n samples (vLLM's prefix caching,
    #: for the samples of one prompt): the prompt's forward is done 1 time instead of n. On the
    #: tiny GRPO task's 4-layer x 512 model that was 42% of the generation's token forwards.
    #: False runs the n copies (the same numbers to FP32 rounding; kept for comparisons).
    share_prompt_prefill = True
    #: "inverse_cdf" (``inverse_cdf_rows``: one uniform a row and token, drawn per prompt up front)
    #: or "multinomial" (``sample_rows``: torch.multinomial's draws, the sampler before; the same
    #: distribution, other tokens for the same seed).
    sampler = "inverse_cdf"

    def __init__(
        self,
        hf_config: dict,
        *,
        vocab_limit: int | None = None,
        stop_token_ids: Sequence[int] = (),
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
    ):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model(**hf_config)
        config._attn_implementation = attn_implementation
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(self.device).eval()
        self.model.requires_grad_(False)
        self.vocab_limit = vocab_limit
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._params = dict(self.model.named_parameters())  # tied: lm_head shares embed_tokens, listed once
        # transformers 5.2x names the KV cache ``cache`` (``past_key_values`` still works, with a warning)
        params = inspect.signature(self.model.forward).parameters
        self._cache_key = "cache" if "cache" in params else "past_key_values"
        # the prefill's logits at each row's last place only (not a [rows, prompt, vocab] tensor)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    @classmethod
    def from_worker(cls, worker, **kwargs) -> HFGenerator:
        """A generator for ``worker``'s policy, with its current weights loaded."""
        gen = cls(worker.hf_config(), vocab_limit=worker.sampling_vocab, device=worker.env.device, **kwargs)
        gen.load_weights(worker.hf_weights())
        return gen

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> SyncStats:
        """Copy every (HF name, full tensor) pair into the model; each parameter exactly once, or an
        error naming the first unknown, repeated or missing one. Returns what moved and how long."""
        start = time.perf_counter()
        count = size = 0
        shapes = {name: tuple(p.shape) for name, p in self._params.items()}
        with torch.no_grad():
            for name, tensor in checked_stream(weights, shapes, type(self.model).__name__):
                self._params[name].copy_(tensor)
                count += 1
                size += tensor.numel() * tensor.element_size()
        return SyncStats(count, size, time.perf_counter() - start)

    def close(self) -> None:
        """Nothing to release: the model lives in this process and goes with it."""

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits [b, s, vocab] of ``input_ids`` (FP32)."""
        return self.model(input_ids=input_ids.to(self.device)).logits.float()

    def generate(
        self, prompt_ids: Sequence[int], n: int, temperature: float, max_new_tokens: int, seed: int
    ) -> list[Completion]:
        """``n`` responses to one prompt (``generate_batch`` of one prompt)."""
        return self.generate_batch([prompt_ids], n, temperature, max_new_tokens, [seed])[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        temperature: float,
        max_new_tokens: int,
        seeds: Sequence[int],
    ) -> list[list[Completion]]:
        """``n`` responses to each prompt, all in one batch: prompts left-padded to the longest
        (masked, positions counted from each prompt's first token), one forward per new token for
        every row at once (one prompt at a time took 2.1x the generation time of TRL's one batched
        call on the tiny GRPO task), each prompt's prefill done once for its n samples
        (``share_prompt_prefill``). Prompt p's samples draw from a ``torch.Generator`` seeded
        with ``seeds[p]``, so a prompt's random draws do not depend on which other prompts share
        its batch or rank (its logits may, by FP32 rounding: the padding is masked, not absent). Sampled at ``temperature`` (> 0) for up to ``max_new_tokens`` tokens,
        a response ending at its first stop id."""
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}: must be > 0 (sampling)")
        if not prompts:
            return []
        if any(not len(p) for p in prompts):
            raise ValueError("an empty prompt: give at least one token")
        rngs = [torch.Generator(device=self.device).manual_seed(int(s)) for s in seeds]
        uniforms = None  # inverse_cdf: UNIFORM_CHUNK tokens' uniforms a row at a time, each prompt's from its generator
        longest = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (longest - len(p)) + list(p) for p in prompts], dtype=torch.long, device=self.device)
        mask = torch.tensor(
            [[0] * (longest - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=self.device
        )
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        # each prompt once and its KV cache then repeated for its n samples, or the n copies prefilled
        copies = 1 if self.share_prompt_prefill else n
        ids, mask, positions = (t.repeat_interleave(copies, dim=0) for t in (ids, mask, positions))
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **self._last_only)
        past, logits = getattr(out, self._cache_key), out.logits[:, -1, :].float()
        if copies == 1:
            past.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
            mask, positions = mask.repeat_interleave(n, dim=0), positions.repeat_interleave(n, dim=0)
        rows = len(prompts) * n
        stops = torch.tensor(self.stop_token_ids, dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        last = positions[:, -1:]
        tokens, logps = [], []
        for t in range(max_new_tokens):
            if self.vocab_limit is not None and self.vocab_limit < logits.shape[-1]:
                logits[:, self.vocab_limit :] = float("-inf")  # ids the tokenizer does not have
            logp = torch.log_softmax(logits / temperature, dim=-1)
            probs = logp.exp()
            if self.sampler == "inverse_cdf":
                if t % UNIFORM_CHUNK == 0:
                    steps = min(UNIFORM_CHUNK, max_new_tokens - t)
                    uniforms = torch.cat(
                        [torch.rand(n, steps, generator=r, dtype=torch.float64, device=self.device) for r in rngs]
                    )
                token = inverse_cdf_rows(probs, uniforms[:, t % UNIFORM_CHUNK])
            else:
                token = sample_rows(probs, rngs, n)
            tokens.append(token)
            logps.append(logp.gather(1, token[:, None]).squeeze(1))
            done |= torch.isin(token, stops)
            if bool(done.all()):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            last = last + 1
            out = self.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=last,
                use_cache=True,
                **{self._cache_key: past},
            )
            past, logits = getattr(out, self._cache_key), out.logits[:, -1, :].float()
        token_rows = torch.stack(tokens, 1).cpu().numpy()
        logp_rows = torch.stack(logps, 1).cpu().numpy()
        stop_set = set(self.stop_token_ids)
        completions = []
        for toks, lps in zip(token_rows, logp_rows):
            end = next((i + 1 for i, t in enumerate(toks) if int(t) in stop_set), len(toks))
            completions.append(
                Completion(
                    token_ids=[int(t) for t in toks[:end]],
                    logprobs=[float(x) for x in np.asarray(lps[:end], dtype=np.float64)],
                    stopped=end < len(toks) or (len(toks) > 0 and int(toks[-1]) in stop_set),
                )
            )
        return [completions[p * n : (p + 1) * n] for p in range(len(prompts))]
