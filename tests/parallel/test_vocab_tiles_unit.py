"""The tiled head on one rank (`parallel.vocab.chunked_logprobs_entropy`): every tile shape,
blocks of rows merged, gives the log-probs, entropy and both gradients of the whole logits;
in bf16, with the hidden states' gradient summed over blocks of rows in fp32, no further
from fp32 logits than whole bf16 logits are. Tensor parallelism:
test_chunked_logprobs_distributed.py."""

import pytest
import torch

from megatron_rl.parallel import vocab
from tests.host_reads import HostReads
from tests.tolerances import BF16_MODEL, FP32_MODEL, assert_close

VOCAB, PADDED, HIDDEN, TOKENS = 1000, 1024, 48, 90


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    """TP1 without a process group: rank 0 of 1 holds the whole vocabulary."""
    monkeypatch.setattr(vocab, "_tp", lambda: (0, 1, None))


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, generator=g).to(dtype)
    weight = (torch.randn(PADDED, HIDDEN, generator=g) * 0.4).to(dtype)
    labels = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    return hidden, weight, labels, torch.randn(2, TOKENS, generator=g)


def _run(hidden, weight, labels, coef, how, entropy_in_loss=True, keep_probs=False):
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if how in ("fp32", "whole"):  # torch's log-softmax over the real vocabulary
        logits = h.float() @ w.float().t() if how == "fp32" else (h @ w.t()).float()
        log_p = torch.log_softmax(logits[:, :VOCAB] / 0.8, dim=-1)
        lp = log_p.gather(1, labels[:, None]).squeeze(1)
        ent = -(log_p.exp() * log_p).sum(-1)
    else:
        lp, ent = vocab.chunked_logprobs_entropy(
            h, w, labels, VOCAB, 0.8, tile=how, keep_probs=keep_probs
        )
    loss = (coef[0] * lp).sum() + ((coef[1] * ent).sum() if entropy_in_loss else 0.0)
    loss.backward()
    return lp.detach(), ent.detach(), h.grad.float(), w.grad.float()


@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
@pytest.mark.parametrize("tile", [None, (TOKENS, 300), (7, 1000), (16, 333), (45, 1)])
def test_fp32_tiles_equal_the_whole_logits(tile, entropy_in_loss, keep_probs):
    """Backward recomputing each tile's logits, or reading the probabilities forward kept."""
    hidden, weight, labels, coef = _inputs(torch.float32)
    want = _run(hidden, weight, labels, coef, "fp32", entropy_in_loss)
    got = _run(hidden, weight, labels, coef, tile, entropy_in_loss, keep_probs)
    for name, a, b in zip(("logprobs", "entropy", "hidden", "weight"), got, want, strict=True):
        assert b.abs().max() > 1e-3, name  # a real comparison
        assert_close(a, b, FP32_MODEL, f"{tile} {name}")
    assert (got[3][VOCAB:] == 0).all()  # vocabulary padding gets no gradient


@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("tile", [(32, 300), (TOKENS, 128)])
def test_bf16_tiles_are_as_close_to_fp32_logits_as_whole_bf16_logits(tile, keep_probs):
    """Several blocks of rows in bf16: the hidden states' gradient summed in fp32 across
    them and rounded once, the projection's likewise across blocks of tokens; kept
    probabilities rounded to bf16 once more."""
    hidden, weight, labels, coef = _inputs(torch.bfloat16)
    fp32 = _run(hidden, weight, labels, coef, "fp32")
    whole = _run(hidden, weight, labels, coef, "whole")
    tiled = _run(hidden, weight, labels, coef, tile, keep_probs=keep_probs)
    for got, bf16, want in zip(tiled, whole, fp32, strict=True):
        # on CPU both read the same bf16-rounded logits (CUDA's GEMMs write fp32 ones)
        assert_close(got, bf16, BF16_MODEL)
        assert (got - want).abs().max() <= 2 * (bf16 - want).abs().max()


def _uncompiled_fused(monkeypatch):
    """The backward's forms for the compiler (CUDA's), run uncompiled on the CPU."""
    from megatron_rl.parallel import vocab_fused

    monkeypatch.setattr(vocab_fused, "compiled_grad", lambda _: vocab_fused.chunk_logits_grad)
    monkeypatch.setattr(vocab_fused, "compiled_kept_grad", lambda _: vocab_fused.kept_probs_grad)


@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tile", [None, (16, 333), (45, 1)])
def test_log_probs_alone_equal_those_with_the_entropy(tile, fused, keep_probs, monkeypatch):
    """`calculate_entropy=False` (an old policy's, a reference's log-probs): no entropy, the
    same log-probs and gradients, one tile's sums and blocks of rows' merged alike; the
    backward's eager maths and its form for the compiler, from recomputed logits or kept
    probabilities."""
    hidden, weight, labels, coef = _inputs(torch.float32)
    want = _run(hidden, weight, labels, coef, tile, entropy_in_loss=False)
    if fused:
        _uncompiled_fused(monkeypatch)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = vocab.chunked_logprobs_entropy(
        h, w, labels, VOCAB, 0.8, tile=tile, calculate_entropy=False, keep_probs=keep_probs
    )
    assert ent is None
    (coef[0] * lp).sum().backward()
    got = {"logprobs": lp.detach(), "hidden": h.grad, "weight": w.grad}
    for (name, a), b in zip(got.items(), (want[0], *want[2:]), strict=True):
        assert_close(a, b, FP32_MODEL, f"{tile} {name}")
    m, s, d, picked = vocab._chunk_sums(hidden @ weight.t(), labels, calculate_entropy=False)
    assert not d.any()
    full = vocab._chunk_sums(hidden @ weight.t(), labels)
    for name, a, i in (("max", m, 0), ("sum of exponentials", s, 1), ("label's", picked, 3)):
        assert_close(a, full[i], FP32_MODEL, name)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
