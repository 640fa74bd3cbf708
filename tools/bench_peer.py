"""The peer of `tools.bench train_step`: a plain Hugging Face training step, as a TRL or
OpenRLHF user runs one on one device.

transformers' model of the same preset (random weights), `attn_implementation="sdpa"`, torch's
AdamW with `fused=True`, the causal-LM loss over the response tokens of the same batch, one
backward per micro-batch and one optimizer step. Precision: "fp32", "mixed" (fp32 parameters,
bf16 autocast: what `accelerate --mixed_precision bf16` does) or "bf16" (bf16 parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.presets import PRESETS

PEER_PRECISIONS = ("fp32", "mixed", "bf16")


def peer_model(preset: str, precision: str, device: torch.device):
    """transformers' causal LM of `preset`, SDPA attention, on `device`."""
    if precision not in PEER_PRECISIONS:
        raise ValueError(f"peer precision={precision!r}: expected one of {PEER_PRECISIONS}")
    # why: transformers takes seconds to import: only the peer arm needs it
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(PRESETS[preset])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.to(device).train()


def peer_step(
    preset: str, precision: str, batch: TrainingBatch, num_microbatches: int
) -> Callable[[], float]:
    """A function running one peer training step on `batch` (on its device); returns the
    step's loss."""
    device = batch.input_ids.device
    model = peer_model(preset, precision, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    micro = batch.split(num_microbatches)
    response_tokens = batch.response_mask[:, 1:].sum()

    def step() -> float:
        total = 0.0
        for mb in micro:
            labels = mb.input_ids.masked_fill(mb.response_mask == 0, -100)
            with torch.autocast(device.type, torch.bfloat16, enabled=precision == "mixed"):
                # transformers' causal-LM loss, token-level over the whole step's responses
                loss = model(
                    input_ids=mb.input_ids, labels=labels, num_items_in_batch=response_tokens
                ).loss
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return total

    return step
