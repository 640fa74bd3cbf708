"""The shape of a decoder-only model (Qwen2 / Qwen3 / Llama families, and the Qwen3-MoE /
Mixtral mixtures of experts).

Pure Python: no Megatron import, so configs can be validated before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

VOCAB_PAD_MULTIPLE = 1024
"""128 * 8: the padded vocabulary is the same for every TP size up to 8, so a checkpoint
saved at one TP loads at another (megatron-LM pads to 128 * TP, which changes with TP)."""


@dataclass(frozen=True)
class ModelArchitecture:
    """Dimensions and flavour of a Qwen2/Qwen3/Llama-style transformer (RMSNorm, SwiGLU, RoPE,
    GQA). Defaults keep architectures saved before a field existed loadable."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA); equals num_attention_heads for plain multi-head attention."""
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_epsilon: float
    qkv_bias: bool
    tie_word_embeddings: bool
    init_method_std: float = 0.02
    linear_bias: bool = False
    """Biases on o_proj and the MLP projections (Llama with attention_bias and mlp_bias)."""
    qk_layernorm: bool = False
    """Qwen3: RMSNorm over head_dim on each query and key head before RoPE."""
    rope_type: str = "default"
    """"default", "linear" (positions / factor), "llama3" (Llama-3.1 frequency scaling) or
    "yarn" (YaRN, `megatron_rl.models.rope`)."""
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int | None = None
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True
    rope_attention_factor: float = 1.0
    """YaRN: cos and sin are scaled by it, so attention logits by its square."""
    num_moe_experts: int = 0
    """Routed experts per layer (0: a dense model). Every layer is a MoE layer."""
    moe_router_topk: int = 0
    """Experts each token is sent to (HF `num_experts_per_tok`)."""
    moe_ffn_hidden_size: int | None = None
    """Each expert's SwiGLU width (HF `moe_intermediate_size`, Mixtral's `intermediate_size`)."""
    moe_router_pre_softmax: bool = False
    """False: top-k of the router logits, then a softmax over those k (the probabilities of
    the chosen experts renormalised: Mixtral, Qwen3-MoE with `norm_topk_prob`); True: softmax
    over every expert, then the top k, not renormalised (Qwen3-MoE without it)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}"
            )
        if self.is_moe and not 1 <= self.moe_router_topk <= self.num_moe_experts:
            raise ValueError(
                f"num_experts_per_tok={self.moe_router_topk}: expected between 1 and the "
                f"{self.num_moe_experts} experts"
            )

    @property
    def is_moe(self) -> bool:
        return self.num_moe_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of VOCAB_PAD_MULTIPLE (and of TP), so it splits
        evenly over TP ranks.

        The extra rows are zero on import and dropped on export; log-probs and entropy mask
        them (`megatron_rl.parallel.vocab`), and sampling never sees them.
        """
        multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
        return -(-self.vocab_size // multiple) * multiple

    def check_divisible(self, tp: int, layer_chunks: int, etp: int = 1, ep: int = 1) -> None:
        """Raise ValueError, naming the numbers, if TP, PP, or expert TP (`etp`) and expert
        parallelism (`ep`) cannot split this model."""
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_query_groups % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"num_key_value_heads={self.num_query_groups}"
            )
        if not self.is_moe and self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"intermediate_size={self.ffn_hidden_size}"
            )
        if self.is_moe and self.num_moe_experts % ep != 0:
            raise ValueError(
                f"expert_model_parallel_size={ep} does not divide "
                f"the {self.num_moe_experts} experts"
            )
        if self.is_moe and self.moe_ffn_hidden_size % etp != 0:
            raise ValueError(
                f"expert_tensor_parallel_size={etp} does not divide "
                f"the experts' intermediate size {self.moe_ffn_hidden_size}"
            )
        if self.num_layers % layer_chunks != 0:
            raise ValueError(
                f"num_hidden_layers={self.num_layers} is not divisible by "
                f"pipeline_model_parallel_size * virtual_pipeline_model_parallel_size = {layer_chunks}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
