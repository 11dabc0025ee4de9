"""Expert parallelism on 2 gloo ranks (EP 2) against EP 1 and against transformers.

- Import: a tiny GPT-OSS (4 experts, top 2) built at EP 2 from its HF directory, dense and MXFP4:
  each rank reads only its 2 experts' rows (the reads are recorded), computes with 2 of the 4
  (read at the layer's forward, after FSDP2 unshards), and gives transformers' log-probabilities.
- The memory probe's routing (``moe_stats.worst_case_routing``) sends every token of both ranks to
  rank 0's experts (2 x tokens x k rows there, none on rank 1); the model's own routing conserves
  the rows (each routed row reaches exactly one rank).
- Export: the (HF name, tensor) stream at EP 2 is bitwise the stream at EP 1 of the same weights,
  for the imported weights and for a checkpoint trained at EP 2 (against ``tools/export_hf.py``'s
  files, written by one process at EP 1).
- Checkpoints: a run at EP 2 stopped after step 2 and resumed gives steps 3-4 bitwise; the same
  checkpoint resumed at EP 1 (the experts regathered by DCP's global offsets) continues within
  FP32 rounding; on 4 ranks (dp 2 x cp 2) a checkpoint at EP 2, its experts FSDP2-sharded over 2
  ranks, continues at EP 4.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys

import pytest
import torch

from backend.distributed.launch import torchrun_command
from backend.logging.metric_keys import undocumented
from tests.conftest import REPO
from tests.helpers.subprocess_env import subprocess_env

from .harness import run_ranks

pytestmark = pytest.mark.distributed

HF_TINY = str(REPO / "tests" / "configs" / "hf_tiny.yaml")
EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


def _experts_held(model) -> dict:
    from backend.model.expert_parallel import experts_held

    held: dict = {}
    for module in model.modules():
        if hasattr(module, "experts_per_rank"):
            module.register_forward_pre_hook(lambda m, _args: held.update({id(m): experts_held(m)}))
    return held


def import_at_ep(rank: int, world: int, dirs: dict, tokens: torch.Tensor, valid: torch.Tensor, step_dir: str):
    from backend.checkpoint.hf_export import full_named_tensors
    from backend.checkpoint.store import load_model_weights
    from backend.distributed.setup import init_distributed
    from backend.model.hf.export import hf_tensors
    from backend.model.hf.safetensors_io import HFCheckpoint
    from tests.helpers.hf_tiny import build_from_hf, our_logits

    reads: list = []
    get, get_rows = HFCheckpoint.get, HFCheckpoint.get_rows

    def recorded_get(self, name):
        reads.append((name, None))
        return get(self, name)

    def recorded_rows(self, name, start, stop):
        reads.append((name, (start, stop)))
        return get_rows(self, name, start, stop)

    HFCheckpoint.get, HFCheckpoint.get_rows = recorded_get, recorded_rows
    envs = {1: init_distributed(1), 2: init_distributed(1, ep_size=2)}
    out: dict = {}
    for kind, hf_dir in dirs.items():
        for ep, env in envs.items():
            reads.clear()
            built = build_from_hf(hf_dir, env, f"parallel.expert_parallel_size={ep}")
            held = _experts_held(built.model)
            logits = our_logits(built.model, tokens, valid)
            stream = {n: t.clone() for n, t in hf_tensors(full_named_tensors(built.model), built.fields, dtype="fp32")}
            out[(kind, ep)] = {
                "logprobs": torch.log_softmax(logits.double(), -1),
                "held": sorted(set(held.values())),
                "expert_reads": [(n, rows) for n, rows in reads if ".mlp.experts." in n],
                "stream": stream,
            }
            if kind == "gpt_oss" and ep == 2:
                out["rows"] = _expert_rows(built.model, tokens, valid)
            if kind == "gpt_oss" and step_dir:
                load_model_weights(built.model, step_dir)
                out[("trained", ep)] = {
                    n: t.clone() for n, t in hf_tensors(full_named_tensors(built.model), built.fields, dtype="fp32")
                }
    return out


def _expert_rows(model, tokens, valid) -> dict:
    """Rows each MoE layer's local experts computed on this rank, with the model's routing and with
    the memory probe's worst case (every token to EP rank 0's experts)."""
    from backend.model import moe_stats
    from tests.helpers.hf_tiny import our_logits

    seen: list = []
    for module in model.modules():
        if hasattr(module, "experts_per_rank"):
            run = module._local_forward

            def counted(x, counts, p, run=run):
                seen.append(int(counts.sum()))
                return run(x, counts, p)

            module._local_forward = counted
    out = {}
    for name, worst in (("routed", False), ("worst", True)):
        seen.clear()
        probe = moe_stats.worst_case_routing(model) if worst else contextlib.nullcontext()
        with moe_stats.routing_context(model, valid), probe:
            our_logits(model, tokens, valid)
        out[name] = list(seen)
    return out


def _run(cmd, timeout=600):
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=subprocess_env(OMP_NUM_THREADS="1")
    )
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _train(run_dir, hf_dir, cache, *extra, nproc=2):
    return _run(
        torchrun_command(
            nproc,
            "-m",
            "backend.train",
            HF_TINY,
            f"model.hf_checkpoint={hf_dir}",
            "model.moe_aux_loss_coeff=0.9",
            "data.path=embedded",
            f"data.cache_dir={cache}",
            "data.tokenizer=byte",
            "data.overlong=truncate",
            "checkpoint.interval=2",
            "optimizer.clip_grad=0.5",  # clipped by the norm over both meshes (experts and the rest)
            f"logger.run_dir={run_dir}",
            *extra,
        )
    )


def _steps(run_dir) -> list[dict]:
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert not undocumented(rows), undocumented(rows)  # every metric in docs/reference/metrics.md
    return rows


@pytest.fixture(scope="module")
def trained(tmp_path_factory, embedded_cache):
    """A tiny GPT-OSS fine-tuned 4 steps at EP 2 (checkpoints at 2 and 4)."""
    from tests.helpers.hf_tiny import tiny_gpt_oss_model, write_mxfp4_copy

    root = tmp_path_factory.mktemp("ep")
    hf = tiny_gpt_oss_model(root / "dense")
    write_mxfp4_copy(root / "dense", root / "mxfp4")
    run = root / "run"
    _train(run, root / "dense", embedded_cache, "train.train_iters=4", "parallel.expert_parallel_size=2")
    return {"root": root, "hf": hf, "run": run, "cache": embedded_cache}


def _resume_copy(trained, name, source=None, last=4):
    """The run as it stood after step 2 (its last checkpoint and later rows removed)."""
    source = source or trained["run"]
    run = trained["root"] / name
    shutil.copytree(source, run)
    shutil.rmtree(run / "checkpoints" / f"step_{last:08d}")
    rows = [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line).get("step", 0) <= 2]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in rows))
    config = (run / "config.yaml").read_text().replace(str(source), str(run))
    (run / "config.yaml").write_text(config)
    return run


def test_resume_at_ep2_is_bitwise_and_ep1_continues_it(trained):
    full = _steps(trained["run"])
    assert [r["step"] for r in full] == [1, 2, 3, 4]
    same = _resume_copy(trained, "resume_ep2")
    _train(same, trained["root"] / "dense", trained["cache"], "train.train_iters=4", "parallel.expert_parallel_size=2")
    resumed = _steps(same)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "moe_aux_loss", "moe_tokens_per_expert_max_over_mean"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key  # bitwise
    other = _resume_copy(trained, "resume_ep1")
    proc = _train(
        other, trained["root"] / "dense", trained["cache"], "train.train_iters=4", "parallel.expert_parallel_size=1"
    )
    assert "parallel.expert_parallel_size: 2 -> 1" in proc.stdout + proc.stderr
    continued = _steps(other)
    for a, b in zip(full[2:], continued[2:], strict=True):
        print("EP 2 -> EP 1 resume", a["step"], a["loss"], b["loss"], a["grad_norm"], b["grad_norm"])
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]


def test_four_ranks_ep2_checkpoint_resumes_at_ep4(trained):
    """dp 2 x cp 2: at EP 2 each expert is FSDP2-sharded over 2 ranks (expert_dp 2); at EP 4 it
    lives whole on one rank. A step-2 checkpoint of the one layout continues in the other (DCP
    regathers the shards by global offset), step 3 within FP32 rounding of the uninterrupted run."""
    dense, cache = trained["root"] / "dense", trained["cache"]
    four = ["parallel.context_parallel_size=2", "train.train_iters=3"]
    full_run = trained["root"] / "four_ep2"
    _train(full_run, dense, cache, *four, "parallel.expert_parallel_size=2", nproc=4)
    full = _steps(full_run)
    other = _resume_copy(trained, "four_ep4", source=full_run, last=3)
    _train(other, dense, cache, *four, "parallel.expert_parallel_size=4", nproc=4)
    continued = _steps(other)
    assert [r["step"] for r in continued] == [1, 2, 3]
    a, b = full[2], continued[2]
    print("dp 2 x cp 2, EP 2 -> EP 4 resume: step 3", a["loss"], b["loss"], a["grad_norm"], b["grad_norm"])
    assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])
    assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]


def test_ep2_import_export_and_logprobs(tmp_path, trained):
    """Import, log-probabilities and export at EP 2 against EP 1, transformers and export_hf."""
    from safetensors.torch import load_file

    from tests.helpers.hf_tiny import hf_logits, right_padded_batch

    root = trained["root"]
    step_dir = trained["run"] / "checkpoints" / "step_00000004"
    exported = tmp_path / "exported"
    _run([sys.executable, "tools/export_hf.py", str(step_dir), "--output", str(exported), "--dtype", "fp32"])
    files = {}
    for f in exported.glob("*.safetensors"):
        files.update(load_file(f))

    tokens, valid = right_padded_batch()
    dirs = {"gpt_oss": str(root / "dense"), "gpt_oss_mxfp4": str(root / "mxfp4")}
    results = run_ranks(import_at_ep, 2, tmp_path, dirs, tokens, valid, str(step_dir))
    ref = torch.log_softmax(hf_logits(trained["hf"], tokens, valid).double(), -1)
    for rank, r in enumerate(results):
        diff = float((r[("gpt_oss", 2)]["logprobs"] - ref)[valid].abs().max())
        print(f"rank {rank}: EP 2 max |logprob diff| vs transformers = {diff:.3g}")
        assert diff <= 1e-5
        for kind in dirs:
            assert r[(kind, 1)]["held"] == [4] and r[(kind, 2)]["held"] == [2]  # 1/EP of the experts
            # every expert tensor read is this rank's two experts' rows, never the whole stack
            reads = r[(kind, 2)]["expert_reads"]
            assert reads and all(rows == (2 * rank, 2 * rank + 2) for _, rows in reads), reads
            assert {"down_proj_bias", "gate_up_proj_bias"} <= {n.rsplit(".", 1)[-1] for n, _ in reads}
            a, b = r[(kind, 1)]["stream"], r[(kind, 2)]["stream"]
            assert list(a) == list(b) and all(torch.equal(a[n], b[n]) for n in a)
        for layer, hf_layer in enumerate(trained["hf"].model.layers):  # the dense import exports its own file
            name = f"model.layers.{layer}.mlp.experts.down_proj"
            assert torch.equal(r[("gpt_oss", 2)]["stream"][name], hf_layer.mlp.experts.down_proj.detach())
        # every routed row reaches one rank's experts (2 layers, top 2 of each valid token, both
        # ranks feeding the same batch); the probe's routing sends all of them to rank 0
        real = int(valid.sum())
        routed = [a + b for a, b in zip(results[0]["rows"]["routed"], results[1]["rows"]["routed"], strict=True)]
        assert routed == [2 * 2 * real] * 2
        assert r["rows"]["worst"] == ([2 * 2 * real] * 2 if rank == 0 else [0, 0])
        trained_ep1, trained_ep2 = r[("trained", 1)], r[("trained", 2)]
        assert set(trained_ep2) == set(files)
        assert all(torch.equal(trained_ep2[n], files[n]) and torch.equal(trained_ep1[n], files[n]) for n in files)


def test_bench_expert_parallel_reports_both_arms():
    """tools/bench/bench_expert_parallel.py at its smallest (2 ranks, EP 1 and 2): EP 2 computes with half
    the experts, exchanges tokens, and gathers fewer weight bytes than EP 1."""
    proc = _run(
        [sys.executable, "tools/bench/bench_expert_parallel.py", "--nproc", "2", "--eps", "1,2", "--tokens", "64"]
        + ["--steps", "1", "--scale", "0.03", "--json"]
    )
    arms = {a["ep"]: a for a in json.loads(proc.stdout.strip().splitlines()[-1])["arms"]}
    assert arms[1]["experts_per_rank"] == 32 and arms[2]["experts_per_rank"] == 16
    assert arms[1]["bytes"]["a2a"] == 0 < arms[2]["bytes"]["a2a"]
    assert arms[2]["bytes"]["gather"] < arms[1]["bytes"]["gather"]
