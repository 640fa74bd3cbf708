"""Named model shapes (the fields of their Hugging Face `config.json`), for benchmarks and the
memory planner: `preset_arch("qwen2.5-32b")` or `resolve_arch(name_or_config_path)`."""

from __future__ import annotations

from pathlib import Path

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.hf_config import read_hf_config

_QWEN2 = dict(model_type="qwen2", max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6)

PRESETS: dict[str, dict] = {
    # examples.tiny_model's default shape.
    "tiny": dict(_QWEN2, num_hidden_layers=4, hidden_size=128, intermediate_size=352,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                 tie_word_embeddings=False),
    # tiny's width 24 layers deep: at a few tokens a step is all host time (Python per module
    # and per op), as a GPU's is at short sequences; the host-bound benchmark shape.
    "tiny-deep": dict(_QWEN2, num_hidden_layers=24, hidden_size=64, intermediate_size=176,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                      tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(_QWEN2, num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         tie_word_embeddings=True),
    # A ~1.2B Qwen2 shape (Qwen2.5-1.5B's width, 20 layers, untied): the MFU benchmark model.
    "qwen2-1b": dict(_QWEN2, num_hidden_layers=20, hidden_size=1536, intermediate_size=8960,
                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen2.5-7b": dict(_QWEN2, num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       tie_word_embeddings=False),
    "qwen2.5-32b": dict(_QWEN2, num_hidden_layers=64, hidden_size=5120, intermediate_size=27648,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                        tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", max_position_embeddings=40960, rope_theta=1e6,
                     rms_norm_eps=1e-6, num_hidden_layers=36, hidden_size=4096,
                     intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", max_position_embeddings=40960, rope_theta=1e6,
                      rms_norm_eps=1e-6, num_hidden_layers=64, hidden_size=5120,
                      intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
                      head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "llama-3.1-8b": dict(model_type="llama", max_position_embeddings=131072,
                         rms_norm_eps=1e-5, num_hidden_layers=32, hidden_size=4096,
                         intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                         rope_theta=500000.0,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # Qwen3-30B-A3B's config.json: 48 MoE layers of 128 experts (768 wide), 8 per token.
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", max_position_embeddings=40960,
                          rope_theta=1e6, rms_norm_eps=1e-6, num_hidden_layers=48,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          vocab_size=151936, tie_word_embeddings=False),
}  # fmt: skip


def preset_arch(name: str) -> ModelArchitecture:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(PRESETS)}")
    return read_hf_config(PRESETS[name])


def resolve_arch(model: str) -> ModelArchitecture:
    """A preset name, or a Hugging Face `config.json` (the file or its directory)."""
    if model in PRESETS:
        return preset_arch(model)
    if not Path(model).exists():
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
            "path to a Hugging Face config.json or checkpoint directory"
        )
    return read_hf_config(model)


def layer_param_count(arch: ModelArchitecture, tp: int = 1) -> int:
    """Parameters of one transformer layer on one of `tp` tensor-parallel ranks, experts
    apart (`expert_layer_param_count`): QKV (+ bias), output projection and a dense SwiGLU MLP
    are split; the norms (and Qwen3's q/k norms), the row-parallel biases and a MoE router
    replicated."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    split = h * (q + 2 * kv) + q * h + (0 if arch.is_moe else 3 * h * arch.ffn_hidden_size)
    if arch.qkv_bias:
        split += q + 2 * kv
    replicated = 2 * h + (2 * arch.head_dim if arch.qk_layernorm else 0)
    replicated += arch.num_moe_experts * h  # the router
    if arch.linear_bias:  # o_proj and down_proj biases whole on every rank, gate/up split
        split += 2 * arch.ffn_hidden_size
        replicated += 2 * h
    return split // tp + replicated


def lora_layer_param_count(arch: ModelArchitecture, rank: int, tp: int = 1) -> int:
    """Adapter parameters of one layer on one of `tp` ranks, rank-`rank` LoRA on every
    linear it adapts (`models/lora.py`): the attention's QKV and output projection, and a
    dense model's MLP (experts are not adapted). A column-parallel linear keeps A [r, in]
    whole and splits B [out, r]; a row-parallel one splits A and keeps B whole."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    linears = [(h, q + 2 * kv, "column"), (q, h, "row")]  # (in, out, kind)
    if not arch.is_moe:
        f = arch.ffn_hidden_size
        linears += [(h, 2 * f, "column"), (f, h, "row")]
    count = 0
    for fan_in, fan_out, kind in linears:
        count += rank * (fan_in + fan_out // tp if kind == "column" else fan_in // tp + fan_out)
    return count


def expert_layer_param_count(arch: ModelArchitecture, etp: int = 1, ep: int = 1) -> int:
    """Expert parameters of one MoE layer on one rank: experts / `ep` of them, each SwiGLU
    split over `etp` expert-tensor-parallel ranks (0 for a dense model)."""
    per_expert = 3 * arch.hidden_size * (arch.moe_ffn_hidden_size or 0)
    return arch.num_moe_experts // ep * per_expert // etp


def param_count(arch: ModelArchitecture) -> int:
    """Parameters of the Hugging Face model (unpadded vocabulary)."""
    embeddings = arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2)
    layer = layer_param_count(arch) + expert_layer_param_count(arch)
    return arch.num_layers * layer + embeddings + arch.hidden_size


def active_param_count(arch: ModelArchitecture) -> int:
    """Parameters one token's forward uses: a MoE layer's top-k experts, not all of them."""
    unused = arch.num_moe_experts - arch.moe_router_topk
    per_expert = 3 * arch.hidden_size * (arch.moe_ffn_hidden_size or 0)
    return param_count(arch) - arch.num_layers * unused * per_expert
