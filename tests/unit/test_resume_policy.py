"""Which config changes a resumed run may make (backend.checkpoint.resume_policy)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from backend.checkpoint.resume_policy import (
    MISSING,
    ResumeConfigError,
    check_resume_config,
    classify,
    diff_resume_config,
    flatten,
)
from backend.config.schema import Config
from backend.errors import CheckpointError


def base() -> dict:
    return dataclasses.asdict(Config())


def changed(**dotted) -> dict:
    cfg = base()
    for key, value in dotted.items():
        node = cfg
        *path, leaf = key.split("__")
        for part in path:
            node = node[part]
        node[leaf] = value
    return cfg


def test_identical_configs_have_no_changes():
    diff = diff_resume_config(base(), base())
    assert diff.ok and not diff.allowed and not diff.refused and not diff.notes


@pytest.mark.parametrize(
    "key, value",
    [
        ("model__hidden_size", 256),
        ("model__num_layers", 4),
        ("model__vocab_size", 1024),
        ("model__tie_embeddings", False),
        ("data__path", "other.jsonl"),
        ("data__tokenizer", "tok/tokenizer.json"),
        ("data__json_key", "content"),
        ("data__max_seq_length", 4096),
        ("data__overlong", "truncate"),
        ("train__global_batch_size", 64),
        ("train__seed", 1),
        ("parallel__context_parallel_size", 2),
    ],
)
def test_changes_to_the_model_the_stream_or_the_layout_are_refused(key, value):
    old, new = base(), changed(**{key: value})
    dotted = key.replace("__", ".")
    diff = diff_resume_config(old, new)
    old_value = flatten(old)[dotted]
    assert diff.refused == [(dotted, old_value, value)] and not diff.allowed
    with pytest.raises(ResumeConfigError) as err:
        check_resume_config(old, new, checkpoint="ckpt/step_00000010")
    msg = str(err.value)
    assert msg.startswith("ckpt/step_00000010: refusing to resume") and f"{dotted}: {old_value!r} -> {value!r}" in msg
    assert "\n" not in msg and isinstance(err.value, CheckpointError)


@pytest.mark.parametrize(
    "key, value",
    [
        ("model__attention_backend", "sdpa"),
        ("model__recompute_granularity", "full"),
        ("optimizer__lr", 1e-4),
        ("optimizer__clip_grad", 0.0),
        ("scheduler__warmup_iters", 10),
        ("train__train_iters", 1000),
        ("train__micro_batch_size", 4),
        ("train__dynamic_batch_enable", True),
        ("train__max_tokens_per_gpu", 8192),
        ("train__dynamic_batch_pad_to_multiple", 64),
        ("train__dynamic_batch_max_shapes", 8),
        ("train__dynamic_batch_overhead", 512),
        ("train__forward_max_tokens_per_gpu", 4096),
        ("train__precision", "bf16"),
        ("logger__run_dir", "runs/b"),
        ("logger__log_interval", 10),
        ("logger__wandb__project", "p2"),
        ("logger__wandb__tags", ["a"]),
        ("checkpoint__interval", 50),
        ("checkpoint__keep_last", 5),
        ("checkpoint__allow_dp_change", True),
        ("data__cache_dir", "/elsewhere"),
        ("parallel__backend", "gloo"),
    ],
)
def test_changes_to_plan_optimizer_and_logging_are_allowed_and_reported(key, value):
    dotted = key.replace("__", ".")
    diff = check_resume_config(base(), changed(**{key: value}))
    assert diff.ok and [k for k, _, _ in diff.allowed] == [dotted]
    assert diff.summary()[0].startswith(f"{dotted}: ")


def test_several_refusals_are_all_named_in_one_line():
    new = changed(model__hidden_size=64, train__seed=9, optimizer__lr=1.0)
    diff = diff_resume_config(base(), new)
    assert [k for k, _, _ in diff.refused] == ["model.hidden_size", "train.seed"]
    assert [k for k, _, _ in diff.allowed] == ["optimizer.lr"]
    msg = diff.message()
    assert "model.hidden_size: 128 -> 64" in msg and "train.seed: 1234 -> 9" in msg and "optimizer" not in msg


def test_a_key_missing_from_an_older_checkpoint_is_allowed_with_a_note():
    old = base()
    del old["train"]["dynamic_batch_max_shapes"]
    del old["data"]["json_key"]  # even a stream key: the older run could not have set it
    diff = check_resume_config(old, base())
    assert {k for k, _, _ in diff.allowed} == {"train.dynamic_batch_max_shapes", "data.json_key"}
    assert any("absent from the checkpoint's config" in n for n in diff.notes)


def test_a_key_removed_since_is_allowed_with_a_note():
    old = base()
    old["train"]["retired_knob"] = 3
    diff = check_resume_config(old, base())
    assert diff.allowed == [("train.retired_knob", 3, MISSING)] and "no longer a key" in diff.notes[0]


def test_an_unclassified_key_is_refused():
    old, new = base(), base()
    old["data"]["new_filter"], new["data"]["new_filter"] = "a", "b"
    diff = diff_resume_config(old, new)
    assert diff.refused == [("data.new_filter", "a", "b")] and "does not classify" in diff.reasons["data.new_filter"]


def test_every_key_of_the_schema_is_classified_on_purpose():
    """A new config field must be placed in the policy (refused by default otherwise)."""
    unclassified = [k for k in flatten(base()) if "does not classify" in classify(k)[1]]
    assert not unclassified, f"classify these keys in backend/checkpoint/resume_policy.py: {unclassified}"


def test_inputs_are_not_modified():
    old, new = base(), changed(train__seed=2)
    old_copy, new_copy = copy.deepcopy(old), copy.deepcopy(new)
    diff_resume_config(old, new)
    assert old == old_copy and new == new_copy
