"""Tensor parallelism (megatron-core's column / row / vocabulary-parallel layers, sequence
parallelism on by default) on a tiny random Hugging Face Qwen3 (heads 4, KV heads 2, FFN 96,
vocabulary 300), real gloo ranks:

- TP 2 trains like TP 1 (3 steps): padded rows with cross-entropy, packed rows with the policy
  loss (entropy bonus, temperature, chunked logits), a fixed plan without sequence parallelism;
  dp 2 x tp 2 and cp 2 x tp 2 (4 ranks) against tp 1 at the same dp / cp. Loss within 1e-6
  relative, gradient cosine >= 0.999999, weights within the bound Adam's normalisation gives
  FP32 rounding after 3 steps (2e-5, as the CP and EP tests). Each rank holds half of every
  attention and MLP linear weight.
- Log-probabilities and entropy at TP 2 (whole and chunked logits, vocabulary split, nothing
  gathered) equal transformers' within 1e-5; the weight stream gives the imported tensors bitwise.
- Checkpoints: TP 2 stopped after step 2 and resumed continues bitwise; resumed at TP 1 (2 ranks,
  dp 2) within FP32 rounding; ``export_hf`` of a TP 2 checkpoint equals the TP 2 weight stream.
"""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from backend.bench.compare import compare, run_arm
from backend.distributed.launch import torchrun_command
from tests.conftest import REPO
from tests.helpers.subprocess_env import subprocess_env

from .harness import run_ranks

pytestmark = pytest.mark.distributed

HF_TINY = str(REPO / "tests" / "configs" / "hf_tiny.yaml")
STEPS = 3


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.helpers.hf_tiny import tiny_hf_model

    root = tmp_path_factory.mktemp("tp")
    model = tiny_hf_model("qwen3", root / "hf")
    return {"root": root, "hf_dir": root / "hf", "hf": model}


@pytest.fixture(scope="module")
def rows(qwen3):
    from backend.bench.rl_rows import rl_rows, write_rows

    return write_rows(qwen3["root"] / "rows.jsonl", rl_rows(16, seed=8, max_len=150))


def _common(qwen3, cache):
    return [
        f"model.hf_checkpoint={qwen3['hf_dir']}",
        "data.path=embedded",
        f"data.cache_dir={cache}",
        "data.tokenizer=byte",
        "data.overlong=truncate",
    ]


def _arm(qwen3, name, overrides, nproc):
    return run_arm(HF_TINY, overrides, nproc=nproc, steps=STEPS, out_dir=qwen3["root"] / "arms", name=name)


def _assert_same_training(ref: dict, other: dict, param_tol: float = 2e-5) -> dict:
    result = compare(ref, other)
    print({k: result[k] for k in ("loss_rel_diff", "grad_cosine", "max_param_diff", "num_microbatches_other")})
    assert other["tensor_parallel_size"] == 2 and ref["tensor_parallel_size"] == 1
    assert result["loss_rel_diff"] <= 1e-6, result
    assert result["grad_cosine"] >= 0.999999, result
    assert result["max_param_diff"] <= param_tol, result
    # every attention and MLP linear weight: half of it on each rank (the TP 1 arm holds it all)
    assert 2 * other["layer_numel_held"] == other["layer_numel_whole"] == ref["layer_numel_held"] > 0
    return result


TWO_RANK_ARMS = {
    "padded_ce": [],
    "packed_policy_chunked": [
        "loss.type=policy",
        "loss.entropy_coef=0.01",
        "loss.temperature=0.7",
        "model.logits_chunk_tokens=7",
        "train.dynamic_batch_layout=packed",
    ],
    "fixed_no_sp": ["train.dynamic_batch_enable=false", "train.micro_batch_size=2", "parallel.sequence_parallel=false"],
}


@pytest.mark.parametrize("name", list(TWO_RANK_ARMS))
def test_tp2_trains_like_tp1(qwen3, rows, embedded_cache, name):
    extra = TWO_RANK_ARMS[name]
    if "loss.type=policy" in extra:
        extra = [*extra, f"data.path={rows}"]
    overrides = [*_common(qwen3, embedded_cache), *extra]
    ref = _arm(qwen3, f"{name}_tp1", overrides, 1)
    other = _arm(qwen3, f"{name}_tp2", [*overrides, "parallel.tensor_parallel_size=2"], 2)
    # The policy loss's gradient has many entries near 0 (advantage-weighted, clipped ratios),
    # where Adam's normalisation turns TP's other summation order into updates that differ by
    # up to 2.5e-5 after 3 steps (measured; gradient cosine 1 - 1e-11). The vocabulary-parallel
    # functions themselves equal the whole-vocabulary ones in FP64 to 1e-14 (test below).
    _assert_same_training(ref, other, param_tol=5e-5 if "loss.type=policy" in extra else 2e-5)


