"""Per-GPU memory of an RL step: actor + critic + reference model states, activations, and a
colocated vLLM engine. Pure arithmetic on the model shape: no torch, no process group.

Model states per parameter held by a GPU (mixed precision, megatron-core DDP with
`grad_reduce_in_fp32=True` as `megatron_rl.workers.optimizer` builds it):
    weights 2 B (bf16) + grads 4 B (fp32 buffer) + Adam 12 B (fp32 master, m, v),
the Adam part divided by DP under the distributed optimizer (ZeRO-1; Rajbhandari et al. 2020).
fp32 training (the CPU path) keeps weights 4 B, grads 4 B, Adam m and v 8 B.
Mixtures of experts: each rank holds experts / EP of every MoE layer's experts, each split
over expert-TP (ETP), and their Adam state is divided by the expert-data-parallel size,
GPUs / (ETP x EP x PP), instead of DP (megatron-core's chained expert optimizer).

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models"), itemised per tensor saved for backward by our layers rather than their
GPT-3 constant (34 sbh), because Qwen2 has SwiGLU and grouped-query attention:
  - `te` (GPU, Transformer Engine spec, flash attention): norm input and output of both
    LayerNormLinear blocks (4h), Q, K, V and the attention output (2q + 2kv), fc1 output (2f)
    and fc2 input (f); no s^2 term. FP8 stores GEMM inputs in 1 B.
  - `local` (megatron-core's local spec + torch RMSNorm + PyTorch's fused attention, what
    runs without TE, on CPU and on GPU): per norm its input, normalised x and output (3h,
    plus the rstd); Q and K after RoPE, the fused QKV output (V is a view of it), the
    attention's output and the context (3q + 3kv) and its fp32 log-sum-exp (a per token);
    fc1 output (2f), all the SwiGLU saves (`models/swiglu.py`), and its product, fc2's input
    (f); once, RoPE's cos and sin tables, shared by every layer.
    No s^2 term. Within 2% of saved-tensor hooks on a real actor (`tools/plan_memory.py
    --check-cpu`, tests/tools/test_memory_check_distributed.py).
h-sized tensors are split over TP only with sequence parallelism; head- and ffn-sized ones
always. A MoE layer (routing balanced: each rank's experts see as many token copies as it has
tokens times top-k) saves per token the router's fp32 logits and probabilities (2E), and per
routed copy the dispatched input (h), fc1's output (2I / ETP) and fc2's input (I / ETP); the
`local` profile the SwiGLU's three I-sized terms instead of fc2's input. 1F1B keeps min(PP, micro-batches) micro-batches in flight on the first stage; the
interleaved schedule L * (1 + (PP-1)/(PP*VPP)) layers' worth. Full recompute keeps each
layer's input and recomputes one layer at a time; selective recompute (megatron's
`core_attn`) drops the attention core's saved tensors but its inputs and output, which with
fused attention (no s x s scores) saves nothing.
The policy's last stage never holds the [micro-batch, seq, vocab/TP] logits: log-probs and
entropy are made a tile (tokens x vocabulary rows) at a time (`megatron_rl.parallel.vocab`);
it keeps the hidden states and the tiles' probabilities in the weight's dtype (none with
`logits_checkpointing`, which recomputes them in backward), and in backward one tile's fp32
logits, three tensors their size and the projection's fp32 gradient are alive at once
(`head_workspace_bytes`, in the plan's activations).

vLLM colocated: it takes `gpu_memory_utilization` of the GPU during generation (its weights,
then KV cache); in sleep mode (level 1) it holds nothing during training. Not modelled: the
hf engine (`rollout.name: hf`, for debugging), which holds a whole copy of the weights per
rank while generating and a KV cache that grows with batch x length, with no budget.

Offload (`offload`, keys of `MemoryPlan.states`): what a role keeps in host memory, or frees,
while vLLM generates (`actor/critic.param_offload`, `grad_offload`, `optimizer_offload`,
`actor.ref_param_offload`): the generation phase holds the rest of the states plus vLLM's
share. Training brings everything back, so the training phase does not change. TE's FP8
weight copies are workspaces, not parameters: they stay (`<role>_fp8_weight_copies`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.presets import (
    expert_layer_param_count,
    layer_param_count,
    lora_layer_param_count,
    param_count,
)
from megatron_rl.parallel.tiles import tile_shape
from megatron_rl.rollout.replica import RolloutLayout

GiB = 2**30
RECOMPUTE = (None, "selective", "full")
PROFILES = ("te", "local")
OFFLOADABLE = {
    "actor": ("weights", "grads", "optimizer"),
    "critic": ("weights", "grads", "optimizer"),
    "reference": ("weights",),
    "teacher": ("weights",),
}
"""The states each role can move off the device for generation (see `offload`)."""


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class MemoryPlanConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    data_parallel_size: int = 1
    sequence_parallel: bool = False
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """None: TP (megatron-core's default)."""
    use_distributed_optimizer: bool = True
    micro_batch_size: int = 1
    num_microbatches: int = 8
    """Micro-batches per optimizer step on one DP rank (bounds what 1F1B keeps in flight)."""
    seq_length: int = 4096
    """Prompt + response tokens of one sample."""
    max_tokens_per_micro_batch: int | None = None
    """With use_dynamic_bsz, the token budget (`ppo_max_token_len_per_gpu`): a micro-batch
    holds at most this many padded tokens, whatever its rows (micro_batch_size is then
    unused); per-token terms that grow with the length stay bounded by seq_length."""
    recompute_granularity: str | None = None
    """None, "selective" (attention core) or "full" (every layer, uniform, 1 layer a chunk)."""
    logits_checkpointing: bool = False
    """`actor.logits_checkpointing`: the policy's head keeps no probabilities for backward."""
    fp8: bool = False
    params_dtype: str = "bf16"
    """bf16 (GPU) or fp32 (the CPU path)."""
    profile: str = "te"
    """Saved-activation profile: "te" (GPU) or "local" (megatron local spec, CPU)."""
    critic: bool = True
    reference: bool = False
    """A reference policy for the KL term (VAPO has none)."""
    teacher: ModelArchitecture | None = None
    """On-policy distillation's teacher (`teacher.path`'s architecture, larger than the
    policy allowed): frozen weights, forward only, like the reference."""
    teacher_tensor_model_parallel_size: int | None = None
    """The teacher's own TP (`teacher.tensor_model_parallel_size`); None: the job's."""
    teacher_pipeline_model_parallel_size: int | None = None
    """The teacher's own PP; None: the job's."""
    lora_rank: int = 0
    """LoRA on the actor and the critic (`actor.lora.rank`, every linear but the experts):
    the base weights frozen (no gradient, no optimizer state), the adapters trained, the
    critic's value head too; the reference is the actor with its adapters off (no weights).
    0: full fine-tuning."""
    vllm_gpu_memory_utilization: float = 0.0
    """Fraction of the GPU vLLM takes while generating (0: no colocated engine)."""
    vllm_tensor_parallel_size: int | None = None
    vllm_sleep_mode: bool = True
    gpu_memory_gib: float = 80.0
    reserved_gib: float = 4.0
    """CUDA context, NCCL buffers, allocator fragmentation: never available to tensors."""
    offload: tuple[str, ...] = ()
    """States in host memory (or freed) while vLLM generates, by `MemoryPlan.states` key:
    actor_weights (actor.param_offload), actor_grads (grad_offload), actor_optimizer
    (optimizer_offload), the critic's alike, reference_weights (actor.ref_param_offload),
    teacher_weights (teacher.param_offload)."""

    def __post_init__(self) -> None:
        if self.recompute_granularity not in RECOMPUTE:
            raise PlanError(
                f"recompute_granularity={self.recompute_granularity!r}: expected one of {RECOMPUTE}"
            )
        if self.profile not in PROFILES:
            raise PlanError(f"profile={self.profile!r}: expected one of {PROFILES}")
        if self.params_dtype not in ("bf16", "fp32"):
            raise PlanError(f"params_dtype={self.params_dtype!r}: expected bf16 or fp32")
        if self.fp8 and self.params_dtype != "bf16":
            raise PlanError("fp8 needs params_dtype=bf16")
        if not 0.0 <= self.vllm_gpu_memory_utilization < 1.0:
            raise PlanError(
                f"vllm_gpu_memory_utilization={self.vllm_gpu_memory_utilization}: expected "
                "a fraction in [0, 1)"
            )
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "data_parallel_size", "micro_batch_size", "num_microbatches",
                     "seq_length"):  # fmt: skip
            if getattr(self, name) < 1:
                raise PlanError(f"{name}={getattr(self, name)}: expected a positive integer")
        if self.max_tokens_per_micro_batch is not None and (
            self.max_tokens_per_micro_batch < self.seq_length
        ):
            raise PlanError(
                f"max_tokens_per_micro_batch={self.max_tokens_per_micro_batch} is below "
                f"seq_length={self.seq_length}: one sequence must fit a micro-batch"
            )
        self._check_offload()
        if self.vllm_tensor_parallel_size is not None:
            tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
            try:  # an engine across two model replicas is refused by the trainer too
                RolloutLayout(
                    tp * pp * self.data_parallel_size, tp, pp, self.vllm_tensor_parallel_size
                ).check()
            except ValueError as e:
                raise PlanError(str(e)) from None

    def _check_offload(self) -> None:
        known = [f"{r}_{k}" for r, kinds in OFFLOADABLE.items() for k in kinds]
        for key in self.offload:
            if key not in known:
                raise PlanError(f"offload {key!r}: expected some of {known}")
            role = key.split("_")[0]
            if role != "actor" and not getattr(self, role):
                raise PlanError(f"offload {key!r}: the plan has no {role} ({role}=False)")
            if key.endswith("_optimizer") and self.params_dtype == "fp32":
                raise PlanError(
                    f"offload {key!r} needs params_dtype=bf16: with fp32 parameters megatron's "
                    "optimizer steps the model's own weights"
                )

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens of the largest micro-batch."""
        return self.max_tokens_per_micro_batch or self.micro_batch_size * self.seq_length

    @property
    def num_gpus(self) -> int:
        return (
            self.tensor_model_parallel_size
            * self.pipeline_model_parallel_size
            * self.data_parallel_size
        )

    @property
    def expert_tensor_size(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_data_parallel_size(self) -> int:
        """Ranks holding the same experts: what shards their optimizer state."""
        grid = self.expert_tensor_size * self.expert_model_parallel_size
        return self.num_gpus // (grid * self.pipeline_model_parallel_size)


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per GPU on the busiest pipeline stage."""

    config: MemoryPlanConfig
    params_per_gpu: dict[str, int]
    """Per role, experts included."""
    states: dict[str, int]
    """Per role: weights, grads, optimizer (bytes)."""
    activations: dict[str, int]
    """Per trained role: peak activation bytes during its update."""
    vllm_bytes: int
    vllm_kv_cache_bytes: int
    vllm_kv_cache_tokens: int
    notes: list[str] = field(default_factory=list)

    @property
    def states_bytes(self) -> int:
        return sum(self.states.values())

    @property
    def train_bytes(self) -> int:
        """Training one role at a time: all states resident + the larger activation peak."""
        vllm = 0 if self.config.vllm_sleep_mode else self.vllm_bytes
        return self.states_bytes + max(self.activations.values(), default=0) + vllm

    @property
    def offloaded_bytes(self) -> int:
        """States away from the device while vLLM generates (`MemoryPlanConfig.offload`)."""
        return sum(self.states[k] for k in self.config.offload)

    @property
    def rewind_host_bytes(self) -> int:
        """Host memory of the copy that lets a stop request rewind a step's updates
        (`trainer.rewindable_update`, `workers/rewind.py`): each trained role's weights and
        optimizer state (masters and moments, its shard with the distributed optimizer).
        With LoRA the trained weights are the adapters alone: as many as their fp32
        gradients' elements."""
        total = 0
        for role in ("actor", "critic"):
            weights = self.states.get(f"{role}_weights", 0)
            if self.config.lora_rank:
                weights = self.states.get(f"{role}_grads", 0) // 4 * _bytes_per_element(self.config)
            total += weights + self.states.get(f"{role}_optimizer", 0)
        return total

    @property
    def rollout_bytes(self) -> int:
        """Generation: the states still on the device plus vLLM's share."""
        return self.states_bytes - self.offloaded_bytes + self.vllm_bytes

    @property
    def peak_bytes(self) -> int:
        return max(self.train_bytes, self.rollout_bytes)

    @property
    def usable_bytes(self) -> int:
        return int((self.config.gpu_memory_gib - self.config.reserved_gib) * GiB)

    @property
    def margin_bytes(self) -> int:
        """Usable memory left at the peak (negative: short by that much)."""
        return self.usable_bytes - self.peak_bytes

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.usable_bytes and self.vllm_kv_cache_bytes >= 0


