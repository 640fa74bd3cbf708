"""Benchmark: one tile of the chunked log-prob head's forward (`parallel/vocab.py`), its GEMM
then its per-token sums (the max, the sum of exponentials, the entropy's sum and the label's
logit), eager as the head runs them against the same sums compiled
(`parallel/vocab_fused.tile_sums`, what `model.use_fused_kernels` takes; Triton on CUDA),
with dynamic and with static shapes, alternating in this process.

    python -m tools.bench head [--tokens 8192 --rows 8192 --hidden 896 --dtype bf16]

The head leaves these sums eager by default because a compiled form was slower on an H200:
9.8 ms a chunk of 441 tokens x 152k rows (bench/gpu.md, 2026-11-28), where the eager passes
took about 1 ms. Its tiles are now thousands of tokens by thousands of rows
(`parallel/tiles.py`), a row reduction with work for every SM, and the eager form makes
about ten passes over a tile where a fused one can make two: this measures whether
compiling still loses. The arms `eager_kept` and `compiled_kept` also write the tile's
probabilities in the tile's input dtype, as the update's head does by default (keeping
them for backward): there the compiled kernel writes them as it sums. Each
other arm's sums are checked equal to the eager ones first; an arm that fails to compile or
gives other sums is left out, its error in the line (`<arm>_error`). The arm
`eager_logprobs` takes the eager sums without the entropy's (`calculate_entropy=False`: what
the log-probs of an old policy, a reference or a teacher cost). One JSON line: milliseconds
a tile for the GEMM alone and for each arm, the sums' share (arm minus GEMM), each other
arm's speed-up over eager there (> 1: faster), and the eager sums' bandwidth counted as one
read of the fp32 tile.
The arms `softmax` and `softmax_logprobs` take the same sums from torch's fused softmax
(`softmax_sums`: seven passes over the tile with the GEMM's write where eager makes eleven,
four without the entropy where eager makes seven), timed against `eager` and
`eager_logprobs`.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from megatron_rl.parallel import vocab, vocab_fused
from tools.bench_common import alternate, record


def softmax_sums(logits, local_labels, out=None, calculate_entropy: bool = True):
    """`vocab._chunk_sums` (same arguments; `logits` [C, R] tempered, not consumed) from torch's
    fused softmax: one pass for the max and its column, one kernel for p = softmax(l), and
    for the entropy -p log p in place and its sum. The sums come in the form the head's merge
    takes at any max: m = this tile's log-sum-exp (l's max minus log p there), s = 1 and
    d = sum p log p = -(the tile's entropy), whose merge over blocks of rows and TP ranks
    (`vocab._rescaled`) gives the same log-sum-exp and entropy (the entropy as a sum of
    non-negative terms, H = sum_b w_b (H_b + lse - lse_b)). On a GPU each of these is a pass
    over the tile at the memory's bandwidth; on a CPU the entropy's elementwise log is not
    vectorised (`torch.special.entr`: about 7x a product on this 2-core CPU, measured by hand)."""
    c, rows = logits.shape
    if out is None:
        out = logits.new_empty(4, c)
    m, s, d, picked = out.unbind(0)
    if rows == 0:  # a rank holding only vocabulary padding
        return EAGER_SUMS(logits, local_labels, out, calculate_entropy)
    here = (local_labels >= 0) & (local_labels < rows)
    label_logits = logits.gather(1, local_labels.clamp(0, rows - 1)[:, None]).squeeze(1)
    torch.mul(label_logits, here, out=picked)
    top, col = logits.max(dim=-1)
    p = torch.softmax(logits, dim=-1)
    torch.sub(top, p.gather(1, col[:, None]).squeeze(1).log(), out=m)  # p there is 1 / sum
    s.fill_(1.0)
    if calculate_entropy:
        torch.neg(torch.special.entr(p, out=p).sum(dim=-1), out=d)
    else:
        d.zero_()
    return m, s, d, picked


EAGER_SUMS = vocab._chunk_sums


@contextmanager
def _head_tile_sums(sums):
    """Within: the chunked head's forward takes each tile's sums (`vocab._chunk_sums`) from
    `sums`, which has its signature but `kept` and leaves the logits as they are; the
    probabilities the head keeps for backward are exp(l - m) at the m those sums give (a
    pass of their own). The eager sums are back afterwards."""

    def with_kept(logits, local_labels, out=None, calculate_entropy=True, kept=None):
        m, s, d, picked = sums(logits, local_labels, out, calculate_entropy)
        if kept is not None:
            kept.copy_(torch.exp(logits - m[:, None]))
        return m, s, d, picked

    vocab._chunk_sums = with_kept
    try:
        yield
    finally:
        vocab._chunk_sums = EAGER_SUMS


def softmax_head_forward():
    """Within: the chunked head's forward takes each tile's sums from `softmax_sums`."""
    return _head_tile_sums(softmax_sums)


def lse_and_entropy(sums: torch.Tensor) -> torch.Tensor:
    """[3, C]: a tile's log-sum-exp, entropy and label logit from its sums [4, C] (m, s, d,
    picked) at whatever max they were taken: the forms of `vocab._chunk_sums` and
    `softmax_sums` compared."""
    m, s, d, picked = sums
    return torch.stack([m + s.log(), s.log() - d / s, picked])


COMPILED = ("dynamic", "static")
SAME_SUMS = {"rtol": 1e-4, "atol": 1e-4}
"""fp32 sums of thousands of terms a row, taken in another order, their exponentials by another
kernel: about sqrt(terms) roundings of 6e-8 each apart (3e-5 seen at 8,192 on a CPU)."""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192, help="the tile's tokens")
    p.add_argument("--rows", type=int, default=8192, help="the tile's vocabulary rows")
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--compiled",
        nargs="*",
        choices=COMPILED,
        default=list(COMPILED),
        help="the compiled arms (the flag with no names: the GEMM and eager arms alone)",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="bench/results.jsonl")
    a = p.parse_args(argv)
    if min(a.tokens, a.rows, a.hidden) < 1 or a.temperature <= 0:
        raise SystemExit("--tokens, --rows and --hidden are >= 1, --temperature > 0")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, generator=g, device=device).to(dtype)
    w = (torch.randn(a.rows, a.hidden, generator=g, device=device) * 0.05).to(dtype)
    # a third of the labels in this tile's rows, the rest in other tiles' (below and above)
    labels = torch.randint(-a.rows, 2 * a.rows, (a.tokens,), generator=g, device=device)
    t = a.temperature

    def gemm():
        return vocab._chunk_logits(h, w, 1.0)

    def eager():
        return torch.stack(vocab._chunk_sums(vocab._chunk_logits(h, w, t), labels))

    def eager_logprobs():  # the log-probs alone (an old policy's, a reference's): no entropy
        logits = vocab._chunk_logits(h, w, t)
        return torch.stack(vocab._chunk_sums(logits, labels, calculate_entropy=False))

    kept = torch.empty(a.tokens, a.rows, dtype=dtype, device=device)

    def eager_kept():  # and the probabilities kept for backward, as the update's head
        return torch.stack(vocab._chunk_sums(vocab._chunk_logits(h, w, t), labels, kept=kept))

    def softmax():
        return torch.stack(softmax_sums(vocab._chunk_logits(h, w, t), labels))

    def softmax_logprobs():
        logits = vocab._chunk_logits(h, w, t)
        return torch.stack(softmax_sums(logits, labels, calculate_entropy=False))

    arms = {
        "gemm": gemm,
        "eager": eager,
        "eager_logprobs": eager_logprobs,
        "eager_kept": eager_kept,
    }
    result = {"tokens": a.tokens, "rows": a.rows, "hidden": a.hidden, "dtype": a.dtype}
    want = eager()
    try:  # other sums are this arm's result, not the end of the others'
        torch.testing.assert_close(lse_and_entropy(softmax()), lse_and_entropy(want), **SAME_SUMS)
        arms.update(softmax=softmax, softmax_logprobs=softmax_logprobs)
    except AssertionError as e:
        result["softmax_error"] = f"AssertionError: {e}"[:500]
    for shapes in a.compiled:
        fused = torch.compile(vocab_fused.tile_sums, dynamic=shapes == "dynamic", fullgraph=True)

        def compiled(fused=fused, kept=None):
            return fused(vocab._chunk_logits(h, w, t), labels, kept, True)

        try:
            torch.testing.assert_close(compiled(), want, **SAME_SUMS)
            if shapes == "dynamic":  # the head's form, also writing what it keeps
                torch.testing.assert_close(compiled(fused, kept), want, **SAME_SUMS)
        except Exception as e:  # noqa: BLE001 - a compiler failure or other sums: this arm's result
            result[f"compiled_{shapes}_error"] = f"{type(e).__name__}: {e}"[:500]
            continue
        arms[f"compiled_{shapes}"] = compiled
        if shapes == "dynamic":  # micro-batches vary in length
            arms["compiled_kept"] = lambda fused=fused: compiled(fused, kept)

    median = alternate(arms, a.steps, a.warmup)
    for name, seconds in median.items():
        result[f"{name}_ms"] = round(seconds * 1e3, 4)
    sums = {name: median[name] - median["gemm"] for name in arms if name != "gemm"}
    for name, seconds in sums.items():
        result[f"{name}_sums_ms"] = round(seconds * 1e3, 4)
    bases = {"softmax_logprobs": "eager_logprobs", "compiled_kept": "eager_kept"}
    for name, seconds in sums.items():
        base = bases.get(name, "eager")
        if name != base and seconds > 0:
            result[f"speed_{name}_over_{base}"] = round(sums[base] / seconds, 4)
    if sums["eager"] > 0:
        result["eager_sums_gb_per_s_one_read"] = round(
            4 * a.tokens * a.rows / sums["eager"] / 1e9, 2
        )
    record("head", result, a.out)


if __name__ == "__main__":
    main()
