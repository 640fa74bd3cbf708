"""Unit tier: every Hugging Face config field is mapped, known to be harmless, or refused by
name and value; every checkpoint tensor is mapped or the checkpoint is refused."""

import json
import math
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import HFCheckpointReader, validate_hf_checkpoint
from megatron_rl.models.rope import yarn_inv_freq

# Published config.json files, verbatim but for the comments (transformers 4 spelling:
# rope_theta and rope_scaling at the top level).
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
    "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}  # fmt: skip

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
    "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mixtral",
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip


def test_published_moe_configs_read_exactly():
    qwen = read_hf_config(QWEN3_30B_A3B)
    assert (qwen.num_moe_experts, qwen.moe_router_topk, qwen.moe_ffn_hidden_size) == (128, 8, 768)
    assert qwen.qk_layernorm and qwen.head_dim == 128 and not qwen.moe_router_pre_softmax
    mixtral = read_hf_config(MIXTRAL_8X7B)
    assert (mixtral.num_moe_experts, mixtral.moe_router_topk) == (8, 2)
    assert mixtral.moe_ffn_hidden_size == 14336 and not mixtral.moe_router_pre_softmax
    assert not mixtral.qk_layernorm and not mixtral.qkv_bias


def test_both_spellings_of_the_expert_count_and_of_renormalisation():
    """transformers writes `num_local_experts` for Qwen3-MoE too; without `norm_topk_prob`
    the top-k softmax probabilities are used as they are (softmax before the top-k)."""
    respelled = changed(QWEN3_30B_A3B, num_local_experts=128)
    del respelled["num_experts"]
    assert read_hf_config(respelled) == read_hf_config(QWEN3_30B_A3B)
    assert read_hf_config(changed(QWEN3_30B_A3B, norm_topk_prob=False)).moe_router_pre_softmax


def test_published_configs_read_exactly():
    llama = read_hf_config(LLAMA_3_1_8B)
    assert (llama.rope_type, llama.rope_factor, llama.rope_original_max_position_embeddings) == (
        "llama3",
        8.0,
        8192,
    )
    assert llama.rope_theta == 500000.0 and not llama.qkv_bias and not llama.qk_layernorm
    qwen3 = read_hf_config(QWEN3_8B)
    assert qwen3.qk_layernorm and not qwen3.qkv_bias and qwen3.head_dim == 128
    assert qwen3.rope_type == "default" and qwen3.rope_theta == 1e6
    qwen2 = read_hf_config(QWEN2_5_7B)
    assert qwen2.qkv_bias and qwen2.head_dim == 128 and qwen2.num_query_groups == 4


# Qwen2.5's model card: "add the following to config.json" for contexts beyond 32,768 tokens.
QWEN2_5_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}


def test_published_yarn_setting_reads_exactly():
    arch = read_hf_config(changed(QWEN2_5_7B, rope_scaling=QWEN2_5_YARN))
    assert (arch.rope_type, arch.rope_factor, arch.rope_original_max_position_embeddings) == (
        "yarn",
        4.0,
        32768,
    )
    assert (arch.rope_beta_fast, arch.rope_beta_slow, arch.rope_truncate) == (32.0, 1.0, True)
    assert arch.rope_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0, rel=1e-12)


YARN_VARIANTS = {
    "qwen-card": dict(factor=4.0, original_max_position_embeddings=32768),
    "all-keys": dict(
        factor=8.0,
        original_max_position_embeddings=4096,
        beta_fast=16,
        beta_slow=2,
        attention_factor=1.25,
        truncate=False,
    ),
    "deepseek-mscale": dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),
    "no-original": dict(factor=2.0),
}  # fmt: skip


