"""HF weights loaded one parameter at a time into an FSDP2-sharded GPTModel (2 gloo ranks).

Each rank reads the same safetensors file and keeps its own dim-0 shard of every parameter
(``distribute_tensor(..., src_data_rank=None)``, no communication); the sharded model's forward
must then give transformers' logits.
"""

from __future__ import annotations

import pytest
import torch

from .harness import run_ranks

pytestmark = pytest.mark.distributed
transformers = pytest.importorskip("transformers")


KINDS = ("qwen3", "qwen2")  # tied embeddings + QK norm; QKV bias + YaRN


def load_sharded(rank: int, world: int, hf_root: str, tokens: torch.Tensor, valid: torch.Tensor):
    from backend.train.wrap import wrap_fsdp

    from backend.distributed.setup import init_distributed
    from backend.model.hf.config import read_hf_config
    from backend.model.hf.load import load_hf_weights
    from tests.helpers.hf_tiny import build_megatron, megatron_logits

    env = init_distributed(1)
    out = {}
    for kind in KINDS:
        hf_dir = f"{hf_root}/{kind}"
        fields = read_hf_config(hf_dir)
        model = wrap_fsdp(build_megatron(fields), env, bf16=False)
        load_hf_weights(model, hf_dir, fields)
        emb = dict(model.named_parameters())["embedding.word_embeddings.weight"]
        with torch.no_grad():
            logits = megatron_logits(model, fields, tokens, valid)
        out[kind] = {"logits": logits, "local_rows": emb.to_local().shape[0], "placements": str(emb.placements)}
    return out


def test_fsdp_sharded_load_matches_transformers(tmp_path):
    from tests.helpers.hf_tiny import right_padded_batch, tiny_hf_model

    tokens, valid = right_padded_batch()
    refs = {}
    for kind in KINDS:
        hf = tiny_hf_model(kind, tmp_path / "hf" / kind)
        with torch.no_grad():
            refs[kind] = hf(input_ids=tokens, attention_mask=valid.long()).logits
    (tmp_path / "ranks").mkdir()
    results = run_ranks(load_sharded, 2, tmp_path / "ranks", str(tmp_path / "hf"), tokens, valid)
    for rank_result in results:
        for kind in KINDS:
            r = rank_result[kind]
            assert r["local_rows"] == 150 and "Shard(dim=0)" in r["placements"]  # 300 vocab rows / 2 ranks
            diff = float((r["logits"] - refs[kind])[valid].abs().max())
            print(f"{kind} FSDP x2: max |logit diff| = {diff:.3g}")
            assert diff <= 1e-4
