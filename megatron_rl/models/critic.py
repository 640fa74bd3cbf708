"""The critic: the actor's transformer with a scalar value head instead of the vocabulary
projection (VC-PPO/VAPO train it first on Monte-Carlo returns, then alongside the policy).

The head is a [1, hidden] weight replicated on every TP rank; it sits where GPTModel's
output layer sits, so megatron's own forward, pipeline schedules and final norm are reused
unchanged and only the last pipeline stage holds it. Under sequence parallelism the hidden
states are gathered along the sequence first; every TP rank then computes the same values,
so its gradient is identical across TP and needs no reduction.
"""

from __future__ import annotations

import torch

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import PrecisionConfig, build_gpt_model_chunks
from megatron_rl.parallel.distributed import ParallelLayout


class ValueHead(torch.nn.Module):
    """hidden [s, b, h] -> values [s, b, 1], replicated across TP (no bias, like an HF
    sequence-classification `score` head)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool, dtype: torch.dtype, std: float):
        super().__init__()
        # A fixed CPU generator: every TP rank, on any device, must start from the same head.
        g = torch.Generator().manual_seed(0)
        weight = torch.randn(1, hidden_size, generator=g, dtype=torch.float32, device="cpu") * std
        self.weight = torch.nn.Parameter(weight.to(dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        """GPTModel's output-layer contract: returns (output, bias)."""
        if self.sequence_parallel:
            # why: megatron-core takes seconds to import: loaded on first use
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Each rank needs the whole sequence; the gradient is the full one on every
            # rank already, so backward only keeps this rank's slice (no reduce-scatter).
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return torch.nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype)), None


def build_critic_chunks(
    arch: ModelArchitecture,
    layout: ParallelLayout,
    precision: PrecisionConfig | None = None,
    **kwargs,
) -> list:
    """This rank's critic chunks: GPT chunks whose last-stage output layer is a ValueHead.

    The vocabulary projection is built and dropped at start-up (a transient cost of one
    [vocab/tp, hidden] matrix); weights come from the actor/HF checkpoint or an HF reward
    model (`score.weight` -> `output_layer.weight`).
    """
    precision = precision or PrecisionConfig()
    chunks = build_gpt_model_chunks(arch, layout, precision, **kwargs)
    for chunk in chunks:
        if chunk.post_process:
            head = ValueHead(
                arch.hidden_size,
                layout.sequence_parallel,
                precision.params_dtype,
                arch.init_method_std,
            )
            chunk.output_layer = head.to(next(chunk.parameters()).device)
    return chunks


@torch.no_grad()
def load_value_head(chunks: list, reader) -> None:
    """Copy a reward model's `score.weight` [1, hidden] into the critic's value head.

    A missing or misshaped head is an error naming the parameter and both shapes (seed 002:
    never a warning followed by a random init)."""
    for chunk in chunks:
        head = getattr(chunk, "output_layer", None)
        if not isinstance(head, ValueHead):
            continue
        if "score.weight" not in reader.keys():
            raise ValueError(
                f"{reader.hf_dir}: no 'score.weight': a critic needs a sequence-classification "
                f"reward model with a [1, {head.weight.shape[1]}] score head"
            )
        score = reader("score.weight")
        if score.shape != head.weight.shape:
            raise ValueError(
                f"{reader.hf_dir}: 'score.weight' has shape {list(score.shape)}, the critic's "
                f"value head (output_layer.weight) needs {list(head.weight.shape)}"
            )
        head.weight.copy_(score)
