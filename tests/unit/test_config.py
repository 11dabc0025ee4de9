"""Config: YAML + defaults inheritance + dotted overrides, one validation pass, keyed errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.config import ConfigError, load_config, save_config, to_yaml, validate


def write(path, text):
    path.write_text(text)
    return path


def test_round_trip_yaml_defaults_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", "train:\n  global_batch_size: 64\n  train_iters: 5\nmodel:\n  num_layers: 3\n")
    child = write(
        tmp_path / "child.yaml",
        "defaults: [base.yaml]\ntrain:\n  train_iters: 7\n  dynamic_batch_enable: true\n  max_tokens_per_gpu: 4096\n",
    )
    cfg = load_config(child, ["model.hidden_size=256", "logger.wandb.tags=[a,b]"])
    assert (cfg.train.global_batch_size, cfg.train.train_iters, cfg.model.num_layers) == (64, 7, 3)
    assert cfg.model.hidden_size == 256 and cfg.logger.wandb.tags == ["a", "b"]
    validate(cfg, world_size=2)
    save_config(cfg, tmp_path / "run" / "config.yaml")
    again = load_config(tmp_path / "run" / "config.yaml")
    assert again == cfg and to_yaml(again) == to_yaml(cfg)


@pytest.mark.parametrize(
    "overrides, world, needle",
    [
        (["train.foo=1"], 1, "unknown config key 'train.foo'"),
        (["nope.x=1"], 1, "unknown config key 'nope'"),
        (["train.global_batch_size=abc"], 1, "'train.global_batch_size'"),
        (["train.dynamic_batch_enable=maybe"], 1, "'train.dynamic_batch_enable'"),
        (
            ["model.attention_backend=xformers"],
            1,
            "model.attention_backend='xformers': allowed values are auto, te, flex, sdpa",
        ),
        (
            ["model.recompute_granularity=some"],
            1,
            "model.recompute_granularity='some': allowed values are none, selective, full",
        ),
        (
            ["model.recompute_granularity=full", "model.num_moe_experts=4"],
            1,
            "model.recompute_granularity=full: not with model.num_moe_experts > 0",
        ),
        (["data.overlong=skip"], 1, "data.overlong='skip': allowed values are error, truncate, drop"),
        (["logger.wandb.mode=cloud"], 1, "logger.wandb.mode='cloud': allowed values are online, offline, disabled"),
        (["train.global_batch_size=0"], 1, "train.global_batch_size=0: must be >= 1"),
        (["train.dynamic_batch_enable=true"], 1, "train.max_tokens_per_gpu: must be set"),
        (
            ["train.dynamic_batch_enable=true", "train.max_tokens_per_gpu=1", "parallel.context_parallel_size=2"],
            2,
            "train.max_tokens_per_gpu=1: must hold at least one aligned row: 2 tokens per GPU",
        ),
        (
            [
                "train.dynamic_batch_enable=true",
                "train.max_tokens_per_gpu=100",
                "train.dynamic_batch_pad_to_multiple=128",
            ],
            1,
            "train.max_tokens_per_gpu=100: must hold at least one aligned row: 128",
        ),
        (["parallel.context_parallel_size=3"], 4, "parallel.context_parallel_size=3: must divide the world size 4"),
        (
            ["train.global_batch_size=30", "train.micro_batch_size=4"],
            2,
            "train.global_batch_size=30: must be divisible",
        ),
        (["model.hidden_size=100", "model.num_attention_heads=3"], 1, "model.hidden_size=100: must be divisible"),
        (["optimizer.min_lr=1.0"], 1, "optimizer.min_lr=1.0"),
        (["trainiters=3"], 1, "unknown config key 'trainiters'"),
        (
            ["train.dynamic_batch_layout=dense"],
            1,
            "train.dynamic_batch_layout='dense': allowed values are padded, packed",
        ),
        (["train.dynamic_batch_attention_weight=-0.5"], 1, "train.dynamic_batch_attention_weight=-0.5: must be >= 0"),
        (["train.dynamic_batch_attention_weight=inf"], 1, "train.dynamic_batch_attention_weight=inf: must be a finite"),
        (["train.dynamic_batch_attention_weight=abc"], 1, "'train.dynamic_batch_attention_weight'"),
        (["train.train_iters"], 1, "expected dotted.key=value"),
    ],
)
def test_errors_name_the_dotted_key(overrides, world, needle):
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world_size=world)
    assert needle in str(err.value)


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    path = write(tmp_path / "bad.yaml", "train:\n  max_token_per_gpu: 10\n")
    with pytest.raises(
        ConfigError,
        match=r"bad.yaml: unknown config key 'train.max_token_per_gpu' \(did you mean 'train.max_tokens_per_gpu'\?\)",
    ):
        load_config(path)


def test_missing_and_self_including_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "none.yaml")
    loop = write(tmp_path / "loop.yaml", "defaults: [loop.yaml]\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(loop)


def test_dynamic_batching_does_not_need_divisible_batches():
    cfg = load_config(
        None, ["train.dynamic_batch_enable=true", "train.max_tokens_per_gpu=512", "train.global_batch_size=7"]
    )
    validate(cfg, world_size=4)


def test_print_config_shows_the_values_the_run_uses():
    import subprocess
    import sys

    import yaml

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-m", "backend.train", str(repo / "configs" / "quickstart.yaml"), "--print-config"],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    model, train = cfg["model"], cfg["train"]
    assert model["vocab_size"] == 256 and model["ffn_hidden_size"] == 384 and model["head_dim"] == 32
    assert model["max_position_embeddings"] == cfg["data"]["max_seq_length"] == 1024
    assert model["attention_backend"] in ("sdpa", "flex", "te") and train["precision"] in ("fp32", "bf16")
    assert cfg["data"]["tokenizer"] == "byte" and cfg["checkpoint"]["dir"] == "runs/quickstart/checkpoints"
    assert train["forward_max_tokens_per_gpu"] == train["max_tokens_per_gpu"] == 8192


def test_layout_and_attention_weight_reach_the_planner():
    from backend.data.iterator import planner_from_config
    from backend.distributed.parallel_dims import ParallelDims

    cfg = validate(
        load_config(
            None,
            [
                "train.dynamic_batch_enable=true",
                "train.max_tokens_per_gpu=4096",
                "train.dynamic_batch_layout=packed",
                "train.dynamic_batch_attention_weight=0.002",
            ],
        )
    )
    plan = planner_from_config(cfg.train, ParallelDims(world_size=2))([100, 200, 300])
    assert plan.layout == "packed" and plan.attention_weight == 0.002
    forward = planner_from_config(cfg.train, ParallelDims(world_size=1), forward=True)([100, 200])
    assert forward.layout == "packed"
