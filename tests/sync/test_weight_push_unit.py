"""Unit tier: the disaggregated placement's weight push (`sync/weight_push.py`) over a real
gloo group built on a real TCPStore, as torchrun's job store is; one thread per rank (a
source and two engine ranks), as gloo allows."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from megatron_rl.sync.weight_push import (
    bridge_group,
    broadcast_object,
    post_object,
    push_weights,
    receive_weights,
    recv_object,
    send_object,
)

TIMEOUT_S = 30.0  # a protocol bug fails the test instead of hanging it


def weights() -> list[tuple[str, torch.Tensor]]:
    """Mixed dtypes, one tensor larger than a bucket, odd shapes."""
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 8, generator=g)),
        ("model.layers.0.self_attn.q_proj.bias", torch.randn(8, generator=g).bfloat16()),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(300, 7, generator=g)),  # 8.4 KB
        ("model.norm.weight", torch.randn(8, generator=g)),
        ("position_ids", torch.arange(11)),
    ]


def run_bridge(ranks: int, work, **group) -> dict:
    """`work(rank, group)` on `ranks` threads, each a member of one bridge group
    (`bridge_group`'s keywords: `group`); their results by rank (an exception in any thread
    is raised here)."""
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    results, errors = {}, []

    def member(rank):
        try:
            store = dist.TCPStore(
                "127.0.0.1", server.port, is_master=False,
                timeout=datetime.timedelta(seconds=TIMEOUT_S),
            )  # fmt: skip
            results[rank] = work(
                rank, bridge_group(store, rank, ranks, timeout_s=TIMEOUT_S, **group)
            )
        except Exception as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S * 2)
    if errors:
        raise errors[0]
    assert len(results) == ranks, "a rank never finished"
    return results


def test_every_engine_rank_receives_the_same_bits_and_the_version_push_after_push():
    """Two pushes over one bridge (versions 3 and 4, the second with other weights), in
    buckets of 1 KB: every receiver gets each push's tensors in order, bit-equal, with their
    dtype, and the version it was sent with."""
    first = weights()
    second = [(name, t * 2 if t.is_floating_point() else t + 1) for name, t in first]

    def work(rank, group):
        if rank == 0:
            return [
                push_weights(group, first, version=3, bucket_bytes=1024),
                push_weights(group, second, version=4, bucket_bytes=1024),
            ]
        got = []
        for _ in range(2):
            version, pairs = receive_weights(group)
            got.append((version, list(pairs)))
        return got

    results = run_bridge(3, work)
    sent = results[0]
    assert sent[0]["tensors"] == len(first) and sent[0]["buckets"] >= 3
    assert sent[0]["bytes"] == sum(t.numel() * t.element_size() for _, t in first)
    for rank in (1, 2):
        pushes = zip(results[rank], (3, 4), (first, second), strict=True)
        for (version, pairs), expected, want in pushes:
            assert version == expected
            assert [n for n, _ in pairs] == [n for n, _ in want]
            for (_, got), (_, t) in zip(pairs, want, strict=True):
                assert got.dtype == t.dtype and torch.equal(got, t)


def test_a_push_of_nothing_still_carries_its_version():
    def work(rank, group):
        if rank == 0:
            return push_weights(group, [], version=9, bucket_bytes=1024)
        version, pairs = receive_weights(group)
        return version, list(pairs)

    results = run_bridge(2, work)
    assert results[0]["buckets"] == 0 and results[1] == (9, [])


def test_objects_sent_to_rank_0_arrive_whole_and_in_order_on_a_gloo_stream():
    """The stream group of a disaggregated placement: gloo whatever the device (its tensors
    on the host), each engine rank sends rank 0 two answers, which rank 0 receives per sender
    in the order sent; a command broadcast from rank 0 reaches both."""

    def work(rank, group):
        assert group.name() == "gloo"
        command = broadcast_object(group, {"generate": 7} if rank == 0 else None, root=0)
        if rank == 0:
            return command, [[recv_object(group, src=r) for _ in range(2)] for r in (2, 1)]
        for i in range(2):
            send_object(group, (rank, i, "x" * (1000 * rank)), dst=0)
        return command

    results = run_bridge(3, work, name="stream", backend="gloo")
    command, answers = results[0]
    assert command == results[1] == results[2] == {"generate": 7}
    assert answers == [
        [(2, 0, "x" * 2000), (2, 1, "x" * 2000)],
        [(1, 0, "x" * 1000), (1, 1, "x" * 1000)],
    ]


def test_posted_objects_leave_before_they_are_received_and_arrive_in_order():
    """An engine rank's answers (`post_object`): rank 1 posts three, then broadcasts, and
    rank 0 receives them only after that broadcast: a send that waited for its receive
    would never reach the broadcast (what `send_object` does, and the engines did)."""

    def work(rank, group):
        if rank == 1:
            posted = [post_object(group, (i, "y" * 10**i), dst=0) for i in range(1, 4)]
            broadcast_object(group, "all posted", root=1)
            for p in posted:
                p.wait()
            return None
        said = broadcast_object(group, None, root=1)
        return said, [recv_object(group, src=1) for _ in range(3)]

    results = run_bridge(2, work, name="stream", backend="gloo")
    assert results[0] == ("all posted", [(i, "y" * 10**i) for i in range(1, 4)])


def test_a_backend_other_than_gloo_or_nccl_is_refused():
    with pytest.raises(ValueError, match="backend must be gloo or nccl, got 'mpi'"):
        bridge_group(dist.HashStore(), 0, 1, backend="mpi")
