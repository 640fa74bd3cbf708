"""Unit tier: `workers/offload.py` on plain modules, both parameter layouts megatron DDP makes:
a storage per parameter (no distributed optimizer) and parameters as views of one flat buffer
(the distributed optimizer's param buffer). The roles under torchrun:
tests/workers/test_workers_distributed.py; the trainer: tests/trainer/test_train_distributed.py."""

import numpy as np
import pytest
import torch

from megatron_rl.workers.offload import ParamOffload


def own_storages():
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())]


def flat_buffer_views():
    """As megatron's `_ParamAndGradBuffer` with the distributed optimizer: every param.data is
    a view of one bf16 buffer (and a shard view of it, as the optimizer keeps)."""
    chunks = own_storages()
    params = [p for c in chunks for p in c.parameters()]
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.bfloat16, device="cpu")
    start = 0
    for p in params:
        view = buffer[start : start + p.numel()].view(p.shape)
        view.copy_(p.data)
        p.data = view
        start += p.numel()
    return chunks, buffer


def snapshot(chunks):
    return [p.detach().clone() for c in chunks for p in c.parameters()]


@pytest.mark.parametrize("layout", ["own_storages", "flat_buffer"])
def test_a_round_trip_frees_every_storage_and_brings_back_the_same_bits(layout):
    chunks, buffer = (own_storages(), None) if layout == "own_storages" else flat_buffer_views()
    params = [p for c in chunks for p in c.parameters()]
    before, objects = snapshot(chunks), [p.data for p in params]
    shard = buffer[3:9] if buffer is not None else None  # a view megatron would hold
    away = ParamOffload()
    away.offload(chunks)
    assert away.offloaded and len(away.storages) == (1 if buffer is not None else len(params))
    assert all(p.untyped_storage().nbytes() == 0 for p in params)  # the memory is gone
    assert away.nbytes == sum(p.numel() * p.element_size() for p in params)
    away.restore()
    assert not away.offloaded
    for p, b, obj in zip(params, before, objects, strict=True):
        assert torch.equal(p.detach(), b) and p.dtype == b.dtype
        assert p.data.untyped_storage().data_ptr() == obj.untyped_storage().data_ptr()
    if buffer is not None:  # the views still view the buffer
        buffer[3] = 7.0
        assert shard[0] == 7.0 and params[0].view(-1)[3] == 7.0


def test_a_module_trains_after_a_round_trip_as_it_would_without():
    plain, moved = own_storages(), own_storages()
    opts = [
        torch.optim.Adam([p for c in m for p in c.parameters()], lr=0.1) for m in (plain, moved)
    ]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1), device="cpu")
    away = ParamOffload()
    for _ in range(3):
        for chunks, opt in zip((plain, moved), opts, strict=True):
            opt.zero_grad()
            chunks[1](chunks[0](x)).square().sum().backward()
            opt.step()
        away.offload(moved)
        host = list(away.host)
        away.restore()
        away.offload(moved)  # twice in a row: the host buffers are reused, nothing allocated
        assert [h.data_ptr() for h in away.host] == [h.data_ptr() for h in host]
        away.offload(moved)  # already away: a no-op
        away.restore()
    for a, b in zip(snapshot(plain), snapshot(moved), strict=True):
        assert torch.equal(a, b)


def test_a_storage_that_cannot_be_resized_is_refused_before_anything_moves():
    chunks = own_storages()
    fixed = torch.from_numpy(np.ones((4, 8), dtype=np.float32))  # numpy owns its memory
    chunks[0].weight = torch.nn.Parameter(fixed)
    with pytest.raises(RuntimeError, match="1 parameter storage.*cannot be resized"):
        ParamOffload().offload(chunks)
    assert all(p.untyped_storage().nbytes() > 0 for c in chunks for p in c.parameters())
