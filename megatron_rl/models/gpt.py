"""Megatron-core GPTModel builders for Qwen2/Qwen3/Llama-family architectures.

`build_gpt_model_chunks(arch, layout)` returns this rank's model chunks (one per virtual
pipeline stage): RMSNorm, SwiGLU, RoPE with the Hugging Face theta and scaling (linear,
llama3), GQA, optional QKV bias, optional per-head query/key RMSNorm (Qwen3), and for
mixture-of-experts families a top-k routed MoE layer in place of every MLP (`MoEConfig`).

Layer specs: the Transformer Engine spec when TE is importable and CUDA is present (fused
norm+linear, FP8-capable; experts as one grouped GEMM, `TEGroupedMLP`), otherwise
megatron-core's local spec with PyTorch's fused attention (`models/attention.py`) and our
`RMSNorm`, which unlike megatron's torch-norm wrapper
supports sequence parallelism (its weight is tagged `sequence_parallel`, so Megatron
all-reduces its gradient across the TP group), and experts as a `SequentialMLP`. Both expert
layouts save the same sharded checkpoint (experts at global indices).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.attention import SDPAttention
from megatron_rl.models.layer import use_lean_layer
from megatron_rl.models.linear import use_plain_linear
from megatron_rl.models.rope import yarn_inv_freq
from megatron_rl.models.rotary import use_rotate_half_rope
from megatron_rl.models.swiglu import use_fused_swiglu
from megatron_rl.parallel.distributed import ParallelLayout


class RMSNorm(torch.nn.Module):
    """RMSNorm for megatron-core's local spec, usable with sequence parallelism.

    Computes in fp32 like Hugging Face's Qwen2/Llama RMSNorm, then casts back.
    Input [s, b, h] (or any [..., h]); output has the same shape and dtype.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=_init_device(config))
        )
        # Under SP each TP rank sees a different slice of the sequence, so the weight's
        # gradient is partial per rank; Megatron all-reduces params carrying this tag.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * y.to(x.dtype)


def _init_device(config) -> torch.device:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        # why: optional: probed, not required
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "blockwise")


@dataclass(frozen=True)
class PrecisionConfig:
    """Numerics of a model: parameter dtype, and FP8 GEMMs through Transformer Engine.

    With FP8 the parameters stay bf16 (the master copy that checkpoints and the vLLM sync
    export); only GEMM inputs are cast, with the scaling recipe below.
    """

    params_dtype: torch.dtype = torch.float32
    """bf16 on GPU clusters, fp32 on CPU (megatron's bf16 optimizer needs CUDA)."""
    fp8: str | None = None
    """None, "e4m3" (all GEMMs) or "hybrid" (e4m3 forward, e5m2 gradients)."""
    fp8_recipe: str = "delayed"
    """"delayed" (amax history), "tensorwise" (current scaling) or "blockwise" (Hopper)."""
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if self.fp8 is None:
            return
        if self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8={self.fp8!r}: expected one of {FP8_FORMATS} or None")
        if self.fp8_recipe not in FP8_RECIPES:
            raise ValueError(f"fp8_recipe={self.fp8_recipe!r}: expected one of {FP8_RECIPES}")
        if self.params_dtype != torch.bfloat16:
            raise ValueError(f"fp8 needs params_dtype=torch.bfloat16, got {self.params_dtype}")
        if self.fp8_amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"fp8_amax_compute_algo={self.fp8_amax_compute_algo!r}: expected max or most_recent"
            )

    @property
    def bf16(self) -> bool:
        return self.params_dtype == torch.bfloat16

    def check_supported(self) -> None:
        """Raise at start-up, never fall back silently: FP8 needs TE and a Hopper-class GPU."""
        if self.fp8 is None:
            return
        if not torch.cuda.is_available():
            raise RuntimeError(f"fp8={self.fp8!r} needs a CUDA GPU (Hopper or newer); none found")
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (9, 0):
            raise RuntimeError(
                f"fp8={self.fp8!r} needs a Hopper-class GPU (compute capability >= 9.0); "
                f"{torch.cuda.get_device_name()} has {major}.{minor}"
            )
        if not transformer_engine_available():
            raise RuntimeError(
                f"fp8={self.fp8!r} needs Transformer Engine: pip install -e '.[gpu]'"
            )


RECOMPUTE_GRANULARITIES = ("full", "selective")


