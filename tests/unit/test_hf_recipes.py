"""The real-model recipes describe Qwen3-4B and Llama 3.1 8B exactly (built on the meta device).

The recipes name a Hugging Face directory users download; the test does not need it: clearing
``model.hf_checkpoint`` leaves the recipe's explicit architecture keys, which must give the
released models' parameter counts to the parameter (4,022,468,096 and 8,030,261,248).
"""

from __future__ import annotations

import pytest

from backend.config import load_config, validate
from tests.conftest import REPO


@pytest.mark.parametrize(
    "recipe,params,family,head_dim",
    [
        ("qwen3_4b_dynamic", 4_022_468_096, "qwen3", 128),
        ("qwen3_4b_grpo", 4_022_468_096, "qwen3", 128),
        ("llama31_8b_dynamic", 8_030_261_248, "llama", 128),
        ("llama31_70b_pipeline", 70_553_706_496, "llama", 128),
    ],
)
def test_recipe_architecture_is_the_released_model(world, recipe, params, family, head_dim):
    from backend.model.factory import meta_model
    from backend.model.fields import model_family

    recipe_cfg = load_config(REPO / "configs" / f"{recipe}.yaml", ["model.hf_checkpoint=''"])
    p = recipe_cfg.parallel  # the world it is written for: 8 GPUs, or 8 nodes x 8 for the 70B
    world_size = 8 * p.pipeline_parallel_size * (2 if p.pipeline_parallel_size > 1 else 1)
    cfg = validate(recipe_cfg, world_size=world_size)
    assert cfg.data.tokenizer == "byte"  # auto without a checkpoint
    model = meta_model(cfg, tokenizer_vocab=256)
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == params
    assert model_family(cfg.model) == family
    core = next(m for m in model.modules() if hasattr(m, "rope_spec"))
    assert core.head_dim == head_dim
    if family == "llama":
        scaling = dict(core.rope_spec.scaling)
        assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
        assert scaling["original_max_position_embeddings"] == 8192


def test_recipe_refuses_a_missing_checkpoint():
    from backend.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.hf_checkpoint='checkpoints/Qwen3-4B': no such directory"):
        load_config(REPO / "configs" / "qwen3_4b_dynamic.yaml")


def test_grpo_recipe_is_packed_policy_training_with_a_reference():
    overrides = ["model.hf_checkpoint=''"]
    cfg = validate(load_config(REPO / "configs" / "qwen3_4b_grpo.yaml", overrides), world_size=8)
    assert cfg.train.dynamic_batch_enable and cfg.train.dynamic_batch_layout == "packed"
    loss = cfg.loss
    assert (loss.type, loss.kl_estimator, loss.old_logprobs) == ("policy", "k3", "recompute")
    assert loss.ratio_clip_high > loss.ratio_clip_low and loss.kl_coef > 0 and loss.reference_checkpoint
    assert cfg.checkpoint.interval % loss.minibatches_per_rollout == 0


def test_finetune_recipe_sets_no_architecture_and_trains_a_tiny_checkpoint(world, tmp_path, embedded_cache):
    """configs/finetune_hf.yaml fits any checkpoint: its config.json gives the architecture and the
    context (data.max_seq_length: 0), its tokenizer reads text and chat rows; 2 steps train."""
    import json

    import yaml

    from backend.config.resolve import ARCHITECTURE_KEYS
    from backend.train.trainer import Trainer
    from tests.helpers.hf_tiny import COMMON, tiny_hf_model

    recipe = REPO / "configs" / "finetune_hf.yaml"
    assert not set(yaml.safe_load(recipe.read_text())["model"]) & set(ARCHITECTURE_KEYS)
    tiny_hf_model("llama", tmp_path / "ckpt", tokenizer=True)
    data = tmp_path / "train.jsonl"
    with data.open("w") as f:
        for i in range(24):
            f.write(json.dumps({"text": f"row {i} " * (1 + i % 5)}) + "\n")
        for i in range(8):
            chat = [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": f"hello {i}"}]
            f.write(json.dumps({"messages": chat}) + "\n")
    overrides = [
        f"model.hf_checkpoint={tmp_path / 'ckpt'}",
        f"data.path={data}",
        f"data.cache_dir={embedded_cache}",
        f"logger.run_dir={tmp_path / 'run'}",
        "logger.log_interval=1000",
    ]
    cfg = validate(load_config(recipe, overrides))
    assert cfg.data.max_seq_length == COMMON["max_position_embeddings"]  # the checkpoint's context
    assert cfg.model.hidden_size == COMMON["hidden_size"] and cfg.train.train_iters == 2
    trainer = Trainer(cfg, world)
    try:
        assert trainer.train() == "finished"
    finally:
        trainer.metrics.close()
        for lock in trainer.locks:
            lock.release()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["loss"] > 0 for r in steps)


def test_a_required_recipe_key_is_named_until_set():
    from backend.config import ConfigError

    with pytest.raises(
        ConfigError, match=r"model.hf_checkpoint: required by .*finetune_hf.yaml \(written \?\?\? there\)"
    ):
        load_config(REPO / "configs" / "finetune_hf.yaml")
