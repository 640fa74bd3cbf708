"""Read a Hugging Face `config.json` into a `ModelArchitecture`: every field is either mapped
exactly, known not to change the computation, or refused with its name and value.

Supported families (decoders with RMSNorm, SwiGLU, RoPE, GQA):
- `qwen2` (Qwen2 / Qwen2.5): q/k/v biases;
- `qwen3` (Qwen3 dense): per-head RMSNorm on queries and keys (qk-norm), explicit head_dim;
- `llama` (Llama-2, Llama-3, Llama-3.1/3.2 with `llama3` rope scaling);
- `qwen3_moe` (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, every MLP a top-k routed
  mixture of experts, renormalised or not (`norm_topk_prob`);
- `mixtral` (Mixtral-8x7B/8x22B): Llama's attention, top-k experts always renormalised.
Rope: default, `linear`, `llama3` and `yarn` (Qwen's long-context setting, `models.rope`).

Refused, with the reason: Qwen2-MoE and DeepSeek-V3 (shared experts, MLA), the MoE variants
we do not compute (shared experts, dense `mlp_only_layers`, sparse steps, router jitter),
Mistral, rope types
not reproduced here (dynamic, longrope), sliding-window attention where a window is shorter
than the context, activations other than SiLU (vLLM's Llama/Qwen MLP computes SiLU only),
biases megatron-core cannot place (Llama's `attention_bias` without `mlp_bias` or the reverse,
Qwen3's `attention_bias`: megatron-core's `add_bias_linear` biases o_proj and the MLP
together; Llama with both maps exactly), dropout (RL trains the policy it samples from, so it
trains without dropout), and any field this module does not know. No torch or Megatron import
(the yarn frequencies are computed when the model is built).

The router's training-time fields (`router_aux_loss_coef`, `output_router_logits`) do not
change what the model computes and are not applied: the load-balancing loss of RL training
is set in our own config, off by default, as verl, NeMo-RL and slime do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.rope import yarn_attention_factor

HF_CLASS_PREFIX = {
    "qwen2": "Qwen2", "qwen3": "Qwen3", "llama": "Llama", "qwen3_moe": "Qwen3Moe",
    "mixtral": "Mixtral",
}  # fmt: skip
"""model_type -> the prefix of its transformers classes (Qwen2ForCausalLM, ...)."""
SUPPORTED_MODEL_TYPES = tuple(HF_CLASS_PREFIX)
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
REFUSED_MODEL_TYPES = {
    "qwen2_moe": "Qwen2-MoE's gated shared expert is not supported",
    "deepseek_v3": "DeepSeek-V3's latent attention (MLA), shared experts and grouped sigmoid "
    "routing are not supported",
    "mistral": "Mistral's sliding-window attention is not supported",
}

# Read into the architecture (or checked below).
_MAPPED = {
    "model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
    "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters", "rms_norm_eps",
    "tie_word_embeddings", "initializer_range", "hidden_act", "attention_dropout",
}  # fmt: skip
_QWEN_WINDOW = {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}
# Read by `_moe` (or checked there); the router's training-only fields are harmless here.
_MOE_FIELDS = {"num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"}
_FAMILY_FIELDS = {
    "qwen2": _QWEN_WINDOW,
    "qwen3": _QWEN_WINDOW | {"attention_bias"},
    "llama": {"attention_bias", "mlp_bias", "pretraining_tp"},
    "qwen3_moe": _QWEN_WINDOW | _MOE_FIELDS | {
        "attention_bias", "num_experts", "num_local_experts", "moe_intermediate_size",
        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
        "shared_expert_intermediate_size",
    },
    "mixtral": _MOE_FIELDS | {"sliding_window", "num_local_experts", "router_jitter_noise"},
}  # fmt: skip
# Fields every transformers config may carry that do not change the model's computation:
# names, token ids, dtype, output switches, generation defaults (older configs saved them all).
_HARMLESS = {
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "use_cache", "return_dict", "output_attentions", "output_hidden_states", "torchscript",
    "use_bfloat16", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "prefix",
    "task_specific_params", "tokenizer_class", "keys_to_ignore_at_inference", "tf_legacy_loss",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "pruned_heads",
}  # fmt: skip
# rope type -> (the keys its parameters must have, those they may have), besides
# rope_type/type and rope_theta.
_ROPE_KEYS = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, set()),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate"}),
}  # fmt: skip


class _Config:
    """A config dict with the file it came from, for messages that name both."""

    def __init__(self, config: dict[str, Any], source: str):
        self.data, self.source = config, source
        self.model_type = config.get("model_type")

    def refuse(self, field: str, why: str):
        value = self.data.get(field)
        raise ValueError(
            f"{self.source}: {field}={value!r} is not supported for "
            f"model_type={self.model_type}: {why}"
        )

    def required(self, name: str) -> Any:
        if self.data.get(name) is None:
            raise ValueError(
                f"{self.source}: missing field {name!r} for model_type={self.model_type}"
            )
        return self.data[name]

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value


def read_hf_config(config: dict[str, Any] | str | Path) -> ModelArchitecture:
    """A Hugging Face `config.json` (a dict, the file, or its directory) -> ModelArchitecture.

    Raises ValueError naming the file, the field and its value for anything not reproduced
    exactly; FileNotFoundError when there is no config.
    """
    c = _Config(*_load(config))
    if c.model_type in REFUSED_MODEL_TYPES:
        raise ValueError(
            f"{c.source}: model_type={c.model_type!r} is not supported: "
            f"{REFUSED_MODEL_TYPES[c.model_type]}"
        )
    if c.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{c.source}: model_type={c.model_type!r} is not supported; "
            f"expected one of {SUPPORTED_MODEL_TYPES}"
        )
    known = _MAPPED | _FAMILY_FIELDS[c.model_type] | _HARMLESS
    unknown = sorted(k for k in c.data if k not in known)
    if unknown:
        c.refuse(
            unknown[0],
            f"megatron_rl does not read this field (unread: {unknown}); remove it from "
            "config.json only if it does not change the model's computation",
        )
    _check_computation(c)
    heads, hidden = c.required("num_attention_heads"), c.required("hidden_size")
    rope = _rope(c)
    return ModelArchitecture(
        model_type=c.model_type,
        num_layers=c.required("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=c.required("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim", hidden // heads),
        vocab_size=c.required("vocab_size"),
        max_position_embeddings=c.required("max_position_embeddings"),
        norm_epsilon=float(c.required("rms_norm_eps")),
        # Qwen2's q/k/v projections always carry biases (its config has no switch for it).
        qkv_bias=c.model_type == "qwen2" or bool(c.get("attention_bias", False)),
        linear_bias=bool(c.get("mlp_bias", False)),
        qk_layernorm=c.model_type in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        init_method_std=float(c.get("initializer_range", 0.02)),
        **rope,
        **(_moe(c) if c.model_type in MOE_MODEL_TYPES else {}),
    )


def _moe(c: _Config) -> dict[str, Any]:
    """The experts of `qwen3_moe` and `mixtral`: every decoder layer a top-k routed mixture
    of SwiGLU experts with a bias-free linear router and no shared expert."""
    if c.model_type == "mixtral":
        if float(c.get("router_jitter_noise", 0.0)) != 0.0:
            c.refuse("router_jitter_noise", "router noise is not reproduced; set it to 0.0")
        # Mixtral's experts are `intermediate_size` wide; softmax, top-k, renormalised.
        ffn, renormalise = c.required("intermediate_size"), True
    else:
        if c.get("shared_expert_intermediate_size", 0):
            c.refuse("shared_expert_intermediate_size", "shared experts are not supported")
        if c.get("mlp_only_layers", []):
            c.refuse("mlp_only_layers", "dense layers among the MoE layers are not supported")
        if c.get("decoder_sparse_step", 1) != 1:
            c.refuse("decoder_sparse_step", "only every layer a MoE layer (1) is supported")
        ffn, renormalise = c.required("moe_intermediate_size"), bool(c.get("norm_topk_prob"))
    # transformers names the count `num_local_experts` for both families; Qwen's own
    # configs spell it `num_experts`.
    if "num_experts" in c.data and "num_local_experts" in c.data:
        if c.data["num_experts"] != c.data["num_local_experts"]:
            c.refuse(
                "num_experts", f"it differs from num_local_experts={c.data['num_local_experts']}"
            )
    experts = c.get("num_local_experts") or c.required("num_experts")
    topk = c.required("num_experts_per_tok")
    if not 1 <= topk <= experts:
        c.refuse("num_experts_per_tok", f"expected between 1 and the {experts} experts")
    if topk == 1 and renormalise:
        c.refuse(
            "num_experts_per_tok",
            "one renormalised expert has weight 1 and its router no gradient (megatron-core "
            "refuses top-1 without a softmax over every expert)",
        )
    return dict(
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=ffn,
        moe_router_pre_softmax=not renormalise,
    )


def _load(config) -> tuple[dict[str, Any], str]:
    if isinstance(config, dict):
        return config, "<dict>"
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text()), str(path)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"no Hugging Face config at {path}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _check_computation(c: _Config) -> None:
    """Refuse every field whose value changes the computation in a way we do not reproduce."""
    if c.get("hidden_act", "silu") != "silu":
        c.refuse("hidden_act", "only 'silu' (SwiGLU) is computed, as vLLM's Llama/Qwen MLP does")
    if float(c.get("attention_dropout", 0.0)) != 0.0:
        c.refuse("attention_dropout", "the policy is trained without dropout; set it to 0.0")
    # megatron-core biases o_proj and the MLP together (add_bias_linear): Llama with both
    # switches on maps exactly, one without the other cannot be expressed.
    attention_bias = bool(c.get("attention_bias", False))
    if attention_bias != bool(c.get("mlp_bias", False)):  # Qwen3 has no mlp_bias: never biased
        c.refuse(
            "attention_bias" if attention_bias else "mlp_bias",
            "megatron-core adds linear biases to o_proj and the MLP together "
            "(add_bias_linear), so biases on one and not the other cannot be reproduced",
        )
    if c.get("pruned_heads", {}):
        c.refuse("pruned_heads", "pruned attention heads are not supported")
    _check_sliding_window(c)


def _check_sliding_window(c: _Config) -> None:
    """Sliding-window layers are refused unless the window covers the whole context (then
    they compute full attention). Both spellings: `layer_types` (transformers >= 4.53) and
    `use_sliding_window` + `max_window_layers` (layers from that index on slide)."""
    window = c.get("sliding_window")
    if window is None or window >= c.required("max_position_embeddings"):
        return
    layer_types = c.data.get("layer_types")
    if layer_types is not None:
        if "sliding_attention" in layer_types:
            c.refuse(
                "layer_types",
                f"sliding-window attention (window {window} < max_position_embeddings) "
                "is not supported",
            )
        return
    if c.model_type == "mixtral":  # no switch: a window is applied on every layer (Mistral's)
        c.refuse(
            "sliding_window",
            f"sliding-window attention (window {window} < "
            "max_position_embeddings) is not supported",
        )
    if c.get("use_sliding_window", False) and c.get("max_window_layers", 0) < c.required(
        "num_hidden_layers"
    ):
        c.refuse(
            "use_sliding_window",
            f"sliding-window attention (window {window} < max_position_embeddings) "
            "is not supported",
        )


def _rope(c: _Config) -> dict[str, Any]:
    """Rope fields of ModelArchitecture from either spelling: `rope_scaling` + `rope_theta`
    (transformers 4) or `rope_parameters` (transformers 5, theta inside)."""
    field = "rope_parameters" if c.data.get("rope_parameters") else "rope_scaling"
    params = dict(c.get(field, {}))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)  # old configs carry both spellings
    theta = params.pop("rope_theta", None) or c.get("rope_theta", 10000.0)
    if rope_type not in _ROPE_KEYS:
        c.refuse(
            field,
            f"rope type {rope_type!r} is not supported (supported: {sorted(_ROPE_KEYS)})",
        )
    required, optional = _ROPE_KEYS[rope_type]
    extra = sorted(set(params) - required - optional)
    if extra:
        c.refuse(field, f"rope type {rope_type!r} with {extra} is not reproduced")
    missing = sorted(required - set(params))
    if missing:
        c.refuse(field, f"rope type {rope_type!r} needs {missing}")
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_type": rope_type}
    if rope_type != "default":
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        out["rope_low_freq_factor"] = float(params["low_freq_factor"])
        out["rope_high_freq_factor"] = float(params["high_freq_factor"])
    if rope_type in ("llama3", "yarn"):
        # transformers fills a missing original context with max_position_embeddings.
        out["rope_original_max_position_embeddings"] = int(
            params.get("original_max_position_embeddings") or c.required("max_position_embeddings")
        )
    if rope_type == "yarn":
        # As transformers and vLLM read them: a falsy beta means the paper's default.
        out["rope_beta_fast"] = float(params.get("beta_fast") or 32.0)
        out["rope_beta_slow"] = float(params.get("beta_slow") or 1.0)
        out["rope_truncate"] = bool(params.get("truncate", True))
        out["rope_attention_factor"] = yarn_attention_factor(
            out["rope_factor"],
            params.get("attention_factor"),
            params.get("mscale"),
            params.get("mscale_all_dim"),
        )
    return out