@dataclass(frozen=True)
class RecomputeConfig:
    """Activation recompute (Korthikanti et al. 2022), megatron-core's names.

    "full": keep only each checkpointed block's input and recompute it in backward (about a
    third more compute; what long responses at 32B need, see `tools/plan_memory.py`);
    "selective": recompute the attention core only (no gain with flash attention, which
    never stores the s x s scores).
    """

    granularity: str | None = None
    """None, "full" or "selective"."""
    method: str = "uniform"
    """"uniform" (checkpoint every `num_layers` layers) or "block" (the first `num_layers`)."""
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.granularity is not None and self.granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute granularity={self.granularity!r}: expected one of "
                f"{RECOMPUTE_GRANULARITIES} or None"
            )
        if self.method not in ("uniform", "block"):
            raise ValueError(f"recompute method={self.method!r}: expected uniform or block")
        if self.num_layers < 1:
            raise ValueError(f"recompute num_layers={self.num_layers}: expected >= 1")

    def transformer_config_kwargs(self) -> dict:
        if self.granularity is None:
            return {}
        if self.granularity == "selective":
            return {"recompute_granularity": "selective"}
        return {
            "recompute_granularity": "full",
            "recompute_method": self.method,
            "recompute_num_layers": self.num_layers,
        }


MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")
MOE_ROUTER_DTYPES = (None, "fp32", "fp64")
MOE_LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss", "global_aux_loss")


@dataclass(frozen=True)
class MoEConfig:
    """How a mixture-of-experts model routes and dispatches tokens (megatron-core's names).

    The routing itself (experts, top-k, renormalisation) comes from the checkpoint's config
    (`ModelArchitecture`); these are the run's choices. The defaults are those of verl,
    NeMo-RL and slime for RL: no load-balancing loss (it moves the policy away from the one
    that sampled, and NeMo-RL saw it make log-probs diverge), the router in fp32, alltoall.
    """

    moe_token_dispatcher_type: str = "alltoall"
    """"alltoall" (tokens sent to their experts' ranks) or "allgather" (every token to every
    rank of the expert group)."""
    moe_router_dtype: str | None = "fp32"
    """The router's logits and softmax in fp32 (or "fp64"); None: the parameters' dtype."""
    moe_router_load_balancing_type: str = "none"
    """"none", or the load-balancing loss added to the router's gradient: "aux_loss"
    (Switch's, over each micro-batch), "seq_aux_loss" (per sequence), "global_aux_loss"."""
    moe_aux_loss_coeff: float = 0.0
    """Its weight (> 0 with a type other than "none"). Like Megatron-LM's, each micro-batch's
    balance loss is averaged over micro-batches and data-parallel ranks; it is never part of
    the policy loss, and is logged apart (`actor/moe/*`)."""
    moe_z_loss_coeff: float | None = None
    """ST-MoE's router z-loss weight (keeps router logits small); None: off."""
    freeze_moe_router: bool = False
    """Router weights not trained (NeMo-RL's name): the routes move only with the inputs."""
    routing_replay: bool = False
    """Give each router a megatron-core `RouterReplay` (set for the actor by
    `actor.router_replay`, never by hand: `models/router_replay.py`)."""

    def __post_init__(self) -> None:
        if self.moe_token_dispatcher_type not in MOE_TOKEN_DISPATCHERS:
            raise ValueError(
                f"moe_token_dispatcher_type={self.moe_token_dispatcher_type!r}: expected one "
                f"of {MOE_TOKEN_DISPATCHERS}"
            )
        if self.moe_router_dtype not in MOE_ROUTER_DTYPES:
            raise ValueError(
                f"moe_router_dtype={self.moe_router_dtype!r}: expected one of {MOE_ROUTER_DTYPES}"
            )
        if self.moe_router_load_balancing_type not in MOE_LOAD_BALANCING_TYPES:
            raise ValueError(
                f"moe_router_load_balancing_type={self.moe_router_load_balancing_type!r}: "
                f"expected one of {MOE_LOAD_BALANCING_TYPES}"
            )
        balancing = self.moe_router_load_balancing_type != "none"
        if balancing != (self.moe_aux_loss_coeff > 0) or self.moe_aux_loss_coeff < 0:
            raise ValueError(
                f"moe_aux_loss_coeff={self.moe_aux_loss_coeff} with moe_router_load_balancing_"
                f"type={self.moe_router_load_balancing_type!r}: a balancing loss needs both a "
                "type and a coefficient > 0 (or neither)"
            )
        if self.moe_z_loss_coeff is not None and self.moe_z_loss_coeff <= 0:
            raise ValueError(f"moe_z_loss_coeff={self.moe_z_loss_coeff}: expected > 0 or None")

    @property
    def router_losses(self) -> bool:
        """Whether training adds a balancing or z-loss to the router's gradient."""
        return self.moe_router_load_balancing_type != "none" or self.moe_z_loss_coeff is not None

    def transformer_config_kwargs(self, arch: ModelArchitecture, grouped_gemm: bool) -> dict:
        """The TransformerConfig fields of `arch`'s experts ({} for a dense model)."""
        if not arch.is_moe:
            return {}
        return dict(
            num_moe_experts=arch.num_moe_experts,
            moe_router_topk=arch.moe_router_topk,
            moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
            moe_router_pre_softmax=arch.moe_router_pre_softmax,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type=self.moe_router_load_balancing_type,
            moe_aux_loss_coeff=self.moe_aux_loss_coeff,
            moe_z_loss_coeff=self.moe_z_loss_coeff,
            moe_token_dispatcher_type=self.moe_token_dispatcher_type,
            moe_router_dtype=self.moe_router_dtype,
            moe_grouped_gemm=grouped_gemm,
            moe_enable_routing_replay=self.routing_replay,
        )