@pytest.mark.parametrize("variant", YARN_VARIANTS)
def test_yarn_frequencies_and_attention_factor_are_transformers(variant):
    """What the trainer computes (`models.rope`) against what transformers computes, for
    every way a config can set them. (vLLM's side: the greedy test of the yarn family.)"""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = YARN_VARIANTS[variant]
    config = transformers.Qwen2Config(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, **params},
    )  # fmt: skip
    arch = read_hf_config(config.to_dict())
    ours = yarn_inv_freq(
        arch.head_dim, arch.rope_theta, arch.rope_factor,
        arch.rope_original_max_position_embeddings,
        arch.rope_beta_fast, arch.rope_beta_slow, arch.rope_truncate,
    )  # fmt: skip
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    assert torch.equal(ours, hf_inv_freq)
    assert arch.rope_attention_factor == pytest.approx(hf_factor, rel=1e-12)
    # Not the plain frequencies: the variant scales some of them.
    assert not torch.allclose(ours, yarn_inv_freq(128, 1e6, 1.0, 4096))


def test_both_rope_spellings_give_the_same_architecture():
    """transformers 5 writes `rope_parameters` with theta inside; 4 wrote rope_scaling +
    rope_theta. The transformers-5 dict of the same model reads the same."""
    config = transformers.LlamaConfig(**{k: v for k, v in LLAMA_3_1_8B.items()})
    new_spelling = config.to_dict()
    assert "rope_parameters" in new_spelling and new_spelling.get("rope_scaling") is None
    assert read_hf_config(new_spelling) == read_hf_config(LLAMA_3_1_8B)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Llama"])
def test_every_field_transformers_writes_is_known(family):
    """The full dict (not only the non-default fields save_pretrained writes) is accepted:
    no field of the locked transformers version is unknown to the reader."""
    full = getattr(transformers, f"{family}Config")().to_dict()
    assert read_hf_config(full).model_type == family.lower()


def changed(base: dict, **fields) -> dict:
    return {**base, **fields}


REFUSED = [
    (changed(LLAMA_3_1_8B, attention_bias=True), r"attention_bias=True .*add_bias_linear"),
    (changed(LLAMA_3_1_8B, mlp_bias=True), r"mlp_bias=True.*one and not the other"),
    (changed(QWEN3_8B, attention_bias=True), r"attention_bias=True"),
    (changed(LLAMA_3_1_8B, hidden_act="gelu"), r"hidden_act='gelu'.*silu"),
    (changed(QWEN2_5_7B, attention_dropout=0.1), r"attention_dropout=0.1"),
    (
        changed(QWEN2_5_7B, use_sliding_window=True, sliding_window=4096, max_window_layers=0),
        r"use_sliding_window=True.*window 4096",
    ),
    (
        changed(QWEN3_8B, sliding_window=4096, layer_types=["sliding_attention"] * 36),
        r"layer_types=.*sliding-window",
    ),
    (
        changed(QWEN2_5_7B, rope_scaling={"rope_type": "longrope", "factor": 4.0}),
        r"rope_scaling=.*rope type 'longrope' is not supported",
    ),
    (
        changed(
            QWEN2_5_7B,
            rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 32768},
        ),
        r"rope type 'yarn' needs \['factor'\]",
    ),
    (
        changed(
            QWEN2_5_7B, rope_scaling={"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 1}
        ),
        r"rope type 'yarn' with \['extrapolation_factor'\] is not reproduced",
    ),
    (
        changed(LLAMA_3_1_8B, rope_scaling={"type": "dynamic", "factor": 2.0}),
        r"rope type 'dynamic'",
    ),
    (
        changed(LLAMA_3_1_8B, rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        r"needs \['high_freq_factor', 'low_freq_factor', 'original_max_position_embeddings'\]",
    ),
    (
        changed(LLAMA_3_1_8B, rope_scaling={"rope_type": "linear", "factor": 2.0, "beta": 1}),
        r"rope type 'linear' with \['beta'\] is not reproduced",
    ),
    (changed(QWEN3_8B, quantization_config={"quant_method": "fp8"}), r"quantization_config="),
    (changed(QWEN2_5_7B, attention_bias=True), r"attention_bias=True .* does not read"),
    (changed(QWEN3_8B, model_type="qwen2_moe"), r"qwen2_moe.*shared expert"),
    (changed(QWEN3_8B, model_type="deepseek_v3"), r"deepseek_v3.*latent attention"),
    (
        changed(QWEN3_30B_A3B, shared_expert_intermediate_size=768),
        r"shared_expert_intermediate_size=768 .* shared experts",
    ),
    (changed(QWEN3_30B_A3B, mlp_only_layers=[0, 47]), r"mlp_only_layers=\[0, 47\] .* dense layers"),
    (changed(QWEN3_30B_A3B, decoder_sparse_step=2), r"decoder_sparse_step=2 .* every layer"),
    (
        changed(QWEN3_30B_A3B, num_experts_per_tok=129),
        r"num_experts_per_tok=129 .* between 1 and the 128",
    ),
    (changed(QWEN3_30B_A3B, num_experts_per_tok=1), r"num_experts_per_tok=1 .* weight 1"),
    (changed(QWEN3_30B_A3B, num_local_experts=64), r"num_experts=128 .* num_local_experts=64"),
    (changed(QWEN3_30B_A3B, attention_bias=True), r"attention_bias=True .*add_bias_linear"),
    (changed(MIXTRAL_8X7B, router_jitter_noise=0.1), r"router_jitter_noise=0.1 .* noise"),
    (changed(MIXTRAL_8X7B, sliding_window=4096), r"sliding_window=4096 .* sliding-window"),
    (changed(MIXTRAL_8X7B, num_experts=8), r"num_experts=8 .* does not read"),
    (changed(QWEN3_30B_A3B, moe_intermediate_size=None), r"missing field 'moe_intermediate_size'"),
    (changed(LLAMA_3_1_8B, model_type="mistral"), r"mistral.*sliding-window"),
]


@pytest.mark.parametrize("config, message", REFUSED, ids=[m for _, m in REFUSED])
def test_what_is_not_reproduced_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        read_hf_config(config)


def test_llama_biased_everywhere_is_supported():
    arch = read_hf_config(changed(LLAMA_3_1_8B, attention_bias=True, mlp_bias=True))
    assert arch.qkv_bias and arch.linear_bias


def test_a_window_covering_the_context_is_full_attention():
    config = changed(QWEN2_5_7B, use_sliding_window=True, sliding_window=32768, max_window_layers=0)
    assert read_hf_config(config) == read_hf_config(QWEN2_5_7B)


def test_refusals_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(changed(QWEN3_8B, attention_dropout=0.5)))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: attention_dropout=0.5"):
        read_hf_config(tmp_path)


