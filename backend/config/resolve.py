"""Resolve what a config leaves to be derived: the architecture of ``model.hf_checkpoint``,
``data.max_seq_length=0`` (the model's context) and ``data.tokenizer=auto``. Runs once, inside
``load_config``, before validation.

With ``model.hf_checkpoint: DIR`` the checkpoint's config.json is the architecture: every model
key it defines (layers, widths, heads, head_dim, vocabulary, RoPE base and scaling, norm epsilon,
QK norm, QKV bias, tied embeddings, max positions) is set from it. A key the user wrote (in any
YAML layer or override) must agree, or the load stops naming both values: a recipe saying
``hidden_size: 4096`` beside a checkpoint of 2560 is a mistake, not a preference. Keys left at
their schema defaults are simply replaced, and 0 / null keep meaning "derive it".
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import ConfigError
from .hf import FIELDS, GPT_OSS_FIELDS, HFConfigError, check_against_explicit, read_hf_config, weights_problem
from .schema import Config, RopeScalingConfig

#: Our model keys that config.json determines (``backend.config.hf.FIELDS`` minus model_type).
ARCHITECTURE_KEYS = tuple(k for k in FIELDS if k not in ("model_type", "rope_scaling"))
#: GPT-OSS keys config.json also determines (``backend.config.hf.GPT_OSS_FIELDS`` that are architecture;
#: ``router_aux_loss_coef`` is a training choice, model.moe_aux_loss_coeff, and is not taken from it).
GPT_OSS_ARCHITECTURE_KEYS = tuple(k for k in GPT_OSS_FIELDS if k != "router_aux_loss_coef")


def hf_architecture(hf_dir: str) -> tuple[dict, RopeScalingConfig]:
    """(our model keys -> values, RoPE scaling) from ``hf_dir/config.json``; ConfigError if refused."""
    try:
        fields = read_hf_config(hf_dir)
        scaling = RopeScalingConfig.from_hf(fields["rope_scaling"])
    except (HFConfigError, ValueError) as e:
        raise ConfigError(f"model.hf_checkpoint={hf_dir!r}: {e}") from None
    keys = ARCHITECTURE_KEYS + (GPT_OSS_ARCHITECTURE_KEYS if fields["model_type"] == "gpt_oss" else ())
    return {k: fields[k] for k in keys}, scaling


def _apply_hf_checkpoint(cfg: Config, explicit: set[str]) -> None:
    m = cfg.model
    if not Path(m.hf_checkpoint).is_dir():
        hub = re.fullmatch(r"[\w.-]+/[\w.-]+", m.hf_checkpoint) and not m.hf_checkpoint.startswith(".")
        hint = (
            "; it looks like a Hugging Face Hub id: download it first (huggingface-cli download "
            f"{m.hf_checkpoint} --local-dir DIR) and give DIR"
            if hub
            else ""
        )
        raise ConfigError(f"model.hf_checkpoint={m.hf_checkpoint!r}: no such directory{hint}")
    arch, scaling = hf_architecture(m.hf_checkpoint)
    problem = weights_problem(m.hf_checkpoint)
    if problem:
        raise ConfigError(f"model.hf_checkpoint={m.hf_checkpoint!r}: {problem}")
    expected = dict(arch) | {f"rope_scaling.{k}": v for k, v in vars(scaling).items()}
    given = {}
    for key in sorted(k for k in explicit if k.removeprefix("model.") in expected and k.startswith("model.")):
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        given[key] = node
    try:
        check_against_explicit(expected, given, source=str(Path(m.hf_checkpoint) / "config.json"))
    except HFConfigError as e:
        raise ConfigError(str(e)) from None
    for key, value in arch.items():
        setattr(m, key, list(value) if isinstance(value, list) else value)
    m.rope_scaling = scaling


def resolve(cfg: Config, explicit: set[str]) -> Config:
    """Fill ``cfg`` in place from model.hf_checkpoint and decide data.tokenizer; returns it."""
    if cfg.model.hf_checkpoint:
        _apply_hf_checkpoint(cfg, explicit)
    if cfg.data.max_seq_length == 0:  # the model's context: a recipe that fits any checkpoint
        if not cfg.model.max_position_embeddings:
            raise ConfigError(
                "data.max_seq_length=0 means the model's context (model.max_position_embeddings), which is not set: "
                "set data.max_seq_length, or model.hf_checkpoint (its config.json gives it)"
            )
        cfg.data.max_seq_length = cfg.model.max_position_embeddings
    if cfg.data.tokenizer == "auto":
        hf_dir = cfg.model.hf_checkpoint
        if not hf_dir:
            cfg.data.tokenizer = "byte"
        elif (Path(hf_dir) / "tokenizer.json").is_file():
            cfg.data.tokenizer = hf_dir
        else:
            raise ConfigError(
                f"data.tokenizer=auto: model.hf_checkpoint={hf_dir!r} has no tokenizer.json; set data.tokenizer "
                "(byte, or the path of a tokenizer.json) explicitly"
            )
    return cfg