def sequence_multiple(layout: ParallelLayout, precision: PrecisionConfig | None = None) -> int:
    """Sequence lengths must be multiples of this: TP size under sequence parallelism (the
    sequence is split over TP ranks), 16 with FP8 (TE's FP8 GEMM alignment)."""
    multiple = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
    if precision is not None and precision.fp8 is not None:
        multiple = math.lcm(multiple, 16)
    return multiple


def transformer_config(
    arch: ModelArchitecture,
    layout: ParallelLayout,
    precision: PrecisionConfig | None = None,
    recompute: RecomputeConfig | None = None,
    moe: MoEConfig | None = None,
    *,
    use_transformer_engine: bool | None = None,
):
    """The megatron-core TransformerConfig for `arch` under `layout`."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.transformer import TransformerConfig

    precision = precision or PrecisionConfig()
    precision.check_supported()
    on_gpu = torch.cuda.is_available()
    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    interleaved = layout.virtual_pipeline_model_parallel_size is not None
    # SwiGLU saving fc1's output alone (`models/swiglu.py`), through megatron's fused-activation
    # call; a MoE's experts would take megatron's compiled weighted kernel there instead
    fused_swiglu = not arch.is_moe and use_fused_swiglu()
    fp8 = {}
    if precision.fp8 is not None:
        fp8 = dict(
            fp8=precision.fp8,
            fp8_recipe=precision.fp8_recipe,
            fp8_amax_history_len=precision.fp8_amax_history_len,
            fp8_amax_compute_algo=precision.fp8_amax_compute_algo,
        )
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        # YaRN multiplies cos and sin by the attention factor, i.e. q.k by its square.
        softmax_scale=arch.rope_attention_factor**2 / math.sqrt(arch.head_dim)
        if arch.rope_attention_factor != 1.0
        else None,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_method_std,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        sequence_parallel=layout.sequence_parallel,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        params_dtype=precision.params_dtype,
        pipeline_dtype=precision.params_dtype,
        bf16=precision.bf16,
        use_cpu_initialization=not on_gpu,
        # Fusions need apex/TE/CUDA kernels; off keeps one code path on CPU and GPU alike.
        # The activation's is ours (above), on CPU and GPU alike.
        bias_activation_fusion=fused_swiglu,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Interleaved 1F1B with PP=2: the previous and next stage are the same peer, and the
        # batched p2p path posts [send_prev, recv_prev, send_next, recv_next], which pairs
        # activations with gradients of the same shape silently (reported upstream:
        # github.com/NVIDIA/Megatron-LM/issues/750 and /issues/1450).
        # Unbatched, overlapped p2p keeps forward and backward exchanges apart.
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=not interleaved,
        **fp8,
        **(recompute or RecomputeConfig()).transformer_config_kwargs(),
        **(moe or MoEConfig()).transformer_config_kwargs(arch, use_transformer_engine),
    )


CORE_ATTENTIONS = ("sdpa", "unfused")


def layer_spec(
    use_transformer_engine: bool | None = None,
    qk_layernorm: bool = False,
    num_experts: int | None = None,
    core_attention: str = "sdpa",
):
    """A transformer-layer ModuleSpec: TE's on GPU with TE, else the local one with RMSNorm
    (also as the per-head query/key norm when `qk_layernorm`, Qwen3). With `num_experts` the
    MLP is a MoE layer: TE's grouped GEMM experts, or the local `SequentialMLP`.

    The local spec's `core_attention`: "sdpa" (`models/attention.py`: PyTorch's flash or
    memory-efficient kernels, never an s x s tensor) or "unfused" (megatron-core's
    `DotProductAttention`, which materialises the scores: the reference the tests compare
    with)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.models.gpt import gpt_layer_specs

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    if use_transformer_engine:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=bool(num_experts), qk_layernorm=qk_layernorm
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, normalization="RMSNorm", qk_layernorm=qk_layernorm
    )
    if core_attention not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention={core_attention!r}: expected one of {CORE_ATTENTIONS}")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    if core_attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = RMSNorm
    return spec


