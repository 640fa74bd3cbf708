"""The weight push of a disaggregated placement (docs/design/async.md §3.3): a training
rank broadcasts the actor's Hugging Face tensors, in buckets and tagged with their policy
version, to the rollout-engine ranks over a process group that spans both roles.

Why a group of its own: when engines and Megatron run on different ranks, each role has its
own default group (Megatron and vLLM both take the default group as their world), so a group
across the roles cannot come from `torch.distributed.new_group`. `bridge_group` builds it on
the job's key-value store (torchrun's TCPStore) and the push drives the ProcessGroup object's
own collectives. Gloo on CPU, NCCL on GPU (device tensors then).

Dataflow of one push, the same on every rank of the bridge: the source sends a header
(version, bucket meta, bucket bytes) and the bucket's flat bytes (`weight_sync.bucketed`,
`pack_bucket`: at most `bucket_bytes`, or one tensor), bucket after bucket, then an end
header; the receivers get the version from the first header and the tensors one bucket at a
time. Memory: one bucket on each side, never the whole model. An engine checks names and shapes with
`weight_sync.checked` before it loads them (not here: this module moves bytes).
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.parallel import distributed
from megatron_rl.sync.weight_sync import bucketed, pack_bucket, unpack_bucket


def bridge_group(
    store,
    rank: int,
    size: int,
    name: str = "bridge",
    timeout_s: float = 1800.0,
    backend: str | None = None,
) -> dist.ProcessGroup:
    """A process group of `size` ranks across roles, rank `rank` in it, met through `store`
    (every member passes the same `name`): `backend` "gloo" or "nccl"; None: NCCL on GPU,
    gloo on CPU."""
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"bridge_group backend must be gloo or nccl, got {backend!r}")
    prefixed = dist.PrefixStore(f"megatron_rl/{name}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl" or (backend is None and torch.cuda.is_available()):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    return dist.ProcessGroupGloo(prefixed, rank, size, timeout)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, root: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = root, 0
    group.broadcast([tensor], options).wait()


def _device(group: dist.ProcessGroup) -> torch.device:
    """Where `group`'s tensors live: host memory for gloo (a control group: no device sync),
    this rank's device for NCCL."""
    return torch.device("cpu") if group.name() == "gloo" else distributed.device()


def send_object(group: dist.ProcessGroup, obj: object, dst: int, tag: int = 0) -> None:
    """Send `obj` to rank `dst` of `group` (which calls `recv_object`): its pickled length,
    then its bytes; returns once received."""
    post_object(group, obj, dst, tag).wait()


class Posted:
    """A `post_object` under way: `wait()` returns once the receiver has it."""

    def __init__(self, works: list, tensors: tuple):
        self.works, self.tensors = works, tensors  # the tensors live until the sends end

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def post_object(group: dist.ProcessGroup, obj: object, dst: int, tag: int = 0) -> Posted:
    """`send_object` without waiting for the receive (a gloo send waits for it): the sends
    of one sender to one receiver arrive in the order posted, so the receiver's
    `recv_object` calls take them in that order whenever it makes them."""
    payload = pickle.dumps(obj)
    device = _device(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    works = [group.send([length], dst, tag), group.send([data], dst, tag)]
    return Posted(works, (length, data))


def recv_object(group: dist.ProcessGroup, src: int, tag: int = 0) -> object:
    """What rank `src` of `group` sent with `send_object`."""
    device = _device(group)
    length = torch.empty(1, dtype=torch.int64, device=device)
    group.recv([length], src, tag).wait()
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    group.recv([data], src, tag).wait()
    return pickle.loads(data.cpu().numpy().tobytes())


def broadcast_object(group: dist.ProcessGroup, obj: object, root: int) -> object:
    """The root's `obj` on every rank of `group` (what the others pass is ignored): its
    pickled length, then its bytes (a header, a small tensor; weights go as buckets)."""
    device = _device(group)
    payload = pickle.dumps(obj) if group.rank() == root else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    _broadcast(group, length, root)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    if group.rank() == root:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    _broadcast(group, data, root)
    return pickle.loads(data.cpu().numpy().tobytes())


def push_weights(
    group: dist.ProcessGroup,
    tensors: Iterable[tuple[str, torch.Tensor]],
    version: int,
    bucket_bytes: int,
    root: int = 0,
) -> dict[str, float]:
    """On the bridge's `root` rank: send (name, tensor) pairs as policy `version`. Every other
    rank of the bridge calls `receive_weights` at the same time. Returns what was sent."""
    sent = {"tensors": 0, "bytes": 0, "buckets": 0}
    for bucket in bucketed(tensors, bucket_bytes):
        meta, flat = pack_bucket(bucket)
        broadcast_object(group, (version, meta, flat.numel()), root)
        _broadcast(group, flat.to(_device(group)), root)
        sent["tensors"] += len(meta)
        sent["bytes"] += flat.numel()
        sent["buckets"] += 1
    broadcast_object(group, (version, None, 0), root)
    return sent


def receive_weights(
    group: dist.ProcessGroup, root: int = 0
) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """On a receiving rank: (the pushed policy version, the (name, tensor) pairs). The pairs
    must be consumed to the end (the push ends with the last one); each bucket is received
    when the previous one has been consumed."""
    version, meta, numel = broadcast_object(group, None, root)

    def pairs() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal meta, numel
        while meta is not None:
            flat = torch.empty(numel, dtype=torch.uint8, device=_device(group))
            _broadcast(group, flat, root)
            yield from unpack_bucket(meta, flat)
            got, meta, numel = broadcast_object(group, None, root)
            if got != version:  # one push, one version: anything else is a protocol bug
                raise RuntimeError(f"weight push: version {got} inside the push of {version}")

    return version, pairs()
