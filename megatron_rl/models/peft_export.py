"""A LoRA model's adapters as a PEFT adapter directory: `adapter_config.json` and
`adapter_model.safetensors`, which `peft.PeftModel.from_pretrained(base, dir)` loads onto the
base Hugging Face model (and vLLM serves as a `LoRARequest`).

Names are PEFT's: `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r]. A fused Megatron linear has one adapter (`models/lora.py`): its A is written for
each of its projections (q, k, v; gate, up) and its B split as the weight is, through the
same mapping as the weights (`hf_mapping.hf_tensors_from_megatron`), so the PEFT model
computes exactly what the fused one does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.gpt import layer_offset
from megatron_rl.models.hf_mapping import _all_gather, hf_tensors_from_megatron, unwrap
from megatron_rl.models.lora import LoRAConfig, lora_modules

ADAPTER_CONFIG = "adapter_config.json"
PEFT_ADAPTER = "adapter"
"""The adapter's directory inside a trainer's Hugging Face export (`hf/step_N/adapter`)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft_key(hf_weight: str, factor: str) -> str:
    return f"base_model.model.{hf_weight.removesuffix('.weight')}.{factor}.weight"


def peft_tensors(chunks: list, arch: ModelArchitecture) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, whole tensor) of every adapter of this rank's pipeline stage, the split
    factor gathered over TP (every TP rank yields the same)."""
    for chunk in chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        for _, name, m in lora_modules([model]):
            a, b = m.lora_A.detach(), m.lora_B.detach()
            column = "lora_B" in m.lora_axes
            split = _all_gather(b if column else a, m.tp_group)
            for hf, tensor in hf_tensors_from_megatron(
                f"{name}.weight", split, arch, offset
            ).items():
                yield _peft_key(hf, "lora_A"), a if column else tensor
                yield _peft_key(hf, "lora_B"), tensor if column else b


def adapter_config(lora: LoRAConfig, target_modules: list[str], base: str) -> dict:
    """PEFT's LoraConfig fields for `lora` (a causal LM's adapter)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def save_peft_adapter(
    chunks: list, arch: ModelArchitecture, lora: LoRAConfig, out_dir: Path, base: str
) -> None:
    """Write the actor's adapters into `out_dir` (existing, seen by every rank) as a PEFT
    adapter of the base model `base` (its path, recorded in the config). A collective: every
    rank calls it; rank 0 writes."""
    # why: safetensors' torch module is only needed here
    from megatron.core import parallel_state as ps
    from safetensors.torch import save_file

    mine = {k: t.to("cpu", copy=True).contiguous() for k, t in peft_tensors(chunks, arch)}
    writes = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    first = torch.distributed.get_rank() == 0
    stages = [None] * torch.distributed.get_world_size() if first else None
    torch.distributed.gather_object(mine if writes else {}, stages, dst=0)
    if first:
        tensors = {k: t for stage in stages for k, t in stage.items()}
        modules = {k.split(".")[-3] for k in tensors}
        out = Path(out_dir)
        save_file(dict(sorted(tensors.items())), str(out / ADAPTER_WEIGHTS))
        config = adapter_config(lora, sorted(modules), base)
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    torch.distributed.barrier()
