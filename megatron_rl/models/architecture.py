"""The shape of a decoder-only model, read from a Hugging Face config (Qwen2 / Llama families).

Pure Python: no Megatron import, so configs can be validated before any process starts.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
VOCAB_PAD_MULTIPLE = 1024
"""128 * 8: the padded vocabulary is the same for every TP size up to 8, so a checkpoint
saved at one TP loads at another (megatron-LM pads to 128 * TP, which changes with TP)."""


@dataclass(frozen=True)
class ModelArchitecture:
    """Dimensions and flavour of a Qwen2/Llama-style transformer (RMSNorm, SwiGLU, RoPE, GQA)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA); equals num_attention_heads for plain multi-head attention."""
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_epsilon: float
    qkv_bias: bool
    tie_word_embeddings: bool
    init_method_std: float = 0.02

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Vocabulary rounded up to a multiple of VOCAB_PAD_MULTIPLE (and of TP), so it splits
        evenly over TP ranks.

        The extra rows are zero on import and dropped on export; log-probs and entropy mask
        them (`megatron_rl.parallel.vocab`), and sampling never sees them.
        """
        multiple = math.lcm(VOCAB_PAD_MULTIPLE, tp)
        return -(-self.vocab_size // multiple) * multiple

    def check_divisible(self, tp: int, layer_chunks: int) -> None:
        """Raise ValueError, naming the numbers, if TP or PP cannot split this model."""
        if self.num_attention_heads % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_query_groups % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"num_key_value_heads={self.num_query_groups}"
            )
        if self.ffn_hidden_size % tp != 0:
            raise ValueError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"intermediate_size={self.ffn_hidden_size}"
            )
        if self.num_layers % layer_chunks != 0:
            raise ValueError(
                f"num_hidden_layers={self.num_layers} is not divisible by "
                f"pipeline_model_parallel_size * virtual_pipeline_model_parallel_size = {layer_chunks}"
            )

    @classmethod
    def from_hf_config(cls, config: dict[str, Any] | str | Path) -> ModelArchitecture:
        """Read a Hugging Face `config.json` (a dict, the file, or its directory)."""
        source = "<dict>"
        if not isinstance(config, dict):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            source = str(path)
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError as e:
                raise FileNotFoundError(f"no Hugging Face config at {path}") from e
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type={model_type!r} is not supported; "
                f"expected one of {SUPPORTED_MODEL_TYPES}"
            )

        def field(name: str) -> Any:
            if name not in config:
                raise ValueError(f"{source}: missing field {name!r} for model_type={model_type}")
            return config[name]

        heads = field("num_attention_heads")
        hidden = field("hidden_size")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported yet")
        rope_theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        return cls(
            model_type=model_type,
            num_layers=field("num_hidden_layers"),
            hidden_size=hidden,
            ffn_hidden_size=field("intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or hidden // heads,
            vocab_size=field("vocab_size"),
            max_position_embeddings=field("max_position_embeddings"),
            rope_theta=float(rope_theta),
            norm_epsilon=float(field("rms_norm_eps")),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            init_method_std=float(config.get("initializer_range", 0.02)),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
