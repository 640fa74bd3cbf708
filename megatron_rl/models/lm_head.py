"""The policy's output layer without logits: the last pipeline stage returns the hidden
states the vocabulary projection would read, and the roles compute log-probs and entropy
from them a tile at a time (`parallel.vocab.chunked_logprobs_entropy`), so the [tokens, V/tp]
logits of a whole micro-batch never exist. At a 152k vocabulary they are the largest tensor
of a step: 2.4 GB in fp32 for one 4k-token sequence, several copies alive in backward.

`emit_hidden_states(chunks)` switches a model's output layer (megatron's
`ColumnParallelLinear`, which keeps its weight, name and checkpoint layout) to return its
input made ready for a vocabulary-parallel product, exactly as that layer prepares it:
gathered along the sequence under sequence parallelism (its gradient reduce-scattered back),
or with TP > 1 passed on with its gradient all-reduced over the TP group. `output_weight`
is the [V/tp, h] matrix it would have multiplied (the embedding's when they are tied).
"""

from __future__ import annotations

from types import MethodType

import torch

from megatron_rl.models.hf_mapping import unwrap


def _hidden_states_out(layer, hidden_states, weight=None, runtime_gather_output=None):
    """GPTModel's output-layer contract, (output [s, b, h], bias): the whole sequence on
    every TP rank, with the gradient semantics of the layer's own input handling."""
    if not layer.emit_hidden_states:
        return type(layer).forward(layer, hidden_states, weight, runtime_gather_output)
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import tensor_parallel

    if layer.sequence_parallel:
        hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=layer.tp_group
        )
    elif layer.allreduce_dgrad:
        hidden_states = tensor_parallel.copy_to_tensor_model_parallel_region(
            hidden_states, group=layer.tp_group
        )
    return _ContiguousGrad.apply(hidden_states), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous. GPTModel transposes what the
    output layer returns, so the gradient coming back is a transposed view, and megatron's
    TP all-reduce of it (`_reduce`) reduces a `.contiguous()` copy and returns the
    unreduced view: each rank would keep its own partial gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def emit_hidden_states(chunks: list, on: bool = True) -> None:
    """Make the last stage's output layer return hidden states (`on`) or logits again."""
    for chunk in chunks:
        model = unwrap(chunk)
        if not model.post_process:
            continue
        layer = model.output_layer
        layer.forward = MethodType(_hidden_states_out, layer)
        layer.emit_hidden_states = on


def output_weight(chunks: list) -> torch.Tensor:
    """The [V/tp, h] vocabulary projection of the last stage's chunk (the word embeddings
    when input and output embeddings are tied)."""
    for chunk in chunks:
        model = unwrap(chunk)
        if model.post_process:
            if model.share_embeddings_and_output_weights:
                return model.shared_embedding_or_output_weight()
            return model.output_layer.weight
    raise ValueError("output_weight: no chunk of this rank is a last pipeline stage")
