"""Unit tier: packed segments in `SDPAttention` (`models/attention.py`), megatron's `thd`
layout: each segment attends causally within itself, sliced by the bounds packing keeps on
the host; where flash attention's variable-length kernel runs, every segment goes to it in
one call (its wiring here, on the meta device; its values against one call a segment on
CUDA: `tests/test_gpu.py`). Whole models packed against unpacked and the unfused reference
at TP2+SP, PP2 and DP2: `tests/models/test_core_attention_distributed.py`."""

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.models import attention
from tests.host_reads import HostReads
from tests.tolerances import FP32_MODEL, assert_close

BOUNDS = (0, 5, 6, 13, 16)
"""Three segments of 5, 1 and 7 tokens, and 3 tokens of padding as a segment of its own."""
HEADS, GROUPS, HEAD_DIM = 4, 2, 8


def _module() -> attention.SDPAttention:
    from megatron.core.transformer.enums import AttnMaskType

    config = types.SimpleNamespace(
        context_parallel_size=1,
        apply_query_key_layer_scaling=False,
        window_size=None,
        softmax_type="vanilla",
        attention_dropout=0.0,
    )
    return attention.SDPAttention(config, 1, AttnMaskType.causal, "self")


def _params(device="cpu", host_bounds=True):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor(BOUNDS, dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    if host_bounds:
        params.host_bounds = BOUNDS
    return params


def _qkv(device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(BOUNDS[-1], n, HEAD_DIM) for n in (HEADS, GROUPS, GROUPS)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_(True) for s in shapes]


def _reference(q, k, v):
    """Causal softmax attention of each segment alone, K and V repeated to every head."""
    out = []
    for start, end in zip(BOUNDS, BOUNDS[1:], strict=False):
        qs, ks, vs = (x[start:end].transpose(0, 1) for x in (q, k, v))  # [n, l, d]
        ks, vs = (x.repeat_interleave(HEADS // GROUPS, dim=0) for x in (ks, vs))
        scores = qs @ ks.transpose(1, 2) / HEAD_DIM**0.5
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out.append((probs @ vs).transpose(0, 1))
    return torch.cat(out).reshape(BOUNDS[-1], HEADS * HEAD_DIM)


@pytest.mark.parametrize("host_bounds", [True, False])
def test_segments_attend_within_themselves_reading_the_bounds_only_where_not_given(host_bounds):
    q, k, v = _qkv()
    module = _module()
    with HostReads() as reads:
        out = module(q, k, v, None, packed_seq_params=_params(host_bounds=host_bounds))
    assert_close(out, _reference(q, k, v), FP32_MODEL)
    # the bounds packing made on the host cost no read; without them, one
    expected = {} if host_bounds else {"tolist megatron_rl/models/attention.py:_packed": 1}
    assert dict(reads.sites) == expected
    out.square().sum().backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    _reference(q, k, v).square().sum().backward()
    for ours, theirs in zip(grads, (q.grad, k.grad, v.grad), strict=True):
        assert_close(ours, theirs, FP32_MODEL)


def test_bounds_that_do_not_cover_the_tokens_are_refused():
    q, k, v = _qkv()
    params = _params()
    params.host_bounds = (0, 5, 15)
    with pytest.raises(ValueError, match=r"cu_seqlens \(0, 5, 15\) do not cover the 16 tokens"):
        _module()(q, k, v, None, packed_seq_params=params)


def test_the_variable_length_kernel_takes_every_segment_in_one_call(monkeypatch):
    """Where the kernel runs, one call with the segments' bounds on the device, the longest
    segment's length, causal, GQA's fewer key/value heads as they are; its output [t, n * d]
    and gradients flow back (meta tensors: shapes and autograd, not values)."""
    calls = []

    class Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func.overloadpacket.__name__, args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(attention, "flash_varlen_runs", lambda query: True)
    q, k, v = _qkv("meta", torch.bfloat16)
    params = _params("meta")
    with Calls():
        out = _module()(q, k, v, None, packed_seq_params=params)
    flash = [(args, kw) for name, args, kw in calls if name == "_flash_attention_forward"]
    assert len(flash) == 1 and not [c for c in calls if "scaled_dot_product" in c[0]]
    args, kwargs = flash[0]
    assert args[1].shape[1] == GROUPS and args[3] is params.cu_seqlens_q
    assert args[5:10] == (7, 7, 0.0, True, False) and kwargs.get("scale") is None
    assert out.shape == (BOUNDS[-1], HEADS * HEAD_DIM)
    out.sum().backward()
    assert [x.grad.shape for x in (q, k, v)] == [x.shape for x in (q, k, v)]


def test_the_variable_length_kernel_is_not_asked_for_on_the_cpu():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert not attention.flash_varlen_runs(torch.empty(4, 2, 64, dtype=dtype))
