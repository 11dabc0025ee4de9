"""Objectives and advantage estimators by name: what loss.type and rl.advantage allow is what is
registered, and a new one is a class and a name."""

from __future__ import annotations

import numpy as np
import pytest

from backend.config.schema import LOSS_TYPES, RL_ADVANTAGES
from backend.loss.registry import LOSSES, Objective, build_loss, loss_names, register_loss
from backend.rl.advantages import ADVANTAGES, build_advantage, group_advantages


def test_every_allowed_loss_type_is_registered():
    assert loss_names() == sorted(LOSS_TYPES)
    assert build_loss(None).name == "cross_entropy"
    for name in LOSS_TYPES:

        class Cfg:
            type = name

        assert build_loss(Cfg()).name == name


def test_an_unknown_loss_names_the_key():
    class Cfg:
        type = "nope"

    with pytest.raises(ValueError, match="loss.type='nope': allowed values are cross_entropy, policy, value"):
        build_loss(Cfg())


def test_a_new_objective_is_one_class_and_one_name():
    @register_loss("test_only_double_ce")
    class Double(Objective):
        pass

    try:

        class Cfg:
            type = "test_only_double_ce"

        assert isinstance(build_loss(Cfg()), Double)
        with pytest.raises(ValueError, match="registered twice"):
            register_loss("test_only_double_ce")(type("Other", (Objective,), {}))
    finally:
        LOSSES.pop("test_only_double_ce")


def test_every_allowed_estimator_is_registered_and_grpo_writes_group_advantages():
    assert sorted(ADVANTAGES) == sorted(RL_ADVANTAGES)

    class RL:
        advantage = "grpo"
        scale_rewards = True

    estimator = build_advantage(RL())
    assert not estimator.needs_critic
    rewards = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0]])
    rows = [{} for _ in range(6)]
    assert estimator(rows, rewards) == (None, {})
    assert [r["advantages"] for r in rows] == group_advantages(rewards).reshape(-1).tolist()
    RL.advantage = "gae"
    assert build_advantage(RL()).needs_critic