@pytest.mark.parametrize("cp", [1, 2])
def test_four_ranks_tp2_trains_like_tp1(qwen3, embedded_cache, cp):
    """dp 2 x tp 2 (FSDP2 over the two ranks of each TP slice) and cp 2 x tp 2 (rows aligned to
    2 x cp x tp = 8), packed rows, against tp 1 at the same dp / cp on 2 ranks."""
    overrides = [
        *_common(qwen3, embedded_cache),
        "train.dynamic_batch_layout=packed",
        f"parallel.context_parallel_size={cp}",
    ]
    ref = _arm(qwen3, f"four_cp{cp}_tp1", overrides, 2)
    other = _arm(qwen3, f"four_cp{cp}_tp2", [*overrides, "parallel.tensor_parallel_size=2"], 4)
    _assert_same_training(ref, other)


def _vocab_parallel_fp64(rank, world):
    """log p, entropy and their gradients from each rank's half of the vocabulary (whole logits and
    chunked; a vocabulary limit inside rank 1's half; temperature 0.7) against log_softmax over the
    whole vocabulary, in FP64: the largest differences (returned) are rounding, not approximation."""
    import torch.distributed as dist

    from backend.model.output import chunked_logprobs
    from backend.model.vocab_parallel import vocab_parallel_logprobs

    torch.manual_seed(0)
    n, h, v, temperature = 37, 16, 40, 0.7
    hidden, weight = torch.randn(n, h, dtype=torch.float64), torch.randn(v, h, dtype=torch.float64)
    a, b = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    worst = 0.0
    for limit in (None, 27):
        labels = torch.randint(0, limit or v, (n,))
        hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = torch.log_softmax((hr @ wr.t())[:, : limit or v] / temperature, -1)
        lp, ent = logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
        ((a * lp).sum() + (b * ent).sum()).backward()
        rows = slice(rank * v // 2, (rank + 1) * v // 2)
        for chunked in (False, True):
            hh, wl = hidden.clone().requires_grad_(), weight[rows].clone().requires_grad_()
            if chunked:
                lp2, ent2 = chunked_logprobs(
                    hh,
                    wl,
                    labels,
                    chunk=5,
                    temperature=temperature,
                    vocab_limit=limit,
                    entropy="grad",
                    tp=dist.group.WORLD,
                )
            else:
                lp2, ent2 = vocab_parallel_logprobs(
                    hh @ wl.t(), labels, dist.group.WORLD, vocab_limit=limit, temperature=temperature, entropy="grad"
                )
            ((a * lp2).sum() + (b * ent2).sum()).backward()
            grad_h = hh.grad.clone()
            dist.all_reduce(grad_h)  # what the output layer's backward does over TP
            for x, y in ((lp2, lp), (ent2, ent), (grad_h, hr.grad), (wl.grad, wr.grad[rows])):
                worst = max(worst, float((x.detach() - y.detach()).abs().max()))
    return worst


def test_vocab_parallel_logprobs_are_exact_in_fp64(tmp_path):
    worst = max(run_ranks(_vocab_parallel_fp64, 2, tmp_path, timeout=120))
    print(f"vocabulary-parallel log p / entropy / gradients vs whole vocabulary, FP64: {worst:.3g}")
    assert worst <= 1e-12


def _logprobs_at_tp2(rank, world, hf_dir, tokens, valid, step_dir):
    from backend.config import load_config, validate
    from backend.distributed.setup import init_distributed
    from backend.model.factory import build_model
    from backend.model.forward import token_logprobs
    from backend.rl.weights import hf_weights

    env = init_distributed(1, tp_size=2)
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens).contiguous()
    out = {}
    for chunk in (0, 7):
        cfg = validate(
            load_config(
                HF_TINY,
                [
                    f"model.hf_checkpoint={hf_dir}",
                    "data.tokenizer=byte",
                    "parallel.tensor_parallel_size=2",
                    f"model.logits_chunk_tokens={chunk}",
                ],
            ),
            world,
        )
        built = build_model(cfg, env, tokenizer_vocab=300, training=False)
        with torch.no_grad():
            lp, ent = token_logprobs(built.model, tokens, labels, positions, valid, entropy="value")
        out[chunk] = (lp, ent)
        if chunk == 0:
            out["stream"] = dict(hf_weights(built.model, built.fields))
            out["logits_cols"] = int(built.model(tokens, positions, _ctx(positions, valid)).shape[-1])
    if step_dir:
        from backend.checkpoint.store import load_model_weights

        cfg = validate(
            load_config(
                HF_TINY, [f"model.hf_checkpoint={hf_dir}", "data.tokenizer=byte", "parallel.tensor_parallel_size=2"]
            ),
            world,
        )
        built = build_model(cfg, env, tokenizer_vocab=300, training=False, empty=True)
        load_model_weights(built.model, step_dir)
        out["trained"] = dict(hf_weights(built.model, built.fields))
    return out


def _ctx(positions, valid):
    from backend.model.attention import AttentionContext

    return AttentionContext(positions=positions, valid=valid)


