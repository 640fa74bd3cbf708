"""`RoleModel`: the model a Megatron role builds, the same keywords for Actor, ReferencePolicy
and Critic. What the roles do with it (optimizer, temperature, routing replay) stays in their
own constructors. Making one from a run's config is the trainer's business: workers sit below
the config in the layering."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import MoEConfig, PrecisionConfig, RecomputeConfig
from megatron_rl.models.lora import LoRAConfig
from megatron_rl.parallel.distributed import ParallelLayout


@dataclass(frozen=True)
class RoleModel:
    """The model of one role: its architecture, how it is sharded, where its weights come
    from and how it runs."""

    arch: ModelArchitecture
    """The transformer's shape (layers, heads, vocabulary, experts), read from a checkpoint."""
    layout: ParallelLayout
    """How the model is sharded: tensor, pipeline (virtual), expert and context parallel
    sizes."""
    model_path: str | Path | None = None
    """The checkpoint the weights load from (HF or Megatron, `models.source.ModelSource`);
    None leaves megatron-core's random initialisation."""
    precision: PrecisionConfig | None = None
    """Parameter dtype and FP8 GEMMs; None is `PrecisionConfig()`: fp32, no FP8."""
    recompute: RecomputeConfig | None = None
    """Activation recompute in the backward pass; None (or `RecomputeConfig()`) recomputes
    nothing. Trained roles only: a `ReferencePolicy` has no backward pass and refuses any
    other."""
    moe: MoEConfig | None = None
    """Routing and dispatch of a mixture-of-experts model; None is `MoEConfig()`'s defaults."""
    use_remove_padding: bool = False
    """Micro-batches run packed, their rows back to back with no padding (`data/packing.py`;
    verl's name); dense models only."""
    use_fused_kernels: bool = False
    """The log-prob head's forward sums compiled into one kernel a tile
    (`parallel/vocab_fused.tile_sums`; verl's name); a policy's only: a critic has no such
    head."""
    lora: LoRAConfig | None = None
    """LoRA adapters on the model's linears, every other weight frozen (`models/lora.py`);
    None (or rank 0) trains every weight."""
