"""The Hugging Face families the converters support, as tiny random checkpoints: one row per
family and variant. Shared by the conversion, vLLM and gradient tests (`family_dir` fixture)."""

from examples.tiny_model import TinyModelSpec

LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    # Shorter than the tests' 96-token sequences: positions beyond the original context.
    original_max_position_embeddings=64,
)


def _llama(**kw) -> TinyModelSpec:
    return TinyModelSpec(model_type="llama", chat_template="llama3", layers=2, **kw)


SUPPORTED = {
    "qwen2.5": TinyModelSpec(layers=2, seed=11),
    "qwen2.5-tied": TinyModelSpec(layers=2, tie_embeddings=True, seed=12),
    # An explicit head_dim that is not hidden / heads (q_proj is [256, 128]).
    "qwen3": TinyModelSpec(model_type="qwen3", layers=2, head_dim=64, seed=13),
    "qwen3-tied": TinyModelSpec(model_type="qwen3", layers=2, tie_embeddings=True, seed=14),
    "llama-2": _llama(kv_heads=4, seed=15),  # multi-head attention
    "llama-3": _llama(rope_theta=500000.0, seed=16),
    "llama-3.1": _llama(
        rope_theta=500000.0, seed=17, config_overrides=dict(rope_scaling=LLAMA3_ROPE)
    ),
    "llama-3.2": _llama(
        rope_theta=500000.0,
        tie_embeddings=True,
        seed=18,
        config_overrides=dict(rope_scaling=dict(LLAMA3_ROPE, factor=32.0)),
    ),
    # Biases on every projection (megatron-core's add_bias_linear + add_qkv_bias).
    "llama-biases": _llama(seed=20, config_overrides=dict(attention_bias=True, mlp_bias=True)),
    "llama-linear-rope": _llama(
        seed=19, config_overrides=dict(rope_scaling=dict(rope_type="linear", factor=2.0))
    ),
    # YaRN as Qwen2.5's model card sets it (old spelling), with a 32-token original context.
    "qwen2.5-yarn": TinyModelSpec(
        layers=2,
        seed=21,
        config_overrides=dict(
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32)
        ),
    ),
    # Every YaRN parameter away from its default.
    "qwen3-yarn": TinyModelSpec(
        model_type="qwen3",
        layers=2,
        seed=22,
        config_overrides=dict(
            rope_scaling=dict(
                rope_type="yarn",
                factor=8.0,
                original_max_position_embeddings=32,
                beta_fast=16.0,
                beta_slow=2.0,
                attention_factor=1.25,
                truncate=False,
            )
        ),
    ),
}

# Mixtures of experts: 8 experts of width 64, top-2 (tests/families.py MOE rows).
MOE = {
    "qwen3-moe": TinyModelSpec(model_type="qwen3_moe", layers=2, seed=30),
    # Softmax over every expert, top-k probabilities not renormalised.
    "qwen3-moe-nonorm": TinyModelSpec(
        model_type="qwen3_moe", layers=2, seed=31, config_overrides=dict(norm_topk_prob=False)
    ),
    "mixtral": TinyModelSpec(
        model_type="mixtral", chat_template="llama3", layers=2, experts=4, seed=32
    ),
}
SUPPORTED.update(MOE)
