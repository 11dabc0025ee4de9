"""Policy-gradient row fields: read, required or refused as the loss says; checked where they
count; carried through .bin/.idx, truncation, padded and packed collation and the CP cut like
loss_weight (entry t belongs to target token t)."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend.batching import Microbatch, round_up
from backend.config import ConfigError, load_config, validate
from backend.config.schema import LossConfig
from backend.data.build import build_dataset
from backend.data.collate import collate, cp_unshard, packed_cp_unshard
from backend.data.errors import DataFileError, DataFormatError
from backend.data.indexed import IndexedTokenDataset, write_indexed
from backend.data.jsonl import InMemoryDataset, read_jsonl
from backend.data.overlong import LengthLimitedDataset
from backend.data.row_fields import row_fields
from backend.data.sample import Sample
from backend.data.tokenizers import ByteTokenizer

POLICY = row_fields(LossConfig(type="policy"))  # advantages + old_logprobs
TOK = ByteTokenizer()


def jsonl(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read(path, fields=POLICY, ignored=None):
    return list(read_jsonl(path, TOK, fields=fields, ignored=ignored))


ROW = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "advantages": 0.5, "old_logprobs": [None, None, -1, -2]}


def test_which_fields_each_loss_needs():
    assert row_fields(LossConfig()).read == () and "advantages" in row_fields(LossConfig()).refuse
    assert POLICY.required == ("advantages", "old_logprobs")
    assert row_fields(LossConfig(type="policy", old_logprobs="recompute")).required == ("advantages",)
    with_kl = row_fields(LossConfig(type="policy", old_logprobs="detach", kl_coef=0.1))
    assert with_kl.required == ("advantages", "ref_logprobs")
    by_model = row_fields(LossConfig(type="policy", kl_coef=0.1, reference_checkpoint="ref"))
    assert "ref_logprobs" not in by_model.required


def test_scalar_and_per_token_advantages_and_nulls_where_masked(tmp_path):
    per_token = {**ROW, "advantages": [None, 9, 0.25, -0.5], "old_logprobs": [float("nan"), 1e30, -1, -2]}
    a, b = read(jsonl(tmp_path, [ROW, json.dumps(per_token).replace("NaN", "NaN")]))
    assert a.advantages.tolist() == [0.5] * 4 and a.advantages.dtype == np.float32
    assert np.isnan(a.old_logprobs[:2]).all() and a.old_logprobs[2:].tolist() == [-1, -2]
    assert b.advantages[2:].tolist() == [0.25, -0.5] and a.ref_logprobs is None  # not read: not needed


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"old_logprobs": [None, None, None, -2]}, "'old_logprobs' is nan at token 2, a loss token"),
        ({"advantages": [0, 0, 1e39, 0]}, "'advantages' is inf at token 2"),
        ({"advantages": float("inf")}, "'advantages' is inf at token 2"),
        ({"old_logprobs": [0, -1, -2]}, "'old_logprobs' has 3 entries for 4 tokens"),
        ({"advantages": "high"}, "'advantages' must be a number or a list of numbers"),
        ({"old_logprobs": [0, 0, "x", 0]}, "'old_logprobs' must be a list of numbers"),
        ({"old_logprobs": None}, "'old_logprobs' must be a list of numbers"),
    ],
)
def test_bad_values_name_file_line_and_field(tmp_path, change, needle):
    path = jsonl(tmp_path, [ROW, {**ROW, **change}])
    with pytest.raises(DataFormatError) as err:
        read(path)
    assert str(err.value).startswith(f"{path}:2: ") and needle in str(err.value)


ROLLOUT = row_fields(LossConfig(type="policy", old_logprobs="rollout"))  # advantages + rollout_logprobs


def test_rollout_logprobs_are_read_when_present_and_required_when_used(tmp_path):
    assert "rollout_logprobs" in POLICY.read and "rollout_logprobs" not in POLICY.required  # the mismatch metrics
    assert ROLLOUT.required == ("advantages", "rollout_logprobs")
    tis = row_fields(LossConfig(type="policy", old_logprobs="recompute", rollout_correction="tis"))
    assert tis.required == ("advantages", "rollout_logprobs")
    (a,) = read(jsonl(tmp_path, [{**ROW, "rollout_logprobs": [None, None, -1.5, -2.5]}]))
    assert a.rollout_logprobs[2:].tolist() == [-1.5, -2.5] and np.isnan(a.rollout_logprobs[:2]).all()
    with pytest.raises(
        DataFormatError, match=r"rows.jsonl:1: no 'rollout_logprobs' field, which .*old_logprobs=rollout"
    ):
        read(jsonl(tmp_path, [ROW]), fields=ROLLOUT)


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"rollout_logprobs": [None, None, None, -2]}, "'rollout_logprobs' is nan at token 2, a loss token"),
        ({"rollout_logprobs": [None, None, float("inf"), -2]}, "'rollout_logprobs' is inf at token 2"),
        ({"rollout_logprobs": [0, -1, -2]}, "'rollout_logprobs' has 3 entries for 4 tokens"),
    ],
)
def test_bad_rollout_logprobs_name_file_line_and_field(tmp_path, change, needle):
    good = {**ROW, "rollout_logprobs": [None, None, -1.0, -2.0]}
    path = jsonl(tmp_path, [good, json.dumps({**good, **change}).replace("Infinity", "1e999")])
    with pytest.raises(DataFormatError) as err:
        read(path, fields=ROLLOUT)
    assert str(err.value).startswith(f"{path}:2: ") and needle in str(err.value)


def test_rollout_sidecar_round_trip(tmp_path):
    samples = list(read_jsonl(jsonl(tmp_path, [{**ROW, "rollout_logprobs": [None, None, -1.0, -3.0]}]), TOK))
    write_indexed(tmp_path / "rl", samples, 256)
    assert (tmp_path / "rl_rollout_logprobs.bin").is_file()
    ds = IndexedTokenDataset(tmp_path / "rl", ROLLOUT)
    assert ds[0].rollout_logprobs[2:].tolist() == [-1.0, -3.0]


def test_missing_field_names_the_setting(tmp_path):
    row = {k: v for k, v in ROW.items() if k != "old_logprobs"}
    with pytest.raises(DataFormatError, match=r"rows.jsonl:1: no 'old_logprobs' field, which .*loss.old_logprobs=data"):
        read(jsonl(tmp_path, [row]))


def test_cross_entropy_refuses_policy_fields_and_lists_the_ignored(tmp_path):
    with pytest.raises(
        DataFormatError, match=r"rows.jsonl:1: 'advantages' is a policy-gradient field, but loss.type=cross_entropy"
    ):
        read(jsonl(tmp_path, [ROW]), fields=row_fields(LossConfig()))
    ignored: Counter = Counter()
    rows = [{"input_ids": [1, 2], "id": "a", "source": "x"}, {"text": "hi", "id": "b"}]
    read(jsonl(tmp_path, rows), fields=row_fields(LossConfig()), ignored=ignored)
    assert ignored == {"id": 2, "source": 1}
    ignored.clear()
    read(jsonl(tmp_path, [{**ROW, "ref_logprobs": [0, 0, 0, 0]}]), ignored=ignored)  # read by nothing here
    assert ignored == {"ref_logprobs": 1}


def test_build_dataset_counts_ignored_fields(tmp_path):
    path = jsonl(tmp_path, [{**ROW, "id": i} for i in range(3)])
    cfg = SimpleNamespace(path=str(path), tokenizer="byte", json_key="text", max_seq_length=64, overlong="error")
    dataset, _ = build_dataset(cfg, POLICY)
    assert dataset.ignored_fields == {"id": 3} and dataset[0].advantages is not None


def test_indexed_sidecars_round_trip_and_are_checked(tmp_path):
    samples = list(read_jsonl(jsonl(tmp_path, [ROW, {**ROW, "advantages": -1.0}]), TOK))  # pass-through reader
    write_indexed(tmp_path / "rl", samples, 256)
    for name in ("advantages", "old_logprobs"):
        assert (tmp_path / f"rl_{name}.bin").is_file()
    assert not (tmp_path / "rl_ref_logprobs.bin").exists()
    ds = IndexedTokenDataset(tmp_path / "rl", POLICY)
    assert ds[1].advantages.tolist() == [-1.0] * 4 and ds[0].old_logprobs[2:].tolist() == [-1, -2]
    with pytest.raises(DataFileError, match=r"rl_advantages.bin/.idx: 'advantages' is a policy-gradient field"):
        IndexedTokenDataset(tmp_path / "rl", row_fields(LossConfig()))
    with pytest.raises(DataFileError, match=r"no .*rl_ref_logprobs.bin/.idx, but .*needs 'ref_logprobs'"):
        IndexedTokenDataset(tmp_path / "rl", row_fields(LossConfig(type="policy", kl_coef=0.1)))
    # a non-finite value at a loss token in a sidecar is caught when the sample is read
    bad = Sample(
        tokens=np.arange(4),
        loss_mask=np.array([0, 1, 1, 1], np.uint8),
        advantages=np.array([0, 1, np.nan, 1], np.float32),
        old_logprobs=np.zeros(4, np.float32),
    )
    write_indexed(tmp_path / "bad", [bad], 256)
    with pytest.raises(DataFormatError, match=r"bad_advantages.bin sample 0: 'advantages' is nan at token 2"):
        IndexedTokenDataset(tmp_path / "bad", POLICY)[0]


def test_truncation_cuts_every_field(tmp_path):
    samples = read(jsonl(tmp_path, [ROW]))
    cut = LengthLimitedDataset(InMemoryDataset(samples, "rows"), 3, "truncate")
    short = cut[0]
    assert len(short.advantages) == len(short.old_logprobs) == len(short.loss_mask) == len(short.tokens) == 3
    assert cut.loss_token_counts.tolist() == [1]


def _samples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        mask = (rng.random(n) > 0.3).astype(np.uint8)
        out.append(
            Sample(
                tokens=rng.integers(1, 256, n),
                loss_mask=mask,
                advantages=rng.normal(size=n).astype(np.float32),
                old_logprobs=rng.normal(size=n).astype(np.float32),
                rollout_logprobs=rng.normal(size=n).astype(np.float32),
            )
        )
    return out


@pytest.mark.parametrize("cp", [1, 2])
def test_padded_collation_and_cp_cut_carry_fields_like_loss_weight(cp):
    samples = _samples([5, 9, 3])
    length = round_up(9, 2 * cp)
    mb = Microbatch((0, 1, 2), length, 3 * length // cp, 17)
    parts = [collate(samples, [0, 1, 2], mb, cp_rank=r, cp_size=cp) for r in range(cp)]
    names = ("advantages", "old_logprobs", "rollout_logprobs", "sequence_targets")
    whole = {k: cp_unshard([getattr(p, k) for p in parts]) for k in names}
    for r, s in enumerate(samples):
        n = len(s.tokens)
        assert whole["advantages"][r, : n - 1].tolist() == pytest.approx(s.advantages[1:].tolist())
        assert whole["old_logprobs"][r, : n - 1].tolist() == pytest.approx(s.old_logprobs[1:].tolist())
        assert whole["rollout_logprobs"][r, : n - 1].tolist() == pytest.approx(s.rollout_logprobs[1:].tolist())
        assert torch.all(whole["sequence_targets"][r, : n - 1] == s.loss_tokens())
    assert parts[0].ref_logprobs is None


@pytest.mark.parametrize("cp", [1, 2])
def test_packed_collation_and_cp_cut_carry_fields(cp):
    samples = _samples([5, 9, 3], seed=1)
    seg = 2 * cp if cp > 1 else 1
    segments = [round_up(len(s.tokens), seg) for s in samples]
    row = sum(segments)
    mb = Microbatch((0, 1, 2), row, row // cp, 17, packed=True)
    parts = [collate(samples, [0, 1, 2], mb, cp_rank=r, cp_size=cp) for r in range(cp)]
    adv = packed_cp_unshard([p.advantages for p in parts], segments)[0]
    rollout = packed_cp_unshard([p.rollout_logprobs for p in parts], segments)[0]
    seq = packed_cp_unshard([p.sequence_targets for p in parts], segments)[0]
    offset = 0
    for s, width in zip(samples, segments):
        n = len(s.tokens)
        assert adv[offset : offset + n - 1].tolist() == pytest.approx(s.advantages[1:].tolist())
        assert rollout[offset : offset + n - 1].tolist() == pytest.approx(s.rollout_logprobs[1:].tolist())
        assert torch.all(seq[offset : offset + n - 1] == s.loss_tokens())
        offset += width


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["loss.type=ppo"], "loss.type='ppo': allowed values are cross_entropy, policy"),
        (["loss.type=policy", "loss.kl_estimator=k4"], "loss.kl_estimator='k4': allowed values are k1, k2, k3"),
        (["loss.type=policy", "loss.normalization=sample"], "loss.normalization='sample'"),
        (["loss.type=policy", "loss.old_logprobs=sampler"], "loss.old_logprobs='sampler'"),
        (["loss.type=policy", "loss.dual_clip=0.5"], "loss.dual_clip=0.5: must be 0 (off) or > 1"),
        (["loss.type=policy", "loss.ratio_clip_low=1.0"], "loss.ratio_clip_low=1.0: must be in [0, 1)"),
        (["loss.type=policy", "loss.ratio_clip_high=-0.1"], "loss.ratio_clip_high=-0.1: must be >= 0"),
        (["loss.type=policy", "loss.kl_coef=-1"], "loss.kl_coef=-1.0: must be >= 0"),
        (["loss.type=policy", "loss.logratio_clamp=0"], "loss.logratio_clamp=0.0: must be > 0"),
        (["loss.type=policy", "loss.minibatches_per_rollout=0"], "loss.minibatches_per_rollout=0: must be >= 1"),
        (["loss.kl_coef=0.1"], "loss.kl_coef: only read with loss.type=policy"),
        (["loss.type=policy", "loss.reference_checkpoint=x"], "loss.reference_checkpoint='x': only used for the KL"),
        (
            ["loss.type=policy", "loss.minibatches_per_rollout=2"],
            "loss.minibatches_per_rollout=2: only read with loss.old_logprobs=recompute",
        ),
        (
            [
                "loss.type=policy",
                "loss.old_logprobs=recompute",
                "loss.minibatches_per_rollout=4",
                "checkpoint.interval=6",
            ],
            "checkpoint.interval=6: must be a multiple of loss.minibatches_per_rollout=4",
        ),
        (
            ["loss.type=policy", "data.path=rows.jsonl", "data.append_eod=true"],
            "data.append_eod: with loss.type=policy",
        ),
    ],
)
def test_loss_config_errors_name_the_key(overrides, needle):
    base = ["data.path=rows.jsonl"] if "data.path=rows.jsonl" not in overrides else []
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, base + overrides))
    assert needle in str(err.value)


def test_policy_on_the_embedded_data_is_refused():
    with pytest.raises(ConfigError, match="data.path=embedded: loss.type=policy trains on rollouts"):
        validate(load_config(None, ["loss.type=policy"]))


def test_value_fields_are_read_required_refused_and_carried(tmp_path):
    value = row_fields(LossConfig(type="value"))
    assert value.required == ("returns", "old_values")
    assert row_fields(LossConfig(type="value", value_clip=0.0)).required == ("returns",)
    row = {
        "input_ids": [1, 2, 3, 4],
        "loss_mask": [0, 1, 1, 1],
        "returns": [None, 1, 2, 3],
        "old_values": [0, 0.5, 1, 1],
    }
    (s,) = read(jsonl(tmp_path, [row]), fields=value)
    assert s.returns[1:].tolist() == [1, 2, 3] and s.old_values.tolist() == [0, 0.5, 1, 1]
    with pytest.raises(
        DataFormatError, match=r"'returns' is a value-loss field, but loss.type=cross_entropy .*loss.type=value"
    ):
        read(jsonl(tmp_path, [row], "ce.jsonl"), fields=row_fields(LossConfig()))
    with pytest.raises(DataFormatError, match=r"rows.jsonl:1: 'returns' is nan at token 2, a loss token"):
        read(jsonl(tmp_path, [{**row, "returns": [None, 1, None, 3]}]), fields=value)
    write_indexed(tmp_path / "v", [s], 256)
    assert IndexedTokenDataset(tmp_path / "v", value)[0].returns[1:].tolist() == [1, 2, 3]
    cut = LengthLimitedDataset(InMemoryDataset([s], "rows"), 3, "truncate")[0]
    assert len(cut.returns) == len(cut.old_values) == 3


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["loss.type=value"], "loss.type=value with model.head=lm"),
        (["model.head=value"], "loss.type=cross_entropy with model.head=value"),
        (["loss.value_clip=0.3"], "loss.value_clip: only read with loss.type=value"),
        (["model.head=value", "loss.type=value", "loss.kl_coef=0.1"], "loss.kl_coef: only read with loss.type=policy"),
        (["model.head=value", "loss.type=value", "model.logits_chunk_tokens=64"], "a critic's head has one output"),
    ],
)
def test_value_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(load_config("configs/quickstart.yaml", ["data.path=x.jsonl", *overrides]))
