"""Unit tier: the disaggregated placement's split of the world (`parallel/placement.py`)."""

import pytest

from megatron_rl.parallel.placement import ENGINE, TRAINER, Placement


def test_the_last_ranks_generate_and_rank_0_trains():
    p = Placement(world_size=6, engine_ranks=2)
    assert [p.role(r) for r in range(6)] == [TRAINER] * 4 + [ENGINE] * 2
    assert [p.role_rank(r) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert (p.role_size(TRAINER), p.role_size(ENGINE)) == (4, 2)
    assert [p.bridge_rank(r) for r in range(6)] == [0, None, None, None, 1, 2]
    assert p.bridge_size == 3


@pytest.mark.parametrize("engine_ranks", [0, 4, -1])
def test_a_split_without_both_roles_is_refused_naming_the_setting(engine_ranks):
    with pytest.raises(ValueError, match=f"rollout.engine_ranks={engine_ranks}: .* world of 4"):
        Placement(world_size=4, engine_ranks=engine_ranks)
