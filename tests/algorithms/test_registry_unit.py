"""Registries: entries by name, an unknown name refused with a hint, traits registered with
each advantage estimator (what it needs from the run) in place of tests of its name."""

from __future__ import annotations

import pytest

from megatron_rl.algorithms import ADV_ESTIMATOR_TRAITS, ADV_ESTIMATORS, estimator_traits
from megatron_rl.algorithms.registry import EstimatorTraits, lookup, registrar


def test_every_estimator_has_traits_and_only_gae_needs_a_critic():
    assert set(ADV_ESTIMATOR_TRAITS) == set(ADV_ESTIMATORS)
    assert [n for n, t in ADV_ESTIMATOR_TRAITS.items() if t.needs_critic] == ["gae"]
    groups = sorted(n for n, t in ADV_ESTIMATOR_TRAITS.items() if t.needs_groups)
    assert groups == ["grpo", "reinforce_plus_plus_baseline", "rloo"]
    assert estimator_traits("reinforce_plus_plus") == EstimatorTraits()
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'gea' \(did you mean"):
        estimator_traits("gea")


def test_registrar_stores_traits_and_refuses_duplicates_and_traits_it_cannot_hold():
    entries, traits = {}, {}
    register = registrar(entries, "thing", traits, EstimatorTraits)
    register("a", needs_groups=True)(len)
    register("b")(abs)
    assert lookup(entries, "a", "thing") is len and traits["b"] == EstimatorTraits()
    assert traits["a"].needs_groups and not traits["a"].needs_critic
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        register("a")(min)
    plain = registrar({}, "loss")
    with pytest.raises(TypeError, match=r"loss registry takes no traits, got \['needs_critic'\]"):
        plain("x", needs_critic=True)
    with pytest.raises(TypeError):
        register("c", needs_gpu=True)
    assert "c" not in entries
