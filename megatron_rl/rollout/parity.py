"""Log-prob parity between the rollout engine and the trainer.

A mismatch between the log-probs vLLM sampled with and those the actor recomputes silently
biases PPO's ratio (a known failure of other frameworks); the trainer logs `logprob_gap`
every step and `tools/logprob_diff.py` checks a checkpoint on demand.
"""

from __future__ import annotations

import torch

from megatron_rl.algorithms.masked import masked_mean
from megatron_rl.data.batch import TrainingBatch


def engine_token_logprobs(engine, batch: TrainingBatch) -> torch.Tensor:
    """The engine's log-prob of every token of each sequence, [B, S] aligned to tokens like
    the actor's (entry 0 and padding are 0)."""
    lengths = [int(m.nonzero().max()) + 1 if m.any() else 1 for m in batch.response_mask]
    scores = engine.score(
        [row[:n].tolist() for row, n in zip(batch.input_ids, lengths, strict=True)]
    )
    out = torch.zeros(batch.input_ids.shape, device="cpu")
    for i, (n, lp) in enumerate(zip(lengths, scores, strict=True)):
        out[i, 1:n] = torch.tensor(lp, device="cpu")
    return out.to(batch.input_ids.device)


def logprob_gap(
    engine_lp: torch.Tensor, actor_lp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """Mean and max |engine - actor| over response tokens."""
    gap = (engine_lp - actor_lp).abs()
    return {
        "logprob_gap_mean": masked_mean(gap, mask).item(),
        "logprob_gap_max": gap[mask.bool()].max().item() if mask.any() else 0.0,
    }
