"""HF weights loaded through ``build_model`` into an FSDP2-sharded GPTModel (2 gloo ranks).

The model is built on the meta device, sharded, given empty shards and filled: each rank reads
the same safetensors file and keeps its own dim-0 shard of every parameter
(``distribute_tensor(..., src_data_rank=None)``, no communication); the sharded model's forward
must then give transformers' logits. GPT-OSS too (3 ranks): each rank reads only its experts (2, 2, 0 of 4),
dense or from MXFP4 pairs sliced before dequantisation (compared with transformers' own
dequantisation of the whole tensor).
"""

from __future__ import annotations

import pytest
import torch

from .harness import run_ranks

pytestmark = pytest.mark.distributed

KINDS = ("qwen3", "qwen2")  # tied embeddings + QK norm; QKV bias + YaRN


def load_sharded(rank: int, world: int, dirs: dict, tokens: torch.Tensor, valid: torch.Tensor, *extra: str):
    from backend.distributed.setup import init_distributed
    from tests.helpers.hf_tiny import build_from_hf, our_logits

    env = init_distributed(1)
    out = {}
    for kind, hf_dir in dirs.items():
        model = build_from_hf(hf_dir, env, *extra).model
        params = dict(model.named_parameters())
        emb = params["embedding.word_embeddings.weight"]
        out[kind] = {
            "logits": our_logits(model, tokens, valid),
            "local_rows": emb.to_local().shape[0],
            "placements": str(emb.placements),
            "experts": {n: p.full_tensor() for n, p in params.items() if ".mlp.experts." in n},
            "local_experts": {n: p.to_local().shape[0] for n, p in params.items() if ".mlp.experts." in n},
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


def test_fsdp_sharded_gpt_oss_reads_its_experts_dense_and_mxfp4(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from backend.model.hf.gpt_oss import deinterleave_gate_up
    from tests.helpers.hf_tiny import hf_logits, right_padded_batch, tiny_gpt_oss_model, write_mxfp4_copy

    hf = tiny_gpt_oss_model(tmp_path / "dense")
    pairs = write_mxfp4_copy(tmp_path / "dense", tmp_path / "mxfp4")
    tokens, valid = right_padded_batch()
    dirs = {"gpt_oss": str(tmp_path / "dense"), "gpt_oss_mxfp4": str(tmp_path / "mxfp4")}
    results = run_ranks(load_sharded, 3, tmp_path, dirs, tokens, valid, "train.global_batch_size=30")
    ref = hf_logits(hf, tokens, valid)
    for rank, r in enumerate(results):
        dense, mx = r["gpt_oss"], r["gpt_oss_mxfp4"]
        # 4 experts over 3 ranks: FSDP2 shards of ceil(4/3) = 2, 2 and 0 experts (an empty shard reads nothing)
        assert set(dense["local_experts"].values()) == set(mx["local_experts"].values()) == {(2, 2, 0)[rank]}
        diff = float((dense["logits"] - ref)[valid].abs().max())
        print(f"gpt_oss FSDP x3: max |logit diff| = {diff:.3g}")
        assert diff <= 1e-4
        for layer, hf_layer in enumerate(hf.model.layers):
            pre = f"decoder.layers.{layer}.mlp.experts."
            assert torch.equal(dense["experts"][pre + "fc2_weight"], hf_layer.mlp.experts.down_proj.detach())
            assert torch.equal(
                dense["experts"][pre + "fc1_bias"],
                deinterleave_gate_up(hf_layer.mlp.experts.gate_up_proj_bias.detach()),
            )
            hfx = f"model.layers.{layer}.mlp.experts."
            gu = convert_moe_packed_tensors(*pairs[hfx + "gate_up_proj"], dtype=torch.float32)
            dn = convert_moe_packed_tensors(*pairs[hfx + "down_proj"], dtype=torch.float32)
            assert torch.equal(mx["experts"][pre + "fc1_weight"], deinterleave_gate_up(gu))
            assert torch.equal(mx["experts"][pre + "fc2_weight"], dn)