def stage_expert_params(arch: ModelArchitecture, c: MemoryPlanConfig) -> int:
    """Expert parameters one GPU holds on a pipeline stage (0 for a dense model)."""
    per_layer = expert_layer_param_count(arch, c.expert_tensor_size, c.expert_model_parallel_size)
    return arch.num_layers // c.pipeline_model_parallel_size * per_layer


def stage_params(arch: ModelArchitecture, c: MemoryPlanConfig, role: str) -> int:
    """Parameters one GPU holds on the largest pipeline stage (role: actor/critic/reference),
    experts apart (`stage_expert_params`)."""
    tp, pp, h = c.tensor_model_parallel_size, c.pipeline_model_parallel_size, arch.hidden_size
    layers = arch.num_layers // pp * layer_param_count(arch, tp)
    embedding = arch.padded_vocab_size(tp) * h // tp
    # The critic's head is [1, h]; the policy's output layer is the vocabulary (a tied one is
    # still held by the last stage when it is not also the first).
    if role == "critic":
        head = h
    elif arch.tie_word_embeddings and pp == 1:
        head = 0
    else:
        head = embedding
    first, last = layers + embedding, layers + head + h
    return first + head + h if pp == 1 else max(first, last)


def _bytes_per_element(c: MemoryPlanConfig) -> int:
    return 2 if c.params_dtype == "bf16" else 4


