"""Where a role's starting weights come from: `model.path` / `model.critic_path` name either a
Hugging Face directory or a megatron_rl checkpoint — one converted by
`checkpoints_convert.hf_to_megatron`, or a role directory of a training checkpoint
(`output_dir/checkpoints/step_N/actor`). A Megatron checkpoint loads at any TP/PP layout
without converting again (megatron's sharded tensors reshard on load); its `hf_meta/` holds
the config and tokenizer the rest of the run (tokenizer, vLLM) reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.critic import load_value_head
from megatron_rl.models.dist_checkpoint import HF_META_SUBDIR, METADATA, load_role, read_metadata
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import HFCheckpointReader, load_hf_into_megatron
from megatron_rl.models.lora import LORA_METADATA, LoRAConfig, apply_lora, merge_and_unload

VALUE_HEAD = "output_layer.weight"
"""A critic chunk's value head; a policy's vocabulary projection under the same name."""


@dataclass(frozen=True)
class ModelSource:
    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    @property
    def is_megatron(self) -> bool:
        return (self.path / METADATA).exists()

    @property
    def hf_dir(self) -> Path:
        """The directory with the Hugging Face config and tokenizer."""
        return self.path / HF_META_SUBDIR if self.is_megatron else self.path

    @property
    def saved_role(self) -> str | None:
        """ "actor" or "critic" for a Megatron checkpoint; None for a Hugging Face model."""
        return read_metadata(self.path)[0]["role"] if self.is_megatron else None

    def architecture(self) -> ModelArchitecture:
        if self.is_megatron:
            return read_metadata(self.path)[1]
        return read_hf_config(self.path)

    @property
    def lora(self) -> dict | None:
        """The adapters' settings of a LoRA training checkpoint (it holds them alone, its
        base is its `source`); None for any other."""
        return read_metadata(self.path)[0].get(LORA_METADATA) if self.is_megatron else None

    def load_policy(self, chunks: list, arch: ModelArchitecture) -> None:
        """Policy weights (actor, reference) into this rank's GPT chunks; a LoRA
        checkpoint's merged into its base."""
        if not self.is_megatron:
            return load_hf_into_megatron(chunks, self.path, arch)
        if self.saved_role == "critic":
            raise ValueError(
                f"{self.path} is a critic checkpoint (a value head, no vocabulary projection): "
                "it cannot start a policy; give the actor's checkpoint or its HF model"
            )
        if self.lora:
            return self._load_merged(chunks, lambda base: base.load_policy(chunks, arch))
        load_role(chunks, None, self.path)

    def load_critic(self, chunks: list, arch: ModelArchitecture) -> None:
        """Critic weights into this rank's critic chunks: a critic checkpoint (value head
        included), a reward model's HF directory (its `score.weight` is the value head), or a
        policy's weights (HF or Megatron; the value head keeps its small random init)."""
        if self.is_megatron and self.lora:
            skip = () if self.saved_role == "critic" else (VALUE_HEAD,)
            return self._load_merged(chunks, lambda base: base.load_critic(chunks, arch), skip=skip)
        if self.is_megatron:
            skip = () if self.saved_role == "critic" else (VALUE_HEAD,)
            return load_role(chunks, None, self.path, skip=skip)

        reader = HFCheckpointReader(self.path)
        load_hf_into_megatron(chunks, reader, arch, skip={VALUE_HEAD})
        if "score.weight" in reader.keys():  # a reward model: its score head is the value head
            load_value_head(chunks, reader)

    def _load_merged(self, chunks: list, load_base, skip: tuple[str, ...] = ()) -> None:
        """A LoRA checkpoint: its base (the `source` it was trained from) through
        `load_base(ModelSource)`, its adapters on top, then folded into the weights."""
        meta = read_metadata(self.path)[0]
        base = Path(meta["source"])
        if not base.exists():
            raise FileNotFoundError(
                f"{self.path} holds LoRA adapters of the base model {base}, which is not "
                "there (relative paths are from the training run's directory)"
            )
        load_base(ModelSource(base))
        trains = [p.requires_grad for chunk in chunks for p in chunk.parameters()]
        lora = LoRAConfig.from_dict(meta[LORA_METADATA])
        apply_lora(chunks, lora)
        if skip:  # a policy's adapters into a critic: its value head stays as initialised
            for chunk in chunks:
                for name, p in chunk.named_parameters():
                    if name in skip:
                        p.requires_grad_(False)
        load_role(chunks, None, self.path)
        merge_and_unload(chunks)
        params = [p for chunk in chunks for p in chunk.parameters()]
        for p, trained in zip(params, trains, strict=True):
            p.requires_grad_(trained)
