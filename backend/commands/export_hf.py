#!/usr/bin/env python3
"""Export one of our checkpoints as a Hugging Face model directory (safetensors, no custom code).

    python tools/export_hf.py runs/qwen3 --output exported/qwen3-sft \\
        [--config runs/qwen3/config.yaml] [--dtype bf16|fp32] [--max-shard-size 5GB] [dotted.key=value ...]

Writes config.json, model.safetensors (or model-0000i-of-0000N.safetensors + index, cut at
--max-shard-size) and the tokenizer / chat-template files of the run's model.hf_checkpoint (or
data.tokenizer directory). ``AutoModelForCausalLM.from_pretrained(OUTPUT)`` loads it. The
checkpoint may be a step directory (``<run>/checkpoints/step_00001000``), or a run directory or
its ``checkpoints/`` (the newest complete step). --config
defaults to the run's config.yaml two levels above the step directory (<run>/checkpoints/step_*).
Overrides apply to that config, e.g. ``model.hf_checkpoint=''`` when the imported checkpoint has
moved (its architecture is in config.yaml; tokenizer files are then not copied).

A LoRA checkpoint (``model.lora.rank`` > 0) is written in PEFT's format: adapter_config.json and
adapter_model.safetensors, which ``PeftModel.from_pretrained(base, OUTPUT)`` loads onto the base
(its path is in the config as base_model_name_or_path). With ``--merge`` it is written as a whole
Hugging Face model instead, each adapter merged into its weight (W + (alpha / r) B A).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (transformers' decimal units; KiB/MiB/GiB binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _find_config(step_dir: Path) -> Path | None:
    for candidate in (step_dir.parent.parent / "config.yaml", step_dir.parent / "config.yaml"):
        if candidate.is_file():
            return candidate
    return None


def locate(path: Path) -> tuple[Path, Path | None]:
    """(the step directory to export, the run's config.yaml or None) for what the user gave: a
    step directory, a checkpoints directory or a run directory (each of the last two: its newest
    complete step). Raises UserError naming the path when there is nothing to export there."""
    import yaml

    from backend.checkpoint.store import STEP_DIR, complete_checkpoints
    from backend.errors import UserError

    if not path.exists():
        raise UserError(f"{path}: no such directory (give a run directory, its checkpoints/ or a step_* in it)")
    if STEP_DIR.match(path.name):
        return path, _find_config(path)
    root, config = path, None
    if (path / "config.yaml").is_file():  # a run directory: its checkpoint.dir, else <run>/checkpoints
        config = path / "config.yaml"
        saved = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("checkpoint") or {}
        root = Path(saved.get("dir") or path / "checkpoints")
    steps = complete_checkpoints(root)
    if not steps:
        raise UserError(f"{path}: no complete checkpoint (a step_* directory with its metadata) in {root}")
    return steps[-1], config or _find_config(steps[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "checkpoint", help="a step_* checkpoint directory, or a run or checkpoints directory (its newest step)"
    )
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the run's config")
    p.add_argument("--config", help="the run's config.yaml (default: found beside the checkpoint directory)")
    p.add_argument("--output", required=True, help="the Hugging Face directory to write (new or empty)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--max-shard-size", default="5GB", type=parse_size)
    p.add_argument(
        "--merge", action="store_true", help="a LoRA checkpoint: the merged whole model, not the PEFT adapter"
    )
    args = p.parse_args(argv)

    import logging

    from backend.config import ConfigError, load_config, validate
    from backend.errors import UserError

    try:
        step_dir, found = locate(Path(args.checkpoint))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    config = Path(args.config) if args.config else found
    if config is None:
        print(f"error: no config.yaml found beside {step_dir}; pass --config RUN/config.yaml", file=sys.stderr)
        return 2
    if step_dir != Path(args.checkpoint):
        print(f"exporting {step_dir} (the newest complete checkpoint)", file=sys.stderr)
    try:
        cfg = validate(
            load_config(
                config,
                [
                    *args.overrides,
                    "parallel.context_parallel_size=1",
                    "parallel.expert_parallel_size=1",
                    "parallel.tensor_parallel_size=1",  # checkpoints hold whole tensors at any TP size
                    "parallel.pipeline_parallel_size=1",  # and every stage's layers under the whole model's names
                    "parallel.pipeline_layers=[]",
                ],
            ),
            world_size=1,
        )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("megatron").setLevel(logging.WARNING)

    from backend.checkpoint.hf_export import export_checkpoint
    from backend.distributed.setup import init_distributed, shutdown_distributed
    from backend.errors import run_main

    def run() -> int:
        env = init_distributed(1, cfg.parallel.backend)
        try:
            out = export_checkpoint(
                step_dir,
                cfg,
                args.output,
                env,
                dtype=args.dtype,
                max_shard_bytes=args.max_shard_size,
                merge=args.merge,
            )
        except (FileNotFoundError, ValueError) as e:
            raise UserError(str(e)) from e
        finally:
            shutdown_distributed(env)
        print(f"wrote {out}")
        return 0

    # A refused checkpoint (a planted .metadata, another model's shapes) is one ``error:`` line, exit 2.
    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