def test_kept_probabilities_give_the_recomputed_gradients(entropy_in_loss, fused, monkeypatch):
    """Backward from the kept probabilities equals backward from recomputed logits, eager
    or in the compiler's form, with logits so far apart that most probabilities underflow
    to 0 (their log floored, not -inf: no NaN from 0 * inf) and labels whose probability is
    near 1."""
    hidden, weight, labels, coef = _inputs(torch.float32)
    weight = weight * 60.0  # logits hundreds apart
    labels = (hidden @ weight[:VOCAB].t()).argmax(-1)  # p(label) ~ 1 for most tokens
    labels[::3] = torch.arange(0, VOCAB, 33)[: len(labels[::3])]
    if fused:
        _uncompiled_fused(monkeypatch)
    want = _run(hidden, weight, labels, coef, (16, 333), entropy_in_loss)
    got = _run(hidden, weight, labels, coef, (16, 333), entropy_in_loss, keep_probs=True)
    with torch.no_grad():
        p = torch.softmax((hidden @ weight[:VOCAB].t()) / 0.8, -1)
    assert (p == 0).float().mean() > 0.5 and (p.amax(-1) > 1 - 1e-6).any()
    for name, a, b in zip(("logprobs", "entropy", "hidden", "weight"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert_close(a, b, FP32_MODEL, name)


def test_probabilities_are_kept_only_where_a_gradient_can_flow(monkeypatch):
    """Under `torch.no_grad()`, or for inputs that need no gradient, nothing is kept."""
    asked = []
    apply = vocab._ChunkedLogProbsEntropy.apply
    monkeypatch.setattr(
        vocab._ChunkedLogProbsEntropy, "apply", lambda *a: asked.append(a[-2]) or apply(*a)
    )
    hidden, weight, labels, _ = _inputs(torch.float32)
    vocab.chunked_logprobs_entropy(hidden, weight, labels, VOCAB, keep_probs=True)
    with torch.no_grad():
        vocab.chunked_logprobs_entropy(
            hidden.requires_grad_(True), weight, labels, VOCAB, keep_probs=True
        )
    vocab.chunked_logprobs_entropy(hidden, weight, labels, VOCAB, keep_probs=True)
    assert asked == [False, False, True]


@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("calculate_entropy", [True, False])
def test_compiled_tile_sums_give_the_eager_heads_results(calculate_entropy, keep_probs):
    """`compiled_sums` (`model.use_fused_kernels`), compiled by this CPU's compiler: over
    blocks of rows and tokens, with the probabilities kept or not, the log-probs, entropy and
    both gradients of the eager head."""
    from megatron_rl.parallel import vocab_fused

    assert vocab_fused.compiled_sums("cpu") is not None  # it compiles here: a real comparison
    hidden, weight, labels, coef = _inputs(torch.float32)

    def run(compiled):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = vocab.chunked_logprobs_entropy(
            h,
            w,
            labels,
            VOCAB,
            0.8,
            tile=(32, 300),
            calculate_entropy=calculate_entropy,
            keep_probs=keep_probs,
            compiled_sums=compiled,
        )
        loss = (coef[0] * lp).sum() + ((coef[1] * ent).sum() if calculate_entropy else 0.0)
        loss.backward()
        return lp.detach(), ent, h.grad, w.grad

    want, got = run(compiled=False), run(compiled=True)
    assert (got[1] is None) == (not calculate_entropy)
    for name, a, b in zip(("logprobs", "entropy", "hidden", "weight"), got, want, strict=True):
        if b is not None:
            assert_close(a, b, FP32_MODEL, name)


def test_a_tile_of_no_tokens_or_rows_is_refused():
    hidden, weight, labels, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"\(tokens, rows\) >= 1, got \(0, 5\)"):
        vocab.chunked_logprobs_entropy(hidden, weight, labels, VOCAB, tile=(0, 5))


def test_a_tile_of_no_rows_sums_to_nothing():
    """A TP rank holding only vocabulary padding: max -inf, no mass, no label."""
    m, s, d, picked = vocab._chunk_sums(torch.empty(5, 0), torch.tensor([0, 3, -1, 9, 2]))
    assert torch.equal(m, torch.full((5,), float("-inf")))
    assert not s.any() and not d.any() and not picked.any()


@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("entropy_in_loss", [True, False])
def test_the_tiled_head_reads_nothing_back_to_the_host(entropy_in_loss, keep_probs):
    """Forward and backward in blocks of rows, labels in other blocks than a token's own,
    queue on a GPU without the host waiting: no op whose result the host must read (a
    scalar, `nonzero`, a boolean mask's index). The eager backward serves where the
    compiled one does not (CPU, no Triton)."""
    hidden, weight, labels, coef = _inputs(torch.float32)
    with HostReads() as reads:
        _run(hidden, weight, labels, coef, (32, 100), entropy_in_loss, keep_probs)
    assert not reads.sites, reads.sites


def test_blocks_of_rows_cost_the_host_few_ops_each():
    """Each block of rows adds one tile's maths and no merge of its own (the blocks' sums
    are rescaled together once): the forward's dispatched ops, the host's kernel launches
    on a GPU, grow by ~20 a block (merging block by block took ~40)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    hidden, weight, labels, _ = _inputs(torch.float32)

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def ops(tile):
        Count.ops = 0
        with Count(), torch.no_grad():
            vocab.chunked_logprobs_entropy(hidden, weight, labels, VOCAB, tile=tile)
        return Count.ops

    one, ten = ops((TOKENS, VOCAB)), ops((TOKENS, 100))
    assert 0 < (ten - one) / 9 <= 24, (one, ten)
