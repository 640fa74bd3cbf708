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

    def load_policy(self, chunks: list, arch: ModelArchitecture) -> None:
        """Policy weights (actor, reference) into this rank's GPT chunks."""
        if not self.is_megatron:
            return load_hf_into_megatron(chunks, self.path, arch)
        if self.saved_role == "critic":
            raise ValueError(
                f"{self.path} is a critic checkpoint (a value head, no vocabulary projection): "
                "it cannot start a policy; give the actor's checkpoint or its HF model"
            )
        load_role(chunks, None, self.path)

    def load_critic(self, chunks: list, arch: ModelArchitecture) -> None:
        """Critic weights into this rank's critic chunks: a critic checkpoint (value head
        included), a reward model's HF directory (its `score.weight` is the value head), or a
        policy's weights (HF or Megatron; the value head keeps its small random init)."""
        if self.is_megatron:
            skip = () if self.saved_role == "critic" else (VALUE_HEAD,)
            return load_role(chunks, None, self.path, skip=skip)

        reader = HFCheckpointReader(self.path)
        load_hf_into_megatron(chunks, reader, arch, skip={VALUE_HEAD})
        if "score.weight" in reader.keys():  # a reward model: its score head is the value head
            load_value_head(chunks, reader)