def checkpoint_with(src, dst, config_changes=None, **extra_tensors):
    """A copy of checkpoint `src` with more tensors (and config fields)."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    save_file({**weights, **extra_tensors}, dst / "model.safetensors")
    if config_changes:
        config = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


def test_a_tensor_nothing_maps_is_refused_by_name(tiny_model_dir, tmp_path):
    bias = {"model.layers.1.self_attn.o_proj.bias": torch.zeros(128)}
    hf = checkpoint_with(tiny_model_dir, tmp_path / "hf", **bias)
    arch = read_hf_config(hf)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) .* model.layers.1.self_attn.o_proj.bias"):
        validate_hf_checkpoint(HFCheckpointReader(hf), arch)


def test_rotary_buffers_of_old_checkpoints_are_not_weights(tiny_model_dir, tmp_path):
    buffer = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(16)}
    hf = checkpoint_with(tiny_model_dir, tmp_path / "hf", **buffer)
    validate_hf_checkpoint(HFCheckpointReader(hf), read_hf_config(hf))


@pytest.mark.parametrize("same", [True, False])
def test_a_tied_checkpoint_may_carry_its_lm_head_only_if_equal(tiny_tied_model_dir, tmp_path, same):
    embed = HFCheckpointReader(tiny_tied_model_dir)("model.embed_tokens.weight")
    head = embed.clone() if same else embed + 1
    hf = checkpoint_with(tiny_tied_model_dir, tmp_path / "hf", **{"lm_head.weight": head})
    arch = read_hf_config(hf)
    if same:
        validate_hf_checkpoint(HFCheckpointReader(hf), arch)
    else:
        with pytest.raises(ValueError, match="lm_head.weight differs"):
            validate_hf_checkpoint(HFCheckpointReader(hf), arch)