def _scale_rope(model, arch: ModelArchitecture) -> None:
    """Frequencies of the scaled rope types, set before any forward (the rotary module caches
    what it computes).

    llama3: megatron-core's own `rope_scaling=True` hard-codes low/high frequency factors 1/4
    and an original context of 8192, so they are rescaled here with the config's factors.
    yarn: megatron-core's YarnRotaryEmbedding is CUDA-only, so its frequencies are computed
    here (`models.rope`) and its attention factor goes into the softmax scale.
    """
    rope = model.rotary_pos_emb
    if arch.rope_type == "llama3":
        rope.inv_freq = rope._apply_scaling(
            rope.inv_freq,
            factor=arch.rope_factor,
            low_freq_factor=arch.rope_low_freq_factor,
            high_freq_factor=arch.rope_high_freq_factor,
            original_max_position_embeddings=arch.rope_original_max_position_embeddings,
        )
    elif arch.rope_type == "yarn":
        inv_freq = yarn_inv_freq(
            arch.head_dim,
            arch.rope_theta,
            arch.rope_factor,
            arch.rope_original_max_position_embeddings,
            arch.rope_beta_fast,
            arch.rope_beta_slow,
            arch.rope_truncate,
        )
        rope.inv_freq = inv_freq.to(rope.inv_freq.device)


def _block_spec(config, layer, vp_stage: int | None, use_transformer_engine: bool):
    """The decoder block for this stage, with the final norm matching the layer spec."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    if use_transformer_engine:
        return layer  # megatron picks TENorm for the final norm itself
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm)


def build_gpt_model_chunks(
    arch: ModelArchitecture,
    layout: ParallelLayout,
    precision: PrecisionConfig | None = None,
    *,
    use_transformer_engine: bool | None = None,
    max_sequence_length: int | None = None,
    recompute: RecomputeConfig | None = None,
    moe: MoEConfig | None = None,
    core_attention: str = "sdpa",
) -> list:
    """This rank's GPTModel chunks (one per virtual pipeline stage, else a single one).

    Requires `megatron_rl.distributed.initialize` to have run. Weights are randomly initialised
    (deterministically from the seed); load real ones with `megatron_rl.models.hf_mapping`.
    """
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if use_transformer_engine is None:
        use_transformer_engine = transformer_engine_available()
    config = transformer_config(
        arch, layout, precision, recompute, moe, use_transformer_engine=use_transformer_engine
    )
    if config.fp8 and not use_transformer_engine:
        raise ValueError("fp8 needs the Transformer Engine layer spec (use_transformer_engine)")
    layer = layer_spec(
        use_transformer_engine, arch.qk_layernorm, arch.num_moe_experts or None, core_attention
    )
    use_rotate_half_rope()  # RoPE in three passes each way (`models/rotary.py`)
    use_plain_linear()  # F.linear where a projection communicates nothing (`models/linear.py`)
    use_lean_layer()  # a decoder layer's forward in the calls its maths needs (`models/layer.py`)
    vpp = layout.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        chunk = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(config, layer, vp_stage, use_transformer_engine),
            vocab_size=arch.padded_vocab_size(layout.tensor_model_parallel_size),
            max_sequence_length=max_sequence_length or arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            # HF's "linear" rope divides the frequencies by the factor: the same as dividing
            # the positions, which is what megatron-core's interpolation factor does.
            seq_len_interpolation_factor=arch.rope_factor if arch.rope_type == "linear" else None,
            vp_stage=vp_stage,
        )
        _scale_rope(chunk, arch)
        if arch.is_moe:
            _mark_experts(chunk, freeze_router=(moe or MoEConfig()).freeze_moe_router)
        if torch.cuda.is_available():
            chunk.cuda(torch.cuda.current_device())
        chunks.append(chunk)
    return chunks


def _mark_experts(chunk, freeze_router: bool) -> None:
    """Before DDP and the optimizer see them: every expert weight is an expert-parallel
    parameter (megatron's `allreduce=False`), at EP = 1 too, where megatron-core leaves it
    dense. Its gradient is then reduced over the expert-data-parallel group (at EP = 1 the
    data-parallel group itself) and it is stepped by the expert optimizer, so the optimizer is
    chained (dense, experts) at every EP size and a checkpoint saved at one EP resumes at
    another. A frozen router gets no gradient buffer and no update."""
    for name, param in chunk.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
        elif freeze_router and name.endswith("mlp.router.weight"):
            param.requires_grad_(False)


def layer_offset(model_chunk) -> int:
    """Global index of the chunk's first decoder layer (PP and virtual PP aware)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model_chunk.config, vp_stage=model_chunk.vp_stage)
