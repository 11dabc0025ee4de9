"""Real models in and out, as a user runs them: import a tiny HF checkpoint, fine-tune it with
dynamic batching (``python -m backend.train``), export it (``tools/export_hf.py``) and load it in
transformers; log-probabilities of the imported model through ``tools/compute_logprobs.py`` at
dp 2 and at dp 1 x cp 2; fixed versus dynamic arms from the imported weights.

Every subprocess imports this checkout's ``backend`` (PYTHONPATH), and compares against
transformers in FP32 with eager attention.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from backend.distributed.launch import torchrun_command
from tests.conftest import REPO
from tests.helpers.subprocess_env import subprocess_env

pytestmark = pytest.mark.distributed
import transformers  # noqa: E402  (a dev dependency: a missing one fails, never skips)

HF_TINY = str(REPO / "tests" / "configs" / "hf_tiny.yaml")


def _env() -> dict:
    return subprocess_env(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
]


def _run(cmd, timeout=600):
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(), timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _chat_data(path, rows=24):
    """Chat rows (loss on the answers only) and plain text rows of varied lengths."""
    lines = []
    for i in range(rows):
        if i % 2:
            convo = [dict(m) for m in CONVERSATION]
            convo[2]["content"] = "four " * (1 + i % 7)
            lines.append({"messages": convo})
        else:
            lines.append({"text": "hello world " * (1 + i % 9)})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _samples(path, vocab=250, lengths=(37, 5, 64, 19, 2, 50)):
    g = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return rows


def _hf_logprobs(model, rows) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor([r])
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            out.append(lp.gather(-1, ids[0, 1:, None])[:, 0])
    return out


# Qwen2 runs sharded over 2 ranks in test_hf_fsdp_load.py; each torchrun here costs ~15 s of CPU.
@pytest.mark.parametrize("kind,nproc,cp,pp", [("qwen3", 2, 1, 1), ("llama", 2, 2, 1), ("qwen3", 2, 1, 2)])
def test_logprobs_tool_on_imported_model_matches_transformers(tmp_path, tiny_hf, kind, nproc, cp, pp):
    hf_dir, hf = tiny_hf[kind]
    rows = _samples(tmp_path / "samples.jsonl")
    out = tmp_path / "lp.jsonl"
    cmd = torchrun_command(
        nproc,
        "tools/compute_logprobs.py",
        HF_TINY,
        f"model.hf_checkpoint={hf_dir}",
        f"parallel.context_parallel_size={cp}",
        f"parallel.pipeline_parallel_size={pp}",  # 2: each stage imports its own layers (tied embeddings)
        f"logger.run_dir={tmp_path / 'run'}",
        "--input",
        str(tmp_path / "samples.jsonl"),
        "--output",
        str(out),
    )
    proc = _run(cmd)
    assert f"(checkpoint: {hf_dir})" in proc.stdout
    ours = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    ref = _hf_logprobs(hf, rows)
    diff = max(float((torch.tensor(a) - b).abs().max()) if len(a) else 0.0 for a, b in zip(ours, ref))
    print(f"{kind} dp{nproc // (cp * pp)} x cp{cp} x pp{pp}: max |logprob diff| vs transformers = {diff:.3g}")
    assert [len(a) for a in ours] == [len(r) - 1 for r in rows]
    assert diff <= (1e-5 if pp > 1 else 1e-4)


def test_import_train_export_round_trip(tmp_path, tiny_hf, world):
    """import -> 3 dynamic-batching steps on chat + text rows -> tools/export_hf.py -> transformers
    gives the logits of our trained model (loaded from our checkpoint with the safe loader)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from backend.checkpoint.safe_dcp import safe_load
    from backend.config import load_config
    from backend.model.factory import build_model
    from tests.helpers.hf_tiny import hf_logits, our_logits, right_padded_batch

    hf_dir, hf = tiny_hf["llama"]
    run = tmp_path / "run"
    data = _chat_data(tmp_path / "chat.jsonl")
    _run(
        [
            sys.executable,
            "-m",
            "backend.train",
            HF_TINY,
            f"model.hf_checkpoint={hf_dir}",
            f"logger.run_dir={run}",
            f"data.path={data}",
        ]
    )
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and all(m["num_microbatches"] >= 1 for m in metrics)
    step = run / "checkpoints" / "step_00000003"
    out = tmp_path / "exported"
    _run(
        [
            sys.executable,
            "tools/export_hf.py",
            str(step),
            "--output",
            str(out),
            "--dtype",
            "fp32",
            "--max-shard-size",
            "100KB",
        ]
    )
    assert (out / "model.safetensors.index.json").is_file() and (out / "chat_template.jinja").is_file()
    trained = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()

    cfg = load_config(run / "config.yaml")
    built = build_model(cfg, world, tokenizer_vocab=256, training=False, empty=True)
    state = {"model": get_model_state_dict(built.model)}
    safe_load(state, step)
    set_model_state_dict(built.model, state["model"])
    tokens, valid = right_padded_batch(seed=3)
    ours, ref = our_logits(built.model, tokens, valid), hf_logits(trained, tokens, valid)
    diff = float((ours - ref)[valid].abs().max())
    moved = float((hf_logits(hf, tokens, valid) - ref)[valid].abs().max())
    print(f"trained llama: export -> transformers max |logit diff| = {diff:.3g} (training moved logits {moved:.3g})")
    assert diff <= 1e-4 and moved > 1e-3
    original = load_file(hf_dir / "model.safetensors")
    assert not torch.equal(
        trained.state_dict()["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"]
    )


