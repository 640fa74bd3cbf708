"""The compiler's form of the chunked head's backward maths (`vocab_fused`, compiled on CUDA)
equals the eager in-place form (`vocab._chunk_logits_grad`) that CPU runs. Called uncompiled
here: the compiled function is the GPU test's (tests/test_gpu.py)."""

import pytest
import torch

from megatron_rl.parallel import vocab, vocab_fused
from tests.tolerances import FP32_EXACT_ORDER, assert_close

BF16_ONE_ROUNDING = {"rtol": 2**-7, "atol": 1e-6}
"""The same fp32 value rounded once to bf16 by two computations whose fp32 arithmetic may
differ in its last bit: at most one bf16 step (2^-8 relative, 2^-7 below a power of two)."""


def _chunk(rows=37, c=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(c, rows, generator=g) * 4
    # labels in this slice, below it (another rank's, negative once shifted) and above it
    labels = torch.randint(-rows, 2 * rows, (c,), generator=g)
    return raw, labels, g


@pytest.mark.parametrize("terms", ["both", "logprob", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_gradient_is_the_eager_one(terms, dtype):
    raw, labels, g = _chunk()
    t = 0.7
    m, s, d, _ = vocab._chunk_sums(raw.clone() / t, labels)
    lse, entropy = m + torch.log(s), torch.log(s) - d / s
    g_lp = torch.randn(raw.shape[0], generator=g) if terms != "entropy" else None
    g_h = torch.randn(raw.shape[0], generator=g) if terms != "logprob" else None
    want = vocab._chunk_logits_grad(raw / t - lse[:, None], g_lp, g_h, entropy, labels, dtype)
    zeros = torch.zeros(raw.shape[0])
    got = vocab_fused.chunk_logits_grad(
        raw,
        lse,
        zeros if g_lp is None else g_lp,
        zeros if g_h is None else g_h,
        entropy,
        labels,
        t,
        dtype,
    )
    assert got.dtype == dtype
    # bf16: both round the same fp32 value once, up to the fp32 arithmetic's last bit
    tol = FP32_EXACT_ORDER if dtype == torch.float32 else BF16_ONE_ROUNDING
    assert_close(got.float(), want.float(), tol)


def test_off_cuda_the_eager_forms_serve():
    assert vocab_fused.compiled_grad("cpu") is None


@pytest.mark.parametrize("kept_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("calculate_entropy", [True, False])
def test_the_fused_tile_sums_are_the_eager_ones(calculate_entropy, kept_dtype):
    """`tile_sums` (uncompiled) against `vocab._chunk_sums`: the max, both sums, the label's
    logit only where this tile's rows hold it (labels below, inside and above them), and the
    probabilities written into a strided slice of a wider buffer, as the head keeps them."""
    raw, labels, _ = _chunk()
    logits = raw / 0.7
    want_kept = got_kept = None
    if kept_dtype is not None:
        want_kept = torch.zeros(raw.shape[0], 50, dtype=kept_dtype)
        got_kept = torch.zeros_like(want_kept)
    want = torch.stack(
        vocab._chunk_sums(
            logits.clone(),
            labels,
            calculate_entropy=calculate_entropy,
            kept=None if want_kept is None else want_kept[:, 5:42],
        )
    )
    got = vocab_fused.tile_sums(
        logits, labels, None if got_kept is None else got_kept[:, 5:42], calculate_entropy
    )
    assert_close(got, want, FP32_EXACT_ORDER)
    assert (got[3] != 0).tolist() == ((labels >= 0) & (labels < 37)).tolist()
    assert got[2].any() == calculate_entropy
    if kept_dtype is not None:
        assert_close(got_kept.float(), want_kept.float(), BF16_ONE_ROUNDING)
        assert not got_kept[:, :5].any() and not got_kept[:, 42:].any()  # the slice alone


def test_a_compiled_form_that_fails_hands_this_and_every_later_call_to_the_eager_one(
    caplog, monkeypatch
):
    """`FallBack`: a compiled function failing on a case its probe did not compile (here: it
    raises as a compiler would) gives the eager result, says so once and is not called again;
    running out of memory is raised, not taken for a compiler's failure."""
    raw, labels, g = _chunk()
    lse, g_lp = torch.logsumexp(raw, dim=-1), torch.randn(raw.shape[0], generator=g)
    zeros = torch.zeros_like(lse)
    args = (raw, lse, g_lp, zeros, zeros, labels, 1.0, torch.float32)
    calls = []
    monkeypatch.setattr(vocab_fused, "FELL_BACK", [])

    def broken(*a):
        calls.append(a)
        raise RuntimeError("a compiler's failure")

    guarded = vocab_fused.FallBack(broken, vocab_fused.chunk_logits_grad)
    with caplog.at_level("WARNING", logger=vocab_fused.__name__):
        first, second = guarded(*args), guarded(*args)
    want = vocab_fused.chunk_logits_grad(*args)
    assert torch.equal(first, want) and torch.equal(second, want)
    assert len(calls) == 1 and guarded.fused is None
    assert vocab_fused.FELL_BACK == ["chunk_logits_grad"]  # what the benchmark reports
    (record,) = caplog.records
    assert "compiled chunk_logits_grad failed (a compiler's failure)" in record.getMessage()

    def out_of_memory(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        vocab_fused.FallBack(out_of_memory, vocab_fused.chunk_logits_grad)(*args)
