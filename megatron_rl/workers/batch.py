"""The batch the Megatron roles consume.

Sequences are prompt + response, right-padded to one length S. Every per-token tensor is
[B, S] and aligned to tokens: entry t concerns token t (its log-prob given tokens < t, the
critic's value of the state before it, its advantage). Entry 0 is never a response token.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class TrainingBatch:
    input_ids: torch.Tensor
    """[B, S] token ids (prompt, response, padding)."""
    response_mask: torch.Tensor
    """[B, S] 1 on response tokens, 0 on prompt and padding."""
    old_logprobs: torch.Tensor | None = None
    """[B, S] log-probs of the policy that sampled the batch (PPO ratio denominator)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, S] reference-policy log-probs (KL in the loss); None when beta = 0."""
    advantages: torch.Tensor | None = None
    """[B, S] advantages of response tokens."""
    returns: torch.Tensor | None = None
    """[B, S] critic targets."""
    old_values: torch.Tensor | None = None
    """[B, S] critic values at sampling time (value clipping)."""
    scores: torch.Tensor | None = None
    """[B] outcome rewards (positive-sample NLL)."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got {tuple(self.input_ids.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("input_ids", "scores"):
                continue
            if value.shape != self.input_ids.shape:
                raise ValueError(
                    f"{f.name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(self.input_ids.shape)} like input_ids"
                )
        if self.scores is not None and self.scores.shape != (len(self),):
            raise ValueError(f"scores must be [{len(self)}], got {tuple(self.scores.shape)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.seq_length, device=self.input_ids.device).expand_as(self.input_ids)

    def rows(self, index: slice) -> TrainingBatch:
        """The same fields restricted to sequences `index`."""
        return replace(
            self,
            **{
                f.name: getattr(self, f.name)[index]
                for f in fields(self)
                if getattr(self, f.name) is not None
            },
        )

    def with_fields(self, **updates) -> TrainingBatch:
        return replace(self, **updates)

    def padded_to_multiple(self, multiple: int, pad_token_id: int = 0) -> TrainingBatch:
        """Right-pad S to a multiple (sequence parallelism, FP8); padding is never a response
        token, so losses are unchanged. Slice outputs back with [:, :seq_length]."""
        extra = -self.seq_length % multiple
        if extra == 0:
            return self
        updates = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name == "scores":
                continue
            fill = pad_token_id if f.name == "input_ids" else 0
            updates[f.name] = torch.nn.functional.pad(value, (0, extra), value=fill)
        return replace(self, **updates)

    def split(self, num_microbatches: int) -> list[TrainingBatch]:
        """Equal-size micro-batches (pipeline p2p needs one shape for all of them)."""
        if num_microbatches < 1 or len(self) % num_microbatches != 0:
            raise ValueError(
                f"{len(self)} sequences do not split into {num_microbatches} equal micro-batches"
            )
        size = len(self) // num_microbatches
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(num_microbatches)]
