"""model.hf_checkpoint in the config: resolution, explicit-key conflicts, refusals by name."""

from __future__ import annotations

import json
import shutil

import pytest
import transformers  # noqa: E402,F401  (a dev dependency: a missing one fails, never skips)

from backend.config import ConfigError, load_config, to_yaml, validate  # noqa: E402
from backend.config.load import explicit_keys  # noqa: E402


def _copy(tiny_hf, kind, dst):
    shutil.copytree(tiny_hf[kind][0], dst)
    return dst


def test_explicit_keys_come_from_yaml_layers_and_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("model:\n  hidden_size: 64\n  rope_scaling:\n    factor: 8.0\n")
    child = tmp_path / "child.yaml"
    child.write_text("defaults: [base.yaml]\ntrain:\n  seed: 3\n")
    keys = explicit_keys(child, ["model.num_layers=4", "logger.wandb.tags=[a,b]"])
    assert keys == {
        "model.hidden_size",
        "model.rope_scaling.factor",
        "train.seed",
        "model.num_layers",
        "logger.wandb.tags",
    }


def test_checkpoint_supplies_the_architecture_and_tokenizer(tiny_hf, capsys):
    hf_dir = tiny_hf["llama"][0]
    cfg = validate(load_config(None, [f"model.hf_checkpoint={hf_dir}", "data.max_seq_length=256"]))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.head_dim, m.ffn_hidden_size, m.vocab_size) == (2, 64, 16, 96, 300)
    assert (m.norm_epsilon, m.rotary_base, m.max_position_embeddings) == (1e-5, 500_000.0, 256)
    assert not m.qk_layernorm and not m.tie_embeddings and not m.qkv_bias  # schema defaults replaced
    assert m.rope_scaling.rope_type == "llama3" and m.rope_scaling.original_max_position_embeddings == 64
    assert cfg.data.tokenizer == str(hf_dir)  # data.tokenizer=auto -> the checkpoint's tokenizer.json
    # --print-config shows what is built, and the saved config.yaml loads back to the same config.
    from backend.train.cli import main

    assert main(["--print-config", str(__file__).replace(".py", ".missing.yaml")]) == 2
    capsys.readouterr()
    argv = [_empty_yaml(hf_dir.parent), f"model.hf_checkpoint={hf_dir}", "data.max_seq_length=256", "--print-config"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rope_type: llama3" in printed and "norm_epsilon: 1.0e-05" in printed and "head_dim: 16" in printed
    saved = hf_dir.parent / "saved.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(saved) == cfg


def _empty_yaml(where):
    path = where / "empty.yaml"
    path.write_text("{}\n")
    return str(path)


def test_contradicting_explicit_keys_name_both_values(tiny_hf, tmp_path):
    hf_dir = tiny_hf["qwen3"][0]
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model:\n  hf_checkpoint: {hf_dir}\n  hidden_size: 128\n  head_dim: 32\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe, ["model.rope_scaling.rope_type=llama3", "model.qk_layernorm=true"])
    msg = str(e.value)
    assert "model.hidden_size=128" in msg and "gives hidden_size=64" in msg and str(hf_dir / "config.json") in msg
    assert "model.rope_scaling.rope_type='llama3'" in msg and "rope_scaling.rope_type='none'" in msg
    assert "head_dim" not in msg and "qk_layernorm" not in msg  # agreeing keys pass


def test_unsupported_model_type_is_refused_by_name(tiny_hf, tmp_path):
    hf_dir = _copy(tiny_hf, "llama", tmp_path / "m")
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral"}))
    with pytest.raises(ConfigError, match=r"model.hf_checkpoint=.*model_type 'mistral' is not supported"):
        load_config(None, [f"model.hf_checkpoint={hf_dir}"])


def test_missing_and_unexpected_tensors_are_named(world, tiny_hf, tmp_path):
    from safetensors.torch import load_file, save_file

    from backend.model.hf.safetensors_io import HFCheckpointError
    from tests.helpers.hf_tiny import build_from_hf

    hf_dir = _copy(tiny_hf, "qwen2", tmp_path / "m")
    tensors = load_file(hf_dir / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}, hf_dir / "model.safetensors"
    )
    with pytest.raises(HFCheckpointError, match=r"missing .*model.layers.1.self_attn.k_proj.bias"):
        build_from_hf(hf_dir, world)
    save_file({**tensors, "score.weight": tensors["lm_head.weight"].clone()}, hf_dir / "model.safetensors")
    with pytest.raises(HFCheckpointError, match=r"not used by the model: score.weight"):
        build_from_hf(hf_dir, world)


def test_pickle_only_checkpoint_is_refused_unopened(world, tiny_hf, tmp_path):
    from backend.model.hf.safetensors_io import HFCheckpoint, HFCheckpointError
    from tests.helpers.hf_tiny import build_from_hf

    hf_dir = _copy(tiny_hf, "qwen3", tmp_path / "m")
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "pytorch_model.bin").write_bytes(b"\x80\x04not a pickle we would ever open")
    with pytest.raises(ConfigError, match=r"safetensors only: never unpickles .bin \(pytorch_model.bin\)"):
        build_from_hf(hf_dir, world)  # refused when the config loads, before any model is built
    with pytest.raises(HFCheckpointError, match=r"safetensors only: never unpickles .bin \(pytorch_model.bin\)"):
        HFCheckpoint(hf_dir)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.head_dim=15"], "model.head_dim=15: RoPE needs an even head size"),
        (["model.hidden_size=100", "model.num_attention_heads=3"], "(or set model.head_dim)"),
        (["model.rope_scaling.rope_type=llama3", "model.rope_scaling.factor=8"], "model.rope_scaling.low_freq_factor"),
        (["model.rope_scaling.rope_type=ntk"], "model.rope_scaling.rope_type='ntk'"),
        (["model.norm_epsilon=0"], "model.norm_epsilon=0.0"),
    ],
)
def test_impossible_model_settings_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides))
    assert needle in str(e.value)


def test_tokenizer_auto_needs_a_tokenizer_in_the_checkpoint(tiny_hf, tmp_path):
    hf_dir = _copy(tiny_hf, "qwen3", tmp_path / "m")
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match="data.tokenizer=auto: .* has no tokenizer.json"):
        load_config(None, [f"model.hf_checkpoint={hf_dir}"])
    assert load_config(None, [f"model.hf_checkpoint={hf_dir}", "data.tokenizer=byte"]).data.tokenizer == "byte"