def model_state_bytes(
    params: int, c: MemoryPlanConfig, trainable: bool, expert_params: int = 0
) -> dict[str, int]:
    """Weights, grads and optimizer state of `params` dense and `expert_params` expert
    parameters (their optimizer state sharded over expert-data-parallel ranks)."""
    total = params + expert_params
    out = {"weights": total * _bytes_per_element(c)}
    if c.fp8:
        out["fp8_weight_copies"] = total * 2  # TE's FP8 copy of each GEMM weight, transposed
    if trainable:
        optimizer = 12 if c.params_dtype == "bf16" else 8
        dense, experts = (
            (c.data_parallel_size, c.expert_data_parallel_size)
            if c.use_distributed_optimizer
            else (1, 1)
        )
        out["grads"] = total * 4
        out["optimizer"] = -(-params * optimizer // dense) - (-expert_params * optimizer // experts)
    return out


def lora_state_bytes(
    arch: ModelArchitecture, c: MemoryPlanConfig, role: str, params: int, expert_params: int
) -> dict[str, int]:
    """A LoRA role's states: the frozen base as weights alone, the adapters (and a critic's
    value head) as weights + fp32 gradients + optimizer state. Activations are priced as
    full fine-tuning's: each adapter needs the input its base would save."""
    tp = c.tensor_model_parallel_size
    layers = arch.num_layers // c.pipeline_model_parallel_size
    adapters = layers * lora_layer_param_count(arch, c.lora_rank, tp)
    if role == "critic":
        adapters += arch.hidden_size
    base = model_state_bytes(params, c, False, expert_params)
    trained = model_state_bytes(adapters, c, True)
    return {
        f"{role}_weights": base["weights"] + trained["weights"],
        **{f"{role}_{k}": v for k, v in base.items() if k != "weights"},
        f"{role}_grads": trained["grads"],
        f"{role}_optimizer": trained["optimizer"],
    }


def layer_activation_elements(arch: ModelArchitecture, c: MemoryPlanConfig) -> dict[str, float]:
    """Saved-for-backward elements per token of one transformer layer, by kind (no recompute;
    selective recompute's attention core is left out here and added back one layer at a time
    by `activation_bytes`)."""
    tp = c.tensor_model_parallel_size
    sp = tp if c.sequence_parallel else 1
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    if arch.is_moe:
        return _moe_layer_activation_elements(arch, c, sp, q, kv)
    if c.profile == "te":
        return {
            "norms": 2 * h / sp,  # LayerNormLinear input (layer input / residual)
            "gemm_inputs": 2 * h / sp + f / tp,  # normalised x for QKV and fc1, fc2 input
            "attention": (2 * q + 2 * kv) / tp,  # Q, K, V, output (flash attention)
            "mlp": 2 * f / tp,  # fc1 output for the SwiGLU backward
        }
    return {
        "norms": (6 * h + 2) / sp,  # per norm: input, rstd, x * rstd, output
        "attention": _local_attention_elements(arch, c),
        "mlp": 3 * f / tp,  # fc1 output 2f (the SwiGLU's input), its product f
    }


def _moe_layer_activation_elements(arch, c, sp, q, kv) -> dict[str, float]:
    """A MoE layer's saved elements per token (see the module docstring); the router's fp32
    logits and probabilities (2E) are fp32 whatever the layer's element width."""
    tp, k = c.tensor_model_parallel_size, arch.moe_router_topk
    h, i, e = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_moe_experts
    fp32 = 4 / _bytes_per_element(c)  # the router's tensors are fp32 whatever the dtype
    router = 2 * e * fp32 / sp
    if c.profile == "te":
        return {
            "norms": 2 * h / sp,  # the two norms' inputs
            "gemm_inputs": 2 * h / sp + k * (h + i / c.expert_tensor_size),  # QKV, fc1, fc2
            "attention": (2 * q + 2 * kv) / tp,
            "mlp": router + k * 2 * i / c.expert_tensor_size,  # fc1 output
        }
    return {
        "norms": (6 * h + 2) / sp,
        "attention": _local_attention_elements(arch, c),
        "mlp": router + k * (h + 5 * i / c.expert_tensor_size),  # input, fc1, SwiGLU terms
    }


def _attention_core_inputs(arch: ModelArchitecture, c: MemoryPlanConfig) -> float:
    """`local`: Q and K after RoPE, and the fused QKV output (V is a view of it)."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_query_groups * arch.head_dim
    return (2 * q + 3 * kv) / c.tensor_model_parallel_size


def _attention_core_elements(arch: ModelArchitecture, c: MemoryPlanConfig) -> float:
    """What PyTorch's fused attention (`models/attention.py`) saves beyond its inputs: its
    output (the projection's input, the same storage) and each head's fp32 log-sum-exp; no
    s x s term."""
    q = arch.num_attention_heads * arch.head_dim
    lse = arch.num_attention_heads * 4 / _bytes_per_element(c)
    return (q + lse) / c.tensor_model_parallel_size


def _local_attention_elements(arch: ModelArchitecture, c: MemoryPlanConfig) -> float:
    """`local`, per token of a layer. Selective recompute keeps the core's inputs and its
    output (the projection's input, a storage of its own then) and recomputes the rest."""
    inputs = _attention_core_inputs(arch, c)
    if c.recompute_granularity == "selective":
        return inputs + arch.num_attention_heads * arch.head_dim / c.tensor_model_parallel_size
    return inputs + _attention_core_elements(arch, c)


def rope_table_bytes(arch: ModelArchitecture, c: MemoryPlanConfig) -> int:
    """`local` only: RoPE's cos and sin [s, d] in the activations' dtype, made once and
    shared by every layer and micro-batch (`models/rotary.py`)."""
    if c.profile == "te":
        return 0
    return 2 * c.seq_length * arch.head_dim * _bytes_per_element(c)


def layer_activation_bytes(arch: ModelArchitecture, c: MemoryPlanConfig) -> float:
    """Bytes one layer saves for one micro-batch."""
    items = layer_activation_elements(arch, c)
    width = _bytes_per_element(c)
    tokens = c.micro_batch_tokens
    total = sum(items.values()) * width
    if c.fp8 and "gemm_inputs" in items:
        total -= items["gemm_inputs"] * (width - 1)  # FP8 copies of GEMM inputs
    return total * tokens


def layers_in_flight(arch: ModelArchitecture, c: MemoryPlanConfig) -> float:
    """Layer-micro-batches whose activations the first pipeline stage holds at its peak."""
    pp, vpp = c.pipeline_model_parallel_size, c.virtual_pipeline_model_parallel_size
    if pp == 1:
        return arch.num_layers
    if vpp is None:
        return arch.num_layers // pp * min(pp, c.num_microbatches)
    m = min((pp - 1) * 2 + (vpp - 1) * pp + 1, c.num_microbatches * vpp)
    return arch.num_layers // (pp * vpp) * m


def head_bytes(arch: ModelArchitecture, c: MemoryPlanConfig, role: str) -> int:
    """Last stage: the final norm, the head's input (the whole sequence's hidden states),
    and for the policy what the chunked log-probs keep for backward besides
    (`parallel.vocab.chunked_logprobs_entropy`): the labels (int64) and each token's fp32
    log-sum-exp and entropy, and without `logits_checkpointing` its probabilities over this
    rank's real vocabulary rows in the weight's dtype (and each block of rows' fp32 max);
    never the logits (`head_workspace_bytes`)."""
    tp = c.tensor_model_parallel_size
    sp = tp if c.sequence_parallel else 1
    tokens = c.micro_batch_tokens
    h = arch.hidden_size
    width = _bytes_per_element(c)
    # `local`: the norm keeps its input, rstd and x * rstd; the head (log-probs or value)
    # keeps the norm's output as its input, or with sequence parallelism the gathered copy
    # (h per token; then nothing keeps the norm's own output)
    if c.profile == "te":
        norm, hidden = 2 * h / sp, h
    elif sp > 1:
        norm, hidden = (2 * h + 1) / sp, h
    else:
        norm, hidden = 3 * h + 1, 0
    policy = 8 + 2 * 4 if role != "critic" else 0  # labels (int64), log-sum-exp, entropy
    if role != "critic" and not c.logits_checkpointing:
        # the real rows of the first rank, which holds the most (padding is at the end)
        rows = min(arch.padded_vocab_size(tp) // tp, arch.vocab_size)
        policy += rows * width + 4 * -(-rows // tile_shape(tokens, rows)[1])
    return int(tokens * ((norm + hidden) * width + policy))


def head_workspace_bytes(arch: ModelArchitecture, c: MemoryPlanConfig, role: str) -> int:
    """The policy's transient at its last stage's backward (`parallel.vocab`): one tile of
    fp32 logits and the three tensors of its size made from them (probabilities, their log,
    the gradient), with several blocks of rows in bf16 the fp32 sum of the hidden states'
    gradient for one block of tokens, and the projection's fp32 gradient [V/tp, h] (unless
    frozen under LoRA), rounded to the weight's dtype once the tiles are done (a copy of its
    own in bf16). A tile is `parallel.tiles.tile_shape`'s."""
    if role == "critic":
        return 0
    local_vocab = (
        arch.padded_vocab_size(c.tensor_model_parallel_size) // c.tensor_model_parallel_size
    )
    tokens, rows = tile_shape(c.micro_batch_tokens, local_vocab)
    tokens = min(tokens, c.micro_batch_tokens)
    h, width = arch.hidden_size, _bytes_per_element(c)
    tiles = 4 * 4 * tokens * rows
    if rows < local_vocab and width < 4:
        tiles += 4 * tokens * h
    if c.lora_rank:
        return tiles
    rounded = local_vocab * h * width if width < 4 else 0
    return 4 * local_vocab * h + max(tiles, rounded)


def activation_bytes(arch: ModelArchitecture, c: MemoryPlanConfig, role: str) -> int:
    """Peak activation bytes of one role's forward-backward on its busiest stage."""
    sp = c.tensor_model_parallel_size if c.sequence_parallel else 1
    tokens = c.micro_batch_tokens
    stored = layer_activation_bytes(arch, c)  # what a layer keeps until its backward
    recompute = 0  # what one layer saves again while it is recomputed in backward
    if c.recompute_granularity == "full":
        stored = arch.hidden_size / sp * tokens * _bytes_per_element(c)
        recompute = layer_activation_bytes(arch, c)
    elif c.recompute_granularity == "selective" and c.profile == "local":
        # one layer's core recomputed in backward saves its inputs again, and what it keeps
        core = _attention_core_inputs(arch, c) + _attention_core_elements(arch, c)
        recompute = core * tokens * _bytes_per_element(c)
    head = head_bytes(arch, c, role)
    first = layers_in_flight(arch, c) * stored + recompute + rope_table_bytes(arch, c)
    if c.pipeline_model_parallel_size == 1:
        return int(first + head)
    # The last stage runs each micro-batch's backward right after its forward: one in flight.
    last = arch.num_layers // c.pipeline_model_parallel_size * stored + recompute + head
    return int(max(first, last + rope_table_bytes(arch, c)))


def teacher_layout(c: MemoryPlanConfig) -> MemoryPlanConfig:
    """The plan as the teacher is sharded: the job's layout, or its own TP / PP over the same
    GPUs (no virtual pipeline, no expert parallelism: `TeacherConfig.layout`)."""
    tp = c.teacher_tensor_model_parallel_size or c.tensor_model_parallel_size
    pp = c.teacher_pipeline_model_parallel_size or c.pipeline_model_parallel_size
    if (tp, pp) == (c.tensor_model_parallel_size, c.pipeline_model_parallel_size):
        return c
    if c.num_gpus % (tp * pp):
        raise PlanError(
            f"the teacher: {c.num_gpus} GPUs are not divisible by its TP x PP = {tp} x {pp}"
        )
    return replace(
        c,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        data_parallel_size=c.num_gpus // (tp * pp),
        virtual_pipeline_model_parallel_size=None,
        sequence_parallel=c.sequence_parallel and tp > 1,
        expert_model_parallel_size=1,
        expert_tensor_parallel_size=None,
        vllm_tensor_parallel_size=None,
    )


def plan_memory(arch: ModelArchitecture, c: MemoryPlanConfig) -> MemoryPlan:
    """The per-GPU plan of `c`; where it does not fit, a note names the least costly of
    the activation settings the run could add (`LEANER`) with which it would."""
    plan = _plan(arch, c)
    if not plan.fits:
        plan.notes.extend(_leaner_note(arch, c, plan))
    return plan


LEANER = ((None, True), ("selective", False), ("selective", True), ("full", False), ("full", True))
"""(recompute_granularity, logits_checkpointing) pairs that trade compute for activation
memory, least compute first: the head's logits recomputed (one GEMM of the head), the
attention core recomputed, every layer."""


def _leaner_note(arch: ModelArchitecture, c: MemoryPlanConfig, plan: MemoryPlan) -> list[str]:
    """[the first of `LEANER` with which `c` fits, as the run's config keys], or []."""
    for recompute, logits in LEANER:
        leaner = replace(  # never less than the run already recomputes
            c,
            recompute_granularity=max(c.recompute_granularity, recompute, key=RECOMPUTE.index),
            logits_checkpointing=c.logits_checkpointing or logits,
        )
        if leaner == c or not (lean := _plan(arch, leaner)).fits:
            continue
        settings = []
        if leaner.recompute_granularity != c.recompute_granularity:
            settings.append(f"model.recompute.granularity: {leaner.recompute_granularity}")
        if leaner.logits_checkpointing != c.logits_checkpointing:
            settings.append("actor.logits_checkpointing: true")
        return [
            f"with {' and '.join(settings)} the plan fits: training "
            f"{lean.train_bytes / GiB:.1f} GiB "
            f"({(plan.train_bytes - lean.train_bytes) / GiB:.1f} GiB less)"
        ]
    return []


def _plan(arch: ModelArchitecture, c: MemoryPlanConfig) -> MemoryPlan:
    tp, pp = c.tensor_model_parallel_size, c.pipeline_model_parallel_size
    ep, etp = c.expert_model_parallel_size, c.expert_tensor_size
    if not arch.is_moe and (ep > 1 or c.expert_tensor_parallel_size):
        raise PlanError("expert_model_parallel_size / expert_tensor_parallel_size need a MoE model")
    if c.num_gpus % (etp * ep * pp):
        raise PlanError(
            f"{c.num_gpus} GPUs are not divisible by ETP x EP x PP = {etp} x {ep} x {pp}"
        )
    arch.check_divisible(tp, pp * (c.virtual_pipeline_model_parallel_size or 1), etp, ep)
    # A LoRA actor's reference is its own base with the adapters off: no weights of its own.
    reference = c.reference and not c.lora_rank
    roles = ["actor"] + (["critic"] if c.critic else []) + (["reference"] if reference else [])
    experts = stage_expert_params(arch, c)
    params = {r: stage_params(arch, c, r) for r in roles}
    states = {}
    for role in roles:
        trainable = role != "reference"
        if c.lora_rank and trainable:
            states.update(lora_state_bytes(arch, c, role, params[role], experts))
            continue
        for kind, n in model_state_bytes(params[role], c, trainable, experts).items():
            states[f"{role}_{kind}"] = n
    params = {r: n + experts for r, n in params.items()}
    if c.teacher is not None:  # frozen: its weights alone, sharded by its own layout
        t = teacher_layout(c)
        try:
            c.teacher.check_divisible(
                t.tensor_model_parallel_size,
                t.pipeline_model_parallel_size * (t.virtual_pipeline_model_parallel_size or 1),
                t.expert_tensor_size,
                t.expert_model_parallel_size,
            )
        except ValueError as e:
            raise PlanError(f"the teacher: {e}") from None
        teacher_experts = stage_expert_params(c.teacher, t)
        params["teacher"] = stage_params(c.teacher, t, "reference")
        for kind, n in model_state_bytes(params["teacher"], t, False, teacher_experts).items():
            states[f"teacher_{kind}"] = n
        params["teacher"] += teacher_experts
    activations = {
        r: activation_bytes(arch, c, r) + head_workspace_bytes(arch, c, r)
        for r in roles
        if r != "reference"
    }

    notes = []
    vllm = kv_cache = kv_tokens = 0
    if c.vllm_gpu_memory_utilization > 0:
        vtp = c.vllm_tensor_parallel_size or tp
        vllm = int(c.vllm_gpu_memory_utilization * c.gpu_memory_gib * GiB)
        vllm_weights = param_count(arch) * 2 // vtp
        kv_cache = vllm - vllm_weights - 2 * GiB  # vLLM's profiled activation peak, roughly
        kv_heads = max(arch.num_query_groups // vtp, 1)
        per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * 2
        kv_tokens = max(kv_cache, 0) // per_token
        if kv_cache < 0:
            notes.append(
                f"vLLM's {c.vllm_gpu_memory_utilization:.2f} of the GPU does not hold its "
                f"{vllm_weights / GiB:.1f} GiB of weights plus 2 GiB working memory: raise "
                "gpu_memory_utilization or vLLM's TP"
            )
    return MemoryPlan(c, params, states, activations, vllm, kv_cache, kv_tokens, notes)


def summary_row(plan: MemoryPlan) -> dict[str, object]:
    """One table row, GiB rounded to 0.1."""
    c = plan.config

    def gib(n: float) -> float:
        return round(n / GiB, 1)

    layout = f"TP{c.tensor_model_parallel_size}PP{c.pipeline_model_parallel_size}"
    if c.virtual_pipeline_model_parallel_size:
        layout += f"VPP{c.virtual_pipeline_model_parallel_size}"
    layout += f"DP{c.data_parallel_size}" + ("SP" if c.sequence_parallel else "")
    if c.expert_model_parallel_size > 1 or c.expert_tensor_parallel_size:
        layout += f"EP{c.expert_model_parallel_size}ETP{c.expert_tensor_size}"
    row = {
        "layout": layout,
        "gpus": c.num_gpus,
        "recompute": c.recompute_granularity or "none",
        "fp8": c.fp8,
        "dist_opt": c.use_distributed_optimizer,
    }
    for role in ("actor", "critic", "reference", "teacher"):
        n = sum(v for k, v in plan.states.items() if k.startswith(role + "_"))
        if n:
            row[f"{role}_states_gib"] = gib(n)
    row["activations_gib"] = gib(max(plan.activations.values(), default=0))
    row["vllm_gib"] = gib(plan.vllm_bytes)
    row["vllm_kv_tokens"] = plan.vllm_kv_cache_tokens
    row["offloaded_gib"] = gib(plan.offloaded_bytes)
    row["train_gib"] = gib(plan.train_bytes)
    row["rollout_gib"] = gib(plan.rollout_bytes)
    row["peak_gib"] = gib(plan.peak_bytes)
    row["margin_gib"] = gib(plan.margin_bytes)
    row["fits"] = plan.fits
    row["rewind_host_gib"] = gib(plan.rewind_host_bytes)
    return row