def test_compare_arms_on_imported_model(tmp_path, tiny_hf):
    """Fixed versus dynamic microbatching from the imported weights agree (one process per arm:
    sharded imports are covered above)."""
    hf_dir, _ = tiny_hf["qwen3"]
    data = _chat_data(tmp_path / "chat.jsonl")
    proc = _run(
        [
            sys.executable,
            "tools/compare_arms.py",
            HF_TINY,
            f"model.hf_checkpoint={hf_dir}",
            f"data.path={data}",
            "--steps",
            "2",
            "--nproc",
            "1",
            "--out-dir",
            str(tmp_path / "arms"),
            "--json",
        ]
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"imported qwen3 arms: grad_cosine={result['grad_cosine']:.8f} max_param_diff={result['max_param_diff']:.3g}")
    assert result["grad_cosine"] >= 0.99999 and result["max_param_diff"] <= 1e-5


def test_gpt_oss_logprobs_at_tp2_ep2_match_transformers(tmp_path):
    """A tiny GPT-OSS (sinks, a sliding-window layer, 4 experts top 2, biases, YaRN) imported at
    tp 2 x ep 2 on 4 ranks (attention split by heads, experts split over EP and whole over TP,
    each TP rank routing its own slice of the tokens): tools/compute_logprobs.py equals
    transformers within 1e-5."""
    from tests.helpers.hf_tiny import tiny_gpt_oss_model

    hf = tiny_gpt_oss_model(tmp_path / "hf")
    rows = _samples(tmp_path / "samples.jsonl", vocab=256, lengths=(37, 5, 64, 19, 50))
    out = tmp_path / "lp.jsonl"
    cmd = torchrun_command(
        4,
        "tools/compute_logprobs.py",
        HF_TINY,
        f"model.hf_checkpoint={tmp_path / 'hf'}",
        "data.tokenizer=byte",
        "parallel.tensor_parallel_size=2",
        "parallel.expert_parallel_size=2",
        f"logger.run_dir={tmp_path / 'run'}",
        "--input",
        str(tmp_path / "samples.jsonl"),
        "--output",
        str(out),
    )
    _run(cmd)
    ours = [json.loads(line)["logprobs"] for line in out.read_text().splitlines()]
    ref = _hf_logprobs(hf, rows)
    diff = max(float((torch.tensor(a) - b).abs().max()) for a, b in zip(ours, ref))
    print(f"gpt-oss tp2 x ep2: max |logprob diff| vs transformers = {diff:.3g}")
    assert [len(a) for a in ours] == [len(r) - 1 for r in rows] and diff <= 1e-5