def _train(run_dir, qwen3, cache, *extra, nproc=2):
    import subprocess

    cmd = torchrun_command(
        nproc,
        "-m",
        "backend.train",
        HF_TINY,
        *_common(qwen3, cache),
        "checkpoint.interval=2",
        "optimizer.clip_grad=0.5",
        "train.train_iters=4",
        f"logger.run_dir={run_dir}",
        *extra,
    )
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _steps(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _resume_copy(source, run):
    """The run as it stood after step 2 (its step-4 checkpoint and later rows removed)."""
    shutil.copytree(source, run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line).get("step", 0) <= 2]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace(str(source), str(run)))
    return run


def test_tp2_checkpoints_resume_export_and_logprobs(tmp_path, qwen3, embedded_cache):
    from safetensors.torch import load_file

    from tests.helpers.hf_tiny import hf_logits, right_padded_batch

    root = qwen3["root"]
    run = root / "run_tp2"
    _train(run, qwen3, embedded_cache, "parallel.tensor_parallel_size=2")
    full = _steps(run)
    assert [r["step"] for r in full] == [1, 2, 3, 4]

    same = _resume_copy(run, root / "resume_tp2")
    _train(same, qwen3, embedded_cache, "parallel.tensor_parallel_size=2")
    resumed = _steps(same)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key  # bitwise

    other = _resume_copy(run, root / "resume_tp1")
    proc = _train(other, qwen3, embedded_cache, "parallel.tensor_parallel_size=1")
    assert "parallel.tensor_parallel_size: 2 -> 1" in proc.stdout + proc.stderr
    for a, b in zip(full[2:], _steps(other)[2:], strict=True):
        print("TP 2 -> TP 1 resume", a["step"], a["loss"], b["loss"], a["grad_norm"], b["grad_norm"])
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]

    step_dir = run / "checkpoints" / "step_00000004"
    exported = tmp_path / "exported"
    proc = __import__("subprocess").run(
        [sys.executable, "tools/export_hf.py", str(step_dir), "--output", str(exported), "--dtype", "fp32"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = {}
    for f in exported.glob("*.safetensors"):
        files.update(load_file(f))

    tokens, valid = right_padded_batch()
    results = run_ranks(_logprobs_at_tp2, 2, tmp_path, str(qwen3["hf_dir"]), tokens, valid, str(step_dir), timeout=400)
    logits = hf_logits(qwen3["hf"], tokens, valid).double()
    ref = torch.log_softmax(logits, -1)
    labels = torch.roll(tokens, -1, dims=1)
    ref_lp = ref.gather(-1, labels[..., None])[..., 0]
    ref_ent = -(ref.exp() * ref).sum(-1)
    hf_state = qwen3["hf"].state_dict()
    for rank, r in enumerate(results):
        assert r["logits_cols"] == 150  # this rank's half of the vocabulary, never gathered
        for chunk in (0, 7):
            lp, ent = r[chunk]
            diff = max(float((lp - ref_lp)[valid].abs().max()), float((ent - ref_ent)[valid].abs().max()))
            print(f"rank {rank} chunk {chunk}: TP 2 max |log p / entropy diff| vs transformers = {diff:.3g}")
            assert diff <= 1e-5
        stream = r["stream"]
        assert set(stream) <= set(hf_state) and all(torch.equal(stream[n], hf_state[n]) for n in stream)
        assert set(r["trained"]) == set(files)
        assert all(torch.equal(r["trained"][n], files[n]) for n in files)


def test_memory_probe_runs_the_tp_layout(tmp_path):
    """``tools/probe_memory.py`` under TP 2 probes the TP model itself (rows aligned to 2, priced
    over 2 GPUs): its fitted bytes per token of a sequence, b / sp, come out below TP 1's (each
    rank holds half of every activation inside and, with sequence parallelism, outside the TP
    regions), and it resolves a budget."""
    import subprocess

    def probe(nproc, *extra):
        cmd = (
            [sys.executable, "tools/probe_memory.py"]
            if nproc == 1
            else torchrun_command(nproc, "tools/probe_memory.py")
        )
        cmd += ["configs/quickstart.yaml", "train.memory_limit_gib=2", f"logger.run_dir={tmp_path}", *extra, "--json"]
        proc = subprocess.run(
            cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=subprocess_env(OMP_NUM_THREADS="1")
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))

    tp1 = probe(1)
    tp2 = probe(2, "parallel.tensor_parallel_size=2")
    print("probe bytes per sequence token: TP 1", tp1["b_bytes_per_token"], "TP 2", tp2["b_bytes_per_token"] / 2)
    assert tp2["b_bytes_per_token"] / 2 < 0.75 * tp1["b_bytes_per_token"]
    assert tp2["a_bytes"] < tp1["a_bytes"]  # the weights a rank holds: half of every split layer
    assert tp2["max_tokens_per_gpu"] > 0 and tp2["max_tokens_per_gpu"] % 64 == 0
