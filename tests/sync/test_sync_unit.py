"""Unit tier: the weight sync's bucketing and its name/shape checks."""

import pytest
import torch

from megatron_rl.sync.weight_sync import (
    WeightSyncError,
    bucketed,
    checked,
    pack_bucket,
    unpack_bucket,
)


def tensors():
    return [
        ("a", torch.zeros(10)),
        ("big", torch.zeros(100)),
        ("b", torch.zeros(5)),
        ("c", torch.zeros(5)),
    ]


def test_buckets_respect_the_size_and_oversized_tensors_travel_alone():
    buckets = list(bucketed(tensors(), bucket_bytes=80))  # 20 float32 values
    assert [[n for n, _ in b] for b in buckets] == [["a"], ["big"], ["b", "c"]]
    assert [n for b in bucketed(tensors(), 10**9) for n, _ in b] == ["a", "big", "b", "c"]


def test_pack_unpack_round_trip_mixed_dtypes():
    bucket = [
        ("x", torch.randn(3, 4)),
        ("y", torch.arange(6, dtype=torch.int64)),
        ("z", torch.randn(2).bfloat16()),
    ]
    meta, flat = pack_bucket(bucket)
    assert flat.dtype == torch.uint8
    for (name, t), (name2, t2) in zip(bucket, unpack_bucket(meta, flat), strict=True):
        assert name == name2 and t2.dtype == t.dtype and torch.equal(t, t2)


def test_unknown_or_misshaped_tensors_fail_loudly_with_their_name():
    expected = {"w": (2, 2), "v": (3,)}
    with pytest.raises(
        WeightSyncError, match="'mystery.weight' is not a weight of the engine's model"
    ):
        list(checked([("mystery.weight", torch.zeros(1))], expected, torch.float32))
    with pytest.raises(
        WeightSyncError, match=r"'w' has shape \[2, 3\], the engine expects \[2, 2\]"
    ):
        list(checked([("w", torch.zeros(2, 3))], expected, torch.float32))
    with pytest.raises(WeightSyncError, match="1 weights never arrived, e.g. \\['v'\\]"):
        list(checked([("w", torch.zeros(2, 2))], expected, torch.float32))
    out = list(checked([("w", torch.zeros(2, 2)), ("v", torch.zeros(3))], expected, torch.bfloat16))
    assert [t.dtype for _, t in out] == [torch.bfloat16, torch.bfloat16]
