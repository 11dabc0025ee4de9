"""Load a config: YAML files (with ``defaults:`` inheritance), then dotted overrides, then one
validation pass. A value written ``???`` is required: the load stops naming the key until it is
set. OmegaConf in struct mode rejects unknown keys; every error names the dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from .errors import ConfigError
from .resolve import resolve
from .schema import Config

log = logging.getLogger(__name__)


def _allowed_keys(dotted: str) -> str:
    """The keys allowed beside an unknown dotted key, for the error message."""
    node: object = Config()
    for part in dotted.split(".")[:-1]:
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return ""
        node = getattr(node, part)
    if not dataclasses.is_dataclass(node):
        return ""
    return ", ".join(f.name for f in dataclasses.fields(node))


def _schema_node(dotted_parent: str):
    """The schema dataclass at ``dotted_parent`` ('' = the top level), or None where the path leaves
    the dataclasses (a dict- or list-valued field holds keys of the user's own)."""
    node: object = Config()
    for part in filter(None, dotted_parent.split(".")):
        if not dataclasses.is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node if dataclasses.is_dataclass(node) else None


def _unknown_key_errors(layers: list[tuple[str, DictConfig]]) -> list[str]:
    """Every key of every layer that the schema does not have, each with its source and, where a
    close one exists, "did you mean" (difflib over the section's keys, and over every dotted key
    for a key in the wrong section); and every quoted string given to a true/false key."""
    everywhere = sorted(_leaf_keys(OmegaConf.structured(Config)))
    errors = []
    for source, layer in layers:
        for key in sorted(_leaf_keys(layer)):
            parts = key.split(".")
            for depth in range(1, len(parts) + 1):
                parent, name = ".".join(parts[: depth - 1]), parts[depth - 1]
                node = _schema_node(parent)
                if node is None:  # inside a free-form field: not ours to check
                    break
                fields = [f.name for f in dataclasses.fields(node)]
                if name in fields:
                    if depth == len(parts) and isinstance(getattr(node, name), bool):
                        value = OmegaConf.select(layer, key, throw_on_missing=False)
                        if isinstance(value, str):  # OmegaConf would read "no", "off", "0" as False
                            errors.append(
                                f"{source}: bad value for '{key}': {value!r} is a string; write true or false "
                                "(unquoted: a quoted 'no' would otherwise read as false)"
                            )
                    continue
                bad = ".".join(parts[:depth])
                close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
                if close:
                    hint = f"did you mean '{'.'.join([*parts[: depth - 1], close[0]])}'?"
                else:
                    moved = (
                        difflib.get_close_matches(bad, everywhere, n=1, cutoff=0.75)
                        or [k for k in everywhere if k.rsplit(".", 1)[-1] == name][:1]
                    )
                    hint = (
                        f"did you mean '{moved[0]}'?"
                        if moved
                        else f"allowed keys in '{parent or '<top level>'}': {', '.join(fields)}"
                    )
                errors.append(f"{source}: unknown config key '{bad}' ({hint})")
                break
    return errors


def _explain(exc: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(exc, "full_key", None) or "?"
    if isinstance(exc, ConfigKeyError) or "not in" in str(exc):
        parent = key.rsplit(".", 1)[0] if "." in key else "<top level>"
        allowed = _allowed_keys(key)
        return ConfigError(f"{source}: unknown config key '{key}' (allowed keys in '{parent}': {allowed})")
    first_line = str(exc).splitlines()[0]
    if "Incompatible value 'None'" in first_line:  # `key=` with nothing after it
        return ConfigError(f"{source}: '{key}' is empty; give it a value ({first_line.split(' for ')[-1]})")
    return ConfigError(f"{source}: bad value for '{key}': {first_line}")


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[str, DictConfig]]:
    """The file's ``defaults`` (paths relative to it, merged first, in order), then the file."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'defaults' includes itself: {' -> '.join(map(str, (*seen, path)))}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, train, ...)")
    defaults = data.pop("defaults", []) or []
    if isinstance(defaults, str):
        defaults = [defaults]
    layers: list[tuple[str, DictConfig]] = []
    for base in defaults:
        layers.extend(_read_yaml(path.parent / str(base), (*seen, path)))
    layers.append((str(path), OmegaConf.create(data)))
    return layers


def _layers(path, overrides: Sequence[str]) -> list[tuple[str, DictConfig]]:
    """(source, layer) in merge order: the YAML files, then one layer per override."""
    layers = _read_yaml(Path(path)) if path is not None else []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r}: expected dotted.key=value, e.g. train.train_iters=20")
        layers.append((f"override {item!r}", OmegaConf.from_dotlist([item])))
    return layers


def _leaf_keys(node, prefix: str = "") -> set[str]:
    if not isinstance(node, DictConfig):
        return {prefix}
    out: set[str] = set()
    for key in node.keys():
        out |= _leaf_keys(node._get_node(key), f"{prefix}{key}" if not prefix else f"{prefix}.{key}")
    return out


def explicit_keys(path: str | Path | None = None, overrides: Sequence[str] = ()) -> set[str]:
    """The dotted keys the user set (in any YAML layer or override), defaults excluded.

    ``model.hf_checkpoint`` needs them: an architecture key the user wrote must agree with the
    checkpoint's config.json, while a schema default is simply replaced by the checkpoint's value.
    """
    return _explicit(_layers(path, overrides))


def _explicit(layers: list[tuple[str, DictConfig]]) -> set[str]:
    keys: set[str] = set()
    for _, layer in layers:
        keys |= _leaf_keys(layer)
    return keys


def _required_unset(layers: list[tuple[str, DictConfig]]) -> list[str]:
    """Keys a layer wrote as ``???`` that no later layer set (merging ``???`` keeps the old value)."""
    required: set[str] = set()
    for _, layer in layers:
        marked = set(OmegaConf.missing_keys(layer))
        required = (required - (_leaf_keys(layer) - marked)) | marked
    return sorted(required)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Build the resolved Config (not yet validated against a world size: see ``validate``).

    Resolution (``resolve.resolve``) happens here, once: ``model.hf_checkpoint`` fills the
    architecture from its config.json and ``data.tokenizer=auto`` becomes a concrete tokenizer, so
    ``--print-config`` and the run's saved config.yaml show what is actually built.
    """

    cfg = OmegaConf.structured(Config)
    OmegaConf.set_struct(cfg, True)
    layers = _layers(path, overrides)
    errors = _unknown_key_errors(layers)  # every misspelled key at once, before the first merge stops
    for source, layer in layers if not errors else ():
        try:
            cfg = OmegaConf.merge(cfg, layer)
        except OmegaConfBaseException as e:  # a value of the wrong type: noted, the other layers still merged
            errors.append(str(_explain(e, source)))
    if errors:
        raise ConfigError(errors[0] if len(errors) == 1 else "invalid config:\n  " + "\n  ".join(errors))
    missing = _required_unset(layers)  # a recipe's ``???``: the user must say it
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: required by {path} (written ??? there); set it on the command line, "
            f"e.g. {missing[0]}=VALUE"
        )
    try:
        resolved = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _explain(e, "config") from None
    cfg = resolve(resolved, _explicit(layers))
    warmup, iters = cfg.scheduler.warmup_iters, cfg.train.train_iters
    if warmup > iters and os.environ.get("RANK", "0") == "0":  # a short test run may mean it: said, not refused
        log.warning(
            "warning: scheduler.warmup_iters=%d is longer than the run (train.train_iters=%d): the learning rate stops at "
            "%.3g of optimizer.lr=%g and never reaches it; set scheduler.warmup_iters <= %d",
            warmup,
            iters,
            iters / warmup,
            cfg.optimizer.lr,
            iters,
        )
    return cfg


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_yaml(cfg), encoding="utf-8")
