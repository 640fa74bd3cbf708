"""Unit tier: how the trainers of a disaggregated placement take the engine replicas'
answers (`rollout/service/protocol.py`, `deal`): groups in replica order, equal contiguous
shares per DP rank, metrics averaged, the furthest data position, an abort passed on."""

from megatron_rl.rollout.service.protocol import Rated, deal, furthest


def position(epoch: int, index: int) -> dict:
    return {"epoch": epoch, "index": index, "num_prompts": 64, "seed": 0, "shuffle": True}


def test_groups_are_dealt_in_replica_order_in_equal_contiguous_shares():
    """Answers arrive in any order; replica 0's groups come first. 5 groups over 2 DP ranks:
    2 each, the fifth dropped (colocated, every DP rank is trimmed to the shortest)."""
    answers = [
        Rated(1, ["c", "d", "e"], {"rollout/reward/mean": 1.0, "x_max": 3.0}, position(0, 16)),
        Rated(0, ["a", "b"], {"rollout/reward/mean": 0.0, "x_max": 5.0}, position(0, 16)),
    ]
    shares, metrics, data, aborted = deal(answers, dp_size=2)
    assert shares == [["a", "b"], ["c", "d"]]
    assert metrics == {"rollout/reward/mean": 0.5, "x_max": 5.0}
    assert data == position(0, 16) and aborted is None
    one, _, _, _ = deal(answers, dp_size=1)
    assert one == [["a", "b", "c", "d", "e"]]


def test_an_aborted_replica_aborts_the_round_and_its_empty_metrics_do_not_count():
    answers = [
        Rated(0, ["a"], {"m": 2.0}, position(0, 12)),
        Rated(1, [], {}, position(0, 8), aborted="rollout/generate"),
    ]
    _, metrics, _, aborted = deal(answers, dp_size=1)
    assert aborted == "rollout/generate" and metrics == {"m": 2.0}


def test_the_data_position_is_the_furthest_any_replica_drew_to():
    """Dynamic filtering can make replicas draw different numbers of chunks: no prompt one
    of them drew may come back in a later step, across an epoch's end too."""
    assert furthest([position(0, 40), position(1, 2), position(0, 63)]) == position(1, 2)
    assert furthest([position(2, 8), position(2, 24)]) == position(2, 24)
