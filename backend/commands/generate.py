#!/usr/bin/env python3
"""Sample from a training checkpoint (or a Hugging Face directory) without exporting it first.

    python tools/generate.py runs/sft --prompt "Write a haiku about tides" \\
        [--prompts prompts.jsonl] [--max-new-tokens 128] [--temperature 0.7] [--seed 0] [-n 1] [--json]

The model: a run directory (its newest complete step), its ``checkpoints/``, one ``step_*``
directory (the run's ``config.yaml`` beside it says the architecture and tokenizer), or a Hugging
Face directory (``config.json`` and safetensors). Prompts: ``--prompt TEXT`` (repeatable) and/or
``--prompts FILE`` (JSONL rows with ``prompt`` text or chat ``messages``, as ``rl.prompts``).
The chat template of the tokenizer is applied to every prompt when it has one (``--raw``: the
text as it is). Sampling is the RL loop's generator (transformers, FP32, inverse-CDF draws from
a seeded generator per prompt): the same seed gives the same text. Prints each prompt and its
responses, or with ``--json`` one JSON object per line ({"prompt", "responses"}). A user error
(no such directory, a prompt file's bad line) is one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "config.yaml").is_file()


def _load_checkpoint(path: Path, overrides: list[str]):
    """(hf_config, (name, tensor) stream, tokenizer spec, vocab_limit) of one of our checkpoints."""
    from backend.checkpoint.hf_export import export_fields, full_named_tensors
    from backend.checkpoint.lora_base import check_lora_checkpoint
    from backend.checkpoint.store import load_model_weights
    from backend.config import load_config, validate
    from backend.data.tokenizers import build_tokenizer
    from backend.distributed.setup import init_distributed
    from backend.errors import UserError
    from backend.model.factory import build_model
    from backend.model.forward import output_settings
    from backend.model.hf.export import hf_config_dict, hf_tensors
    from backend.model.lora import merge_stream
    from backend.rl.loop import stop_token_ids

    from .export_hf import locate

    step_dir, config = locate(path)
    if config is None:
        raise UserError(f"{step_dir}: no config.yaml beside it (the run's architecture and tokenizer)")
    single = [
        "parallel.context_parallel_size=1",
        "parallel.expert_parallel_size=1",
        "parallel.tensor_parallel_size=1",
        "parallel.pipeline_parallel_size=1",  # checkpoints hold the whole model at any TP / PP size
        "parallel.pipeline_layers=[]",
    ]
    cfg = validate(load_config(config, [*overrides, *single]), world_size=1)
    env = init_distributed(1, cfg.parallel.backend)
    vocab = cfg.model.vocab_size or build_tokenizer(cfg.data.tokenizer).vocab_size
    built = build_model(cfg, env, tokenizer_vocab=vocab, training=False, empty=True)
    check_lora_checkpoint(cfg, env, step_dir)
    load_model_weights(built.model, step_dir)
    fields = export_fields(cfg, built.fields)
    weights = hf_tensors(merge_stream(built.model, full_named_tensors(built.model), fields), fields, dtype="fp32")
    limit = output_settings(built.model).vocab_limit
    print(f"model: {step_dir}", file=sys.stderr)
    stops = functools.partial(stop_token_ids, cfg)  # rl.stop_token_ids, the imported model's eos, the EOD
    return hf_config_dict(fields, dtype="fp32"), weights, cfg.data.tokenizer, limit, env, stops


def _load_hf(path: Path):
    """(hf_config, (name, tensor) stream, tokenizer spec, vocab_limit) of a Hugging Face directory."""
    from backend.config.hf import weights_problem
    from backend.errors import UserError
    from backend.model.hf.safetensors_io import HFCheckpoint
    from backend.rl.loop import eos_token_ids

    problem = weights_problem(path)
    if problem:
        raise UserError(problem)
    hf_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    ckpt = HFCheckpoint(path)
    weights = ((name, ckpt.get(name).float()) for name in ckpt.names())
    tokenizer = str(path) if (path / "tokenizer.json").is_file() else "byte"
    eos = eos_token_ids(path / "generation_config.json") or eos_token_ids(path / "config.json")
    return hf_config, weights, tokenizer, None, None, lambda tok: eos or _stops(tok)


def _prompts(args, tokenizer, tokenizer_spec: str) -> list[tuple[str, list[int]]]:
    """(text shown, token ids) per prompt, the chat template applied where there is one."""
    from backend.data.chat import ChatRenderer, chat_template_dir
    from backend.data.jsonl import jsonl_rows
    from backend.errors import UserError

    template = None if args.raw else chat_template_dir(tokenizer_spec)
    renderer = ChatRenderer(template) if template is not None else None
    rows = [({"prompt": text}, f"--prompt {i + 1}") for i, text in enumerate(args.prompt or [])]
    if args.prompts:
        if not Path(args.prompts).is_file():
            raise UserError(f"--prompts: no such file {args.prompts}")
        rows += [(row, where) for where, row in jsonl_rows(args.prompts)]
    out = []
    for row, where in rows:
        if not isinstance(row, dict) or not ({"prompt", "messages"} & set(row)):
            raise UserError(f"{where}: expected an object with 'prompt' text or chat 'messages'")
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if renderer is not None:
            text, ids = renderer.generation_prompt(messages, where)
        elif "prompt" in row:
            text, ids = row["prompt"], list(tokenizer.encode(row["prompt"]))
        else:
            raise UserError(f"{where}: 'messages' need a chat template; data.tokenizer={tokenizer_spec} has none")
        if not ids:
            raise UserError(f"{where}: the prompt has no tokens")
        out.append((text, ids))
    if not out:
        raise UserError("no prompts: give --prompt TEXT or --prompts FILE")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a run, checkpoints or step_* directory, or a Hugging Face model directory")
    p.add_argument("overrides", nargs="*", default=[], help="dotted.key=value overrides of the run's config")
    p.add_argument("--prompt", action="append", help="a prompt's text (repeatable)")
    p.add_argument("--prompts", help="a JSONL file of rows with 'prompt' text or chat 'messages'")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to sample at most per response")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    p.add_argument("-n", type=int, default=1, help="responses per prompt")
    p.add_argument("--raw", action="store_true", help="no chat template: the prompt text as it is")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: prompt, responses")
    args = p.parse_args(argv)

    from backend.errors import UserError, run_main

    def run() -> int:
        if not args.temperature > 0:
            raise UserError(f"--temperature {args.temperature}: must be > 0")
        if args.max_new_tokens < 1 or args.n < 1:
            raise UserError("--max-new-tokens and -n: must be >= 1")
        path = Path(args.model)
        if not path.exists():
            hint = " (a Hugging Face Hub id? download it first)" if len(path.parts) == 2 else ""
            raise UserError(f"{path}: no such directory{hint}")
        from backend.data.tokenizers import build_tokenizer
        from backend.distributed.setup import shutdown_distributed
        from backend.generators.hf import HFGenerator

        env = None
        try:
            if _is_hf_dir(path):
                hf_config, weights, spec, limit, env, stops = _load_hf(path)
            else:
                hf_config, weights, spec, limit, env, stops = _load_checkpoint(path, args.overrides)
            tokenizer = build_tokenizer(spec)
            prompts = _prompts(args, tokenizer, spec)
            gen = HFGenerator(hf_config, vocab_limit=limit, stop_token_ids=stops(tokenizer))
            gen.load_weights(weights)
        finally:
            if env is not None:
                shutdown_distributed(env)
        batches = gen.generate_batch(
            [ids for _, ids in prompts],
            args.n,
            args.temperature,
            args.max_new_tokens,
            [args.seed + i for i in range(len(prompts))],
        )
        for (text, _), completions in zip(prompts, batches):
            responses = [tokenizer.decode(c.token_ids) for c in completions]
            if args.json:
                print(json.dumps({"prompt": text, "responses": responses}))
            else:
                print(f"=== prompt\n{text}")
                for i, r in enumerate(responses):
                    print(f"--- response {i + 1}\n{r}")
        return 0

    return run_main(run)


def _stops(tokenizer) -> list[int]:
    eod = getattr(tokenizer, "eod_id", None)
    return [eod] if eod is not None else []


if __name__ == "__main__":
    sys.exit(main())
