"""HF weights loaded through ``build_model`` into an FSDP2-sharded GPTModel (2 gloo ranks).

The model is built on the meta device, sharded, given empty shards and filled: each rank reads
the same safetensors file and keeps its own dim-0 shard of every parameter
(``distribute_tensor(..., src_data_rank=None)``, no communication); the sharded model's forward
must then give transformers' logits.
"""

from __future__ import annotations

import pytest
import torch

from .harness import run_ranks

pytestmark = pytest.mark.distributed

KINDS = ("qwen3", "qwen2")  # tied embeddings + QK norm; QKV bias + YaRN


def load_sharded(rank: int, world: int, dirs: dict, tokens: torch.Tensor, valid: torch.Tensor):
    from backend.distributed.setup import init_distributed
    from tests.helpers.hf_tiny import build_from_hf, our_logits

    env = init_distributed(1)
    out = {}
    for kind, hf_dir in dirs.items():
        model = build_from_hf(hf_dir, env).model
        emb = dict(model.named_parameters())["embedding.word_embeddings.weight"]
        out[kind] = {
            "logits": our_logits(model, tokens, valid),
            "local_rows": emb.to_local().shape[0],
            "placements": str(emb.placements),
        }
    return out


def test_fsdp_sharded_load_matches_transformers(tmp_path, tiny_hf):
    from tests.helpers.hf_tiny import hf_logits, right_padded_batch

    tokens, valid = right_padded_batch()
    refs = {kind: hf_logits(tiny_hf[kind][1], tokens, valid) for kind in KINDS}
    dirs = {kind: str(tiny_hf[kind][0]) for kind in KINDS}
    results = run_ranks(load_sharded, 2, tmp_path, dirs, tokens, valid)
    for rank_result in results:
        for kind in KINDS:
            r = rank_result[kind]
            assert r["local_rows"] == 150 and "Shard(dim=0)" in r["placements"]  # 300 vocab rows / 2 ranks
            diff = float((r["logits"] - refs[kind])[valid].abs().max())
            print(f"{kind} FSDP x2: max |logit diff| = {diff:.3g}")
            assert diff <= 1e-4
