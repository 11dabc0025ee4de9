"""LoRA (``model.lora``): adapters beside a frozen base, in PEFT's format, with the ``peft``
library (on transformers' tiny random Qwen3) as the reference:

- with B = 0 the model is the base (logits bitwise), and ``adapters_off`` gives the base back;
- a PEFT adapter made by ``peft`` (random A and B) imports and gives PEFT's log-probabilities;
- ``python -m backend.train`` trains 5 steps with rank 8 on all seven projections: its step
  checkpoint holds the adapters and their optimizer state, not the base; the base did not move;
  ``tools/export_hf.py`` writes PEFT's format, which ``peft`` loads onto the transformers model
  with log-probabilities equal to ``tools/compute_logprobs.py``'s; ``--merge`` equals PEFT's
  ``merge_and_unload()``; the run resumes, and a changed base is refused naming the checkpoint;
- bad settings are one-line errors naming the key.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from backend.config import ConfigError, load_config, validate
from tests.conftest import REPO
from tests.helpers.hf_tiny import build_from_hf, hf_logits, our_logits, right_padded_batch, tiny_hf_model
from tests.helpers.subprocess_env import subprocess_env

peft = pytest.importorskip("peft", reason="the LoRA reference is the peft library (pip install -e '.[peft]')")

HF_TINY = str(REPO / "tests" / "configs" / "hf_tiny.yaml")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run(*args, check=True):
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=subprocess_env(OMP_NUM_THREADS="1"),
    )
    if check:
        assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = tiny_hf_model("qwen3", root / "hf", tokenizer=True)
    return root, model


def test_zero_b_is_the_base_bitwise_and_adapters_off_is_the_base(world, base):
    from backend.model.lora import adapters_off

    root, _ = base
    plain = build_from_hf(root / "hf", world)
    lora = build_from_hf(root / "hf", world, "model.lora.rank=4")
    tokens, valid = right_padded_batch()
    ref = our_logits(plain.model, tokens, valid)[valid]
    assert torch.equal(our_logits(lora.model, tokens, valid)[valid], ref)
    with torch.no_grad():
        for n, p in lora.model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.1)
    moved = our_logits(lora.model, tokens, valid)[valid]
    assert float((moved - ref).abs().max()) > 1e-2
    with adapters_off(lora.model):
        assert torch.equal(our_logits(lora.model, tokens, valid)[valid], ref)
    trained = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert trained and all(".adapters." in n for n in trained)
    assert len(trained) == 2 * 7 * 2  # A and B of seven projections in each of two layers


def test_a_peft_adapter_imports_with_pefts_logprobs(world, base, tmp_path):
    root, hf = base
    config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=ALL, init_lora_weights=False)
    torch.manual_seed(3)
    made = peft.get_peft_model(tiny_hf_model("qwen3", tmp_path / "copy"), config)  # random A and B
    made.save_pretrained(tmp_path / "adapter")
    ours = build_from_hf(
        root / "hf", world, "model.lora.rank=4", "model.lora.alpha=12", f"model.lora.adapter={tmp_path / 'adapter'}"
    )
    tokens, valid = right_padded_batch()
    mine = _token_logprobs(our_logits(ours.model, tokens, valid), tokens)
    theirs = _token_logprobs(hf_logits(made.eval(), tokens, valid), tokens)
    pairs = valid[:, 1:] & valid[:, :-1]
    diff = float((mine - theirs)[pairs].abs().max())
    plain = _token_logprobs(hf_logits(hf, tokens, valid), tokens)
    print(
        f"PEFT adapter import: max |logprob diff| {diff:.3g} (base vs adapter {float((plain - theirs)[pairs].abs().max()):.3g})"
    )
    assert diff <= 1e-5
    assert float((plain - theirs)[pairs].abs().max()) > 1e-2  # the adapter matters
    with pytest.raises(Exception, match="r=4.0?, but model.lora sets 8|r=4, but model.lora sets 8"):
        build_from_hf(
            root / "hf", world, "model.lora.rank=8", "model.lora.alpha=12", f"model.lora.adapter={tmp_path / 'adapter'}"
        )


def test_gpt_oss_attention_adapters_import_with_pefts_logits(world, tmp_path):
    """GPT-OSS (biased q/k/v/o, sinks, MoE experts): adapters on the attention projections only
    (the experts' are refused by name); a random PEFT adapter gives PEFT's logits."""
    from tests.helpers.hf_tiny import tiny_gpt_oss_model

    hf = tiny_gpt_oss_model(tmp_path / "gpt_oss")
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    torch.manual_seed(3)
    made = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=attention, init_lora_weights=False)
    )
    made.save_pretrained(tmp_path / "adapter")
    ours = build_from_hf(
        tmp_path / "gpt_oss",
        world,
        "model.lora.rank=4",
        "model.lora.alpha=8",
        f"model.lora.target_modules=[{','.join(attention)}]",
        f"model.lora.adapter={tmp_path / 'adapter'}",
    )
    tokens, valid = right_padded_batch()
    diff = float((our_logits(ours.model, tokens, valid) - hf_logits(made.eval(), tokens, valid))[valid].abs().max())
    print(f"GPT-OSS attention adapter import: max |logit diff| {diff:.3g}")
    assert diff <= 1e-4  # as the GPT-OSS import itself (tests/unit/test_hf_gpt_oss_model.py)


@pytest.fixture(scope="module")
def trained(base, embedded_cache):
    """Five LoRA steps on the tiny Qwen3 (rank 8, all seven projections), a checkpoint at step 5."""
    root, _ = base
    run = root / "run"
    overrides = [
        f"model.hf_checkpoint={root / 'hf'}",
        "model.lora.rank=8",
        "data.path=embedded",
        f"data.cache_dir={embedded_cache}",
        "data.tokenizer=byte",
        "data.overlong=truncate",
        "train.train_iters=5",
        "checkpoint.interval=5",
        f"logger.run_dir={run}",
    ]
    proc = _run("-m", "backend.train", HF_TINY, *overrides)
    assert "trained parameters" in proc.stderr + proc.stdout
    return root, run, overrides


def test_the_checkpoint_holds_the_adapters_and_their_optimizer_state_not_the_base(trained):
    from backend.checkpoint.meta import read_meta
    from backend.checkpoint.safe_dcp import read_metadata_file

    _, run, _ = trained
    step = run / "checkpoints" / "step_00000005"
    keys = list(read_metadata_file(step / ".metadata").state_dict_metadata)
    tensors = [k for k in keys if not k.endswith("_extra_state") and "param_groups" not in k]
    assert tensors and all(".adapters." in k for k in tensors), [k for k in tensors if ".adapters." not in k][:5]
    model_keys = {k for k in tensors if k.startswith("model.")}
    assert len(model_keys) == 2 * 7 * 2
    for moment in ("exp_avg", "exp_avg_sq"):  # AdamW's two moments of each adapter, nothing else
        assert {k.removeprefix("optim.state.").removesuffix("." + moment) for k in tensors if k.endswith(moment)} == {
            k.removeprefix("model.") for k in model_keys
        }
    meta = read_meta(step)
    assert meta["lora_base"]["source"] == str((trained[0] / "hf").resolve())


def test_peft_loads_the_export_with_our_logprobs_and_merge_equals_merge_and_unload(trained, tmp_path):
    import transformers

    from backend.bench.rl_rows import rl_rows, write_rows

    root, run, overrides = trained
    step = str(run / "checkpoints" / "step_00000005")
    _run("tools/export_hf.py", step, "--output", str(tmp_path / "adapter"), "--dtype", "fp32")
    _run("tools/export_hf.py", step, "--output", str(tmp_path / "merged"), "--dtype", "fp32", "--merge")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and sorted(config["target_modules"]) == sorted(ALL)

    rows = rl_rows(6, seed=2, max_len=60)
    write_rows(tmp_path / "rows.jsonl", [{"input_ids": r["input_ids"]} for r in rows])
    _run(
        "tools/compute_logprobs.py",
        HF_TINY,
        *overrides,
        "--input",
        str(tmp_path / "rows.jsonl"),
        "--output",
        str(tmp_path / "ours.jsonl"),
        "--checkpoint",
        step,
    )
    ours = [json.loads(line)["logprobs"] for line in (tmp_path / "ours.jsonl").read_text().splitlines()]

    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", attn_implementation="eager").float()
    loaded = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    worst = 0.0
    with torch.no_grad():
        for row, mine in zip(rows, ours):
            tokens = torch.tensor([row["input_ids"]])
            theirs = _token_logprobs(loaded(input_ids=tokens).logits, tokens)[0]
            worst = max(worst, float((theirs - torch.tensor(mine, dtype=torch.float64)).abs().max()))
    print(f"PEFT-loaded export vs tools/compute_logprobs.py: max |diff| {worst:.3g}")
    assert worst <= 1e-5

    merged = loaded.merge_and_unload().state_dict()
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert set(again) <= set(merged)
    diff = max(float((again[k].float() - merged[k].float()).abs().max()) for k in again)
    print(f"--merge vs merge_and_unload: max |diff| {diff:.3g}")
    assert diff <= 1e-6
    base = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").state_dict()
    assert max(float((again[k] - base[k]).abs().max()) for k in again if "q_proj" in k) > 1e-4  # it trained


def test_the_base_did_not_move_and_a_changed_base_is_refused(world, trained, tmp_path):
    from backend.checkpoint.lora_base import base_identity, check_base
    from backend.checkpoint.meta import read_meta
    from backend.checkpoint.store import load_model_weights
    from backend.errors import CheckpointError
    from backend.model.factory import build_model

    root, run, overrides = trained
    step = run / "checkpoints" / "step_00000005"
    cfg = validate(load_config(HF_TINY, overrides))
    built = build_model(cfg, world, tokenizer_vocab=257, training=False, empty=True)
    load_model_weights(built.model, step)
    plain = build_from_hf(root / "hf", world)
    theirs = dict(plain.model.named_parameters())
    for n, p in built.model.named_parameters():
        if ".adapters." in n:
            assert not n.endswith("lora_B") or float(p.abs().max()) > 0, n  # B trained away from 0
        else:
            assert torch.equal(p, theirs[n]), n
    meta = read_meta(step)
    check_base(meta, base_identity(cfg), step)  # the same base: accepted
    tiny_hf_model("qwen3", tmp_path / "other", seed=5)
    other = validate(load_config(HF_TINY, [*overrides, f"model.hf_checkpoint={tmp_path / 'other'}"]))
    with pytest.raises(CheckpointError, match="step_00000005: its LoRA adapters were trained on the base"):
        check_base(meta, base_identity(other), step)


def test_generate_samples_from_a_lora_checkpoint(trained):
    """tools/generate.py on a LoRA checkpoint: the base from its source, the adapters merged in."""
    _, run, _ = trained
    step = str(run / "checkpoints" / "step_00000005")
    proc = _run("tools/generate.py", step, "--prompt", "def f(x):", "--max-new-tokens", "6", "--json")
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1 and len(rows[0]["responses"]) == 1


def test_the_run_resumes_from_its_adapters(trained):
    _, run, overrides = trained
    proc = _run("-m", "backend.train", HF_TINY, *overrides, "train.train_iters=6")
    assert "resumed from" in proc.stderr + proc.stdout
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r][-2:] == [5, 6]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.lora.rank=4", "model.lora.target_modules=[lm_head]"], "adapters on the embedding or the output layer"),
        (["model.lora.rank=4", "model.lora.target_modules=[qkv]"], "'qkv': allowed values are q_proj"),
        (["model.lora.rank=4", "model.lora.dropout=1.5"], r"model.lora.dropout=1.5: must be in \[0, 1\)"),
        (["model.lora.adapter=somewhere"], "model.lora.adapter: only read with model.lora.rank > 0"),
        (
            ["model.lora.rank=4", "model.num_moe_experts=4", "model.attention_bias=true"],
            "adapters on MoE experts are not supported",
        ),
    ],
)
def test_bad_lora_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(str(REPO / "configs" / "quickstart.yaml"), overrides))
