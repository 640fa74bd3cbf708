"""megatron-core's decoder layer, forward in the calls its maths needs where nothing else is
asked of it.

megatron-core's `TransformerLayer.forward` serves training, inference (KV caches, fused
tensor-parallel inference kernels, chunked prefill), CUDA graphs, recomputing or offloading
its norms, cross-attention and dropout. A decoder layer training or scoring without them
computes

    h = x + attention(input_layernorm(x)),    out = h + mlp(pre_mlp_layernorm(h))

(each sublayer's bias added to its output first, where its projection returns one). Around
those four calls megatron's forward makes some thirty more in Python: two nested forward
functions, an import and an offloading context per norm, six NVTX ranges, cross-attention's
identity norm, module and bias-dropout-add, a bias-dropout-add factory and a
`torch.enable_grad` context per residual, and a view check. That is host time a short step
waits for on a GPU (a 0.5B model at 4 x 2,048 tokens left an H200 half idle,
`bench/gpu.md`), and on the 2-core CPU the `tiny-deep` update (24 layers) ran 1.05-1.08x
faster without it (`docs/performance.md`).

`use_lean_layer()` puts `_lean_forward` in `TransformerLayer.forward` for the layers and calls
it covers; every other (a layer with CUDA graphs, recomputed or offloaded norms or MLP,
dropout, cross-attention, a subclass; a call with an inference context or cross-attention
context) goes to megatron-core's own forward unchanged. The sums are megatron's, in its
order and dtype (its `_bias_dropout_add_func` at dropout 0: `residual + (x + bias)`, in
place outside training where nothing needs a gradient), so outputs and gradients are equal
to the bit (`tests/models/test_layer_unit.py`, and whole models at TP2+SP, PP2, DP2, packed
and in eval mode in `tests/models/test_core_attention_distributed.py`).
"""

from __future__ import annotations

import functools

_ATTENTION_KWARGS = (
    "rotary_pos_emb",
    "rotary_pos_cos",
    "rotary_pos_sin",
    "rotary_pos_cos_sin",
    "attention_bias",
    "packed_seq_params",
    "sequence_len_offset",
)
_TAKEN = frozenset(
    {"hidden_states", "attention_mask", "context", "context_mask", "inference_context",
     "padding_mask", *_ATTENTION_KWARGS}
)  # fmt: skip
"""The keywords megatron's `TransformerBlock` calls a layer with; any other (a positional
argument, `inference_params`, a CUDA graph's) takes megatron's forward."""


def _covered(layer) -> bool:
    """Whether `layer` is a plain megatron `TransformerLayer` whose forward is the four calls
    above: fixed at construction, so decided once and kept on the layer."""
    covered = layer.__dict__.get("_lean_forward")
    if covered is None:
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
        from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
        from megatron.core.transformer.transformer_layer import TransformerLayer

        covered = (
            type(layer) is TransformerLayer
            and layer.config.cuda_graph_impl == "none"
            and not layer.config.inference_fuse_tp_communication
            and layer.hidden_dropout == 0.0
            and not (
                layer.recompute_input_layernorm
                or layer.recompute_pre_mlp_layernorm
                or layer.recompute_mlp
                or layer.offload_attn_norm
                or layer.offload_mlp_norm
            )
            and isinstance(layer.pre_cross_attn_layernorm, IdentityOp)
            and isinstance(layer.cross_attention, IdentityOp)
            and isinstance(layer.cross_attn_bda, IdentityFuncOp)
            and layer.self_attn_bda is get_bias_dropout_add
            and layer.mlp_bda is get_bias_dropout_add
        )
        layer.__dict__["_lean_forward"] = covered
    return covered


def _add_residual(training: bool, x, bias, residual):
    """megatron's bias-dropout-add at dropout 0 (`_bias_dropout_add_func`): residual + (x +
    bias) in x's dtype, in place outside training where nothing needs a gradient."""
    inplace = not (
        training
        or x.requires_grad
        or residual.requires_grad
        or (bias is not None and bias.requires_grad)
    )
    if residual.dtype != x.dtype:
        residual = residual.to(x.dtype)
    if bias is not None:
        x = x.add_(bias) if inplace else x + bias
    return x.add_(residual) if inplace else residual + x


def _lean_forward(megatron_forward):
    """`TransformerLayer.forward`, the four calls and two sums above where `_covered`."""

    # why: megatron-core takes seconds to import: loaded where it is put in place
    from megatron.core.utils import make_viewless_tensor

    def forward(self, *args, **kwargs):
        if (
            args
            or "hidden_states" not in kwargs
            or kwargs.get("inference_context") is not None
            or kwargs.get("context") is not None
            or not kwargs.keys() <= _TAKEN
            or not _covered(self)
        ):
            return megatron_forward(self, *args, **kwargs)
        hidden_states = kwargs["hidden_states"]
        out, bias = self.self_attention(
            self.input_layernorm(hidden_states),
            attention_mask=kwargs.get("attention_mask"),
            **{k: kwargs[k] for k in _ATTENTION_KWARGS if k in kwargs},
        )
        hidden_states = _add_residual(self.training, out, bias, hidden_states)
        out, bias = self.mlp(
            self.pre_mlp_layernorm(hidden_states), padding_mask=kwargs.get("padding_mask")
        )
        out = _add_residual(self.training, out, bias, hidden_states)
        if out._base is not None:  # megatron's layer returns no view (pipeline stages free it)
            out = make_viewless_tensor(out, requires_grad=out.requires_grad, keep_graph=True)
        return out, None

    functools.update_wrapper(forward, megatron_forward)
    forward.megatron_fn = megatron_forward
    return forward


def use_lean_layer() -> bool:
    """Put `_lean_forward` in megatron-core's `TransformerLayer.forward`. Returns whether it
    is in place; idempotent."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not hasattr(TransformerLayer.forward, "megatron_fn"):
        TransformerLayer.forward = _lean_forward(TransformerLayer.forward)
    return hasattr(TransformerLayer.forward, "megatron_fn")
