"""Trainer pieces that need no process group."""

import pytest

from megatron_rl.trainer.updates import NonFiniteUpdates, nonfinite_streak

OK = {"skipped_nonfinite": 0.0}
SKIPPED = {"skipped_nonfinite": 1.0}


def test_nonfinite_streak_counts_consecutive_skipped_steps_and_stops_at_the_limit():
    streak = nonfinite_streak(0, [OK, SKIPPED], limit=3)  # one skipped update is enough
    streak = nonfinite_streak(streak, [SKIPPED], limit=3)
    assert streak == 2
    assert nonfinite_streak(streak, [OK, OK], limit=3) == 0  # a clean step resets it
    with pytest.raises(NonFiniteUpdates, match=r"3 steps in a row .*max_nonfinite_in_a_row=3"):
        nonfinite_streak(streak, [SKIPPED], limit=3)
