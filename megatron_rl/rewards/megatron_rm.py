"""A reward model run as a Megatron GPT with a scalar head, inside the torchrun world.

For reward models too large for one device: the HF sequence-classification checkpoint is
loaded like a critic (transformer weights + `score.weight` as the value head) and sharded
with the trainer's TP/PP. It reads text rendered by its own tokenizer's chat template, like
`HFRewardModel`. Every rank of a model-parallel group must call it with the same batch, so it
runs in the inline pool only (never in a Ray worker).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.critic import build_critic_chunks, load_value_head
from megatron_rl.models.gpt import PrecisionConfig
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import HFCheckpointReader, load_hf_into_megatron
from megatron_rl.parallel.distributed import ParallelLayout
from megatron_rl.rewards.reward_model import HFRewardModel
from megatron_rl.workers.roles import MegatronRole


def current_layout():
    """The TP/PP layout megatron-core was initialised with (the RM shares the trainer's)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "reward model backend 'megatron' scores inside the torchrun world: call "
            "megatron_rl.distributed.initialize first (or use backend: hf)"
        )
    return ParallelLayout(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )


class MegatronRewardModel(HFRewardModel):
    """Same rendering and interface as `HFRewardModel`; the forward pass is Megatron's."""

    def _load_model(self, model_dir: str | Path, dtype: str) -> None:
        arch = read_hf_config(model_dir)
        layout = current_layout()
        precision = PrecisionConfig(params_dtype=getattr(torch, dtype))
        chunks = build_critic_chunks(arch, layout, precision)
        reader = HFCheckpointReader(model_dir)
        load_hf_into_megatron(chunks, reader, arch, skip={"output_layer.weight"})
        load_value_head(chunks, reader)
        self.role = MegatronRole(arch=arch, layout=layout, chunks=chunks, precision=precision)

    @torch.no_grad()
    def score_token_ids(self, ids: list[list[int]]) -> list[float]:
        width = max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id or 0
        tokens = torch.full((len(ids), width), pad, dtype=torch.long, device="cpu")
        for row, x in enumerate(ids):  # right padding: causal attention never looks at it
            tokens[row, : len(x)] = torch.tensor(x, device="cpu")
        tokens = tokens.to(next(self.role.chunks[0].parameters()).device)
        batch = TrainingBatch(
            input_ids=tokens, response_mask=torch.zeros_like(tokens, dtype=torch.float)
        )
        values = self.role.forward_collect(batch, 1, lambda mb, out: out[:, :, 0].float())
        last = torch.tensor([len(x) - 1 for x in ids], device=values.device)
        return values[torch.arange(len(ids), device=values.device), last].cpu().tolist()
