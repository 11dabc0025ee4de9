#!/usr/bin/env python3
"""Per-token log-probabilities of a JSONL file's samples under a config's model (forward only).

    python tools/compute_logprobs.py configs/quickstart.yaml --input samples.jsonl --output logprobs.jsonl \\
        [--checkpoint runs/quickstart/checkpoints/step_00000020] [dotted.key=value ...]
    torchrun --nproc-per-node 8 tools/compute_logprobs.py CONFIG --input ... --output ...

Samples are planned under train.forward_max_tokens_per_gpu (default: train.max_tokens_per_gpu),
spread over data-parallel ranks, right-padded (or packed: train.dynamic_batch_layout), run,
cropped, and written in input order: one line per sample, {"index": i, "logprobs": [log p(token t
| tokens before t) for t = 1..n-1]}.

With --merge-as old_logprobs (or ref_logprobs) the output is instead the input rows themselves,
each with that field added, aligned like loss_mask (entry 0 null): training rows for
loss.type=policy, ready to use as data.path. The rows' other fields (advantages, loss_mask, ids)
are kept as they are:

    python tools/compute_logprobs.py configs/qwen3_4b_grpo.yaml --input rollouts.jsonl \\
        --output rollouts_ref.jsonl --merge-as ref_logprobs --checkpoint checkpoints/ref/step_00001000
--temperature T (default: loss.temperature, 1) divides the logits by T first: the log-probabilities
of the distribution a sampler at temperature T drew from. Weights: --checkpoint when given; else model.hf_checkpoint's (a Hugging Face model) when set;
else the newest complete checkpoint in the config's checkpoint directory. Checkpoints load with
the pickle-free loader (backend.checkpoint.safe_dcp), their parameter names and shapes checked against
the configured model first. A user error (a bad config key, data line or checkpoint) prints one
``error:`` line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the YAML config of the model (as for python -m backend.train)")
    p.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides (optional)")
    p.add_argument(
        "--input", required=True, help="JSONL rows with text (data.json_key), input_ids or chat messages, one per line"
    )
    p.add_argument(
        "--output", required=True, help="the JSONL to write: index/logprobs lines, or the rows with --merge-as"
    )
    p.add_argument("--checkpoint", help="a step_* checkpoint directory (default: the newest complete one)")
    p.add_argument(
        "--merge-as",
        choices=("old_logprobs", "ref_logprobs", "rollout_logprobs"),
        help="write the input rows with this field (old_logprobs, ref_logprobs or rollout_logprobs) added instead "
        "of index/logprobs lines",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="divide the logits by this before the log-softmax (the sampler's temperature; default loss.temperature)",
    )
    args = p.parse_args(argv)

    import os

    from backend.config import checkpoint_dir, load_config, validate
    from backend.data.chat import LazyChatRenderer, chat_template_dir
    from backend.data.errors import DataNotFoundError
    from backend.data.iterator import planner_from_config
    from backend.data.jsonl import read_jsonl
    from backend.data.row_fields import with_logprobs
    from backend.data.tokenizers import build_tokenizer
    from backend.errors import UserError, run_main

    def run() -> int:
        cfg = validate(load_config(args.config, args.overrides), int(os.environ.get("WORLD_SIZE", "1")))
        if not Path(args.input).is_file():
            raise DataNotFoundError(f"--input: no such file {args.input}")
        tokenizer = build_tokenizer(cfg.data.tokenizer)
        chat = LazyChatRenderer(chat_template_dir(cfg.data.tokenizer))  # messages rows: the tokenizer's template
        samples = list(read_jsonl(args.input, tokenizer, cfg.data.json_key, chat))
        rows = [json.loads(line) for line in Path(args.input).read_text(encoding="utf-8").splitlines() if line.strip()]
        if not cfg.train.forward_max_tokens_per_gpu and not cfg.train.max_tokens_per_gpu:
            raise UserError("set train.forward_max_tokens_per_gpu (or train.max_tokens_per_gpu)")
        temperature = cfg.loss.temperature if args.temperature is None else args.temperature
        if not temperature > 0:
            raise UserError(f"--temperature {temperature}: must be > 0")

        from backend.checkpoint.lora_base import check_lora_checkpoint
        from backend.checkpoint.store import complete_checkpoints, load_model_weights
        from backend.distributed.setup import init_from_config, shutdown_distributed
        from backend.model.factory import build_model
        from backend.train.forward_only import compute_logprobs

        env = init_from_config(cfg)
        try:
            ckpt = args.checkpoint
            if ckpt is None and not cfg.model.hf_checkpoint:
                found = complete_checkpoints(checkpoint_dir(cfg))
                ckpt = str(found[-1]) if found else None
            built = build_model(cfg, env, tokenizer_vocab=tokenizer.vocab_size, training=False, empty=ckpt is not None)
            model = built.model
            if ckpt is not None:
                check_lora_checkpoint(cfg, env, ckpt)  # LoRA: its adapters belong to this base
                load_model_weights(model, ckpt)  # model weights only, shapes checked first; no optimizer state
            elif cfg.model.hf_checkpoint:
                ckpt = cfg.model.hf_checkpoint
            elif env.is_main:
                print("warning: no checkpoint found; using freshly initialised weights", file=sys.stderr)
            planner = planner_from_config(cfg.train, env.dims, forward=True)
            logprobs = compute_logprobs(model, samples, env, planner, temperature=temperature)
            if env.is_main:
                with open(args.output, "w", encoding="utf-8") as f:
                    for i, lp in enumerate(logprobs):
                        if args.merge_as:
                            f.write(json.dumps(with_logprobs(rows[i], lp, args.merge_as)) + "\n")
                        else:
                            f.write(json.dumps({"index": i, "logprobs": [float(x) for x in lp]}) + "\n")
                print(f"wrote log-probabilities of {len(samples)} samples to {args.output} (checkpoint: {ckpt})")
        finally:
            shutdown_distributed(env)
        return 0

    return run_main(run)


if __name__ == "__main__":
    sys.exit(main())
