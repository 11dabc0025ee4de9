"""One vLLM server for an RL run's policy, started elsewhere than the loop (a Slurm generator node):

    python -m backend.generators.serve CONFIG.yaml [dotted.key=value ...] [--port 8000] [--host 0.0.0.0]

The server's model is the policy the config describes (its config.json written to a temporary
directory, no weights: the loop's first sync sends them), started exactly as the loop starts its
own (``servers.server_command``: the gloo transfer engine, the token-in / token-out endpoint,
processed log-probabilities), under ``VLLM_SERVER_DEV_MODE=1``. The process becomes the server
(``exec``), so a signal to it (srun's at the end of a job) stops the server itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def policy_hf_config(cfg) -> dict:
    """The config.json ``PolicyWorker.hf_config(float32)`` gives for ``cfg``, without a model."""
    from backend.checkpoint.hf_export import export_fields
    from backend.config.run_values import padded_vocab
    from backend.data.tokenizers import build_tokenizer
    from backend.model.fields import model_fields
    from backend.model.hf.export import hf_config_dict

    tokenizer = build_tokenizer(cfg.data.tokenizer, eod=cfg.data.append_eod)
    vocab = padded_vocab(cfg.model, tokenizer.vocab_size)
    fields = model_fields(cfg.model, vocab_size=vocab, max_seq_length=cfg.data.max_seq_length)
    return hf_config_dict(export_fields(cfg, fields), dtype="fp32")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="the RL run's config (the policy's model and data.max_seq_length)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides, as the loop is given")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="0.0.0.0")
    args = p.parse_args(argv)
    import torch

    from backend.config import load_config

    from .servers import server_command
    from .transport import backend

    cfg = load_config(args.config, args.overrides)  # resolved: data.tokenizer=auto made concrete
    model_dir = Path(tempfile.mkdtemp(prefix="vllm_server_config_"))
    (model_dir / "config.json").write_text(json.dumps(policy_hf_config(cfg)), encoding="utf-8")
    cmd = server_command(
        str(model_dir),
        args.port,
        max_model_len=cfg.data.max_seq_length,
        tensor_parallel_size=cfg.rl.vllm_server.tensor_parallel_size,
        cpu=not torch.cuda.is_available(),
        host=args.host,
        transfer=backend(cfg.rl.vllm_server.transport, cuda=torch.cuda.is_available()),
    )
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    print(f"vLLM server for {args.config} on {args.host}:{args.port}", flush=True)
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
