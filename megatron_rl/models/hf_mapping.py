"""Hugging Face <-> Megatron names and tensor layouts for Qwen2/Qwen3/Llama-family models and
the Qwen3-MoE / Mixtral mixtures of experts.

This is the one place that knows how HF tensors map onto megatron-core's GPTModel; the
checkpoint converters and the Megatron -> vLLM weight sync build on it.

Megatron layouts (per TP rank r of tp ranks):
- `linear_qkv` [groups/tp * (heads_per_group + 2) * head_dim, hidden]: for each query
  group, its query heads, then its key head, then its value head. TP splits whole groups, so
  the full fused tensor is chunked contiguously along dim 0.
- `linear_fc1` [2 * ffn/tp, hidden]: rank r holds [gate_r; up_r] (gate and up each chunked
  along dim 0), so the full tensor is NOT a contiguous chunk of [gate; up].
- column-parallel (fused qkv, fc1, embedding, output layer) split dim 0; row-parallel
  (`linear_proj`, `linear_fc2`) split dim 1; norms are replicated.
- vocabulary rows are padded to `arch.padded_vocab_size(tp)` with zeros.

Layer names are local to a pipeline chunk (`decoder.layers.0` is the chunk's first layer);
`layer_offset` turns them into global HF indices.

Experts (MoE layers): `mlp.router.weight` [experts, hidden] is replicated; each rank of the
expert-parallel group holds experts/EP of them, local expert j being global expert
ep_rank * experts/EP + j, each split over the expert-TP (ETP) group like a dense MLP
(`linear_fc1` = [gate_r; up_r], `linear_fc2` by columns). Two Megatron namings hold them:
megatron-core's local spec (`SequentialMLP`: `mlp.experts.local_experts.{j}.linear_fc1.weight`)
and Transformer Engine's grouped GEMM (`TEGroupedMLP`: `mlp.experts.linear_fc1.weight{j}`).
HF names: Qwen3-MoE `mlp.gate` / `mlp.experts.{e}.gate_proj|up_proj|down_proj`, Mixtral
`block_sparse_moe.gate` / `block_sparse_moe.experts.{e}.w1|w3|w2` (gate, up, down), as
transformers' `save_pretrained` writes them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.critic import ValueHead
from megatron_rl.models.gpt import layer_offset
from megatron_rl.models.lora import lora_modules

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron per-layer suffix -> HF per-layer suffix, for tensors that map one to one.
# Both the local spec's separate norms and TE's fused layer_norm_weight names are listed.
_LAYER_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3 qk-norm
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
# Biases of the row-parallel projections (Llama with attention_bias and mlp_bias).
_ROW_BIAS = {
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
# Non-parameter buffers older Llama checkpoints saved; recomputed from the config.
_BUFFER = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
# An expert's weight in either Megatron naming: (local expert, fc1|fc2).
_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(\d+)\.linear_(fc[12])\.weight"
    r"|linear_(fc[12])\.weight(\d+))$"
)
# model_type -> (router, per-expert prefix, its gate / up / down projections), per layer.
_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", ("w1", "w3", "w2")),
}


@dataclass(frozen=True)
class ShardCoords:
    """Where a rank's shards sit: its TP rank of `tp`, and for experts its expert-TP rank of
    `etp` and expert-parallel rank of `ep`."""

    tp_rank: int = 0
    tp: int = 1
    etp_rank: int = 0
    etp: int = 1
    ep_rank: int = 0
    ep: int = 1

    @classmethod
    def current(cls) -> ShardCoords:
        """This rank's, from megatron-core's parallel state."""
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_model_parallel_world_size(),
        )


def _expert(suffix: str) -> tuple[int, str] | None:
    """(local expert index, "fc1"/"fc2") of an expert weight's layer suffix, else None."""
    m = _EXPERT.match(suffix)
    if m is None:
        return None
    if m.group(1) is not None:
        return int(m.group(1)), m.group(2)
    return int(m.group(4)), m.group(3)


def is_expert_param(name: str) -> bool:
    """Whether Megatron parameter `name` belongs to one expert (split over ETP, not TP, and
    held by one EP rank)."""
    match = _LAYER.match(name)
    return match is not None and _expert(match.group(2)) is not None


def _expert_hf_names(arch: ModelArchitecture, prefix: str, expert: int) -> tuple[str, str, str]:
    """HF names of global expert `expert`'s gate, up and down weights under layer `prefix`."""
    _, experts, projections = _MOE_NAMES[arch.model_type]
    return tuple(f"{prefix}{experts}.{expert}.{p}.weight" for p in projections)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArchitecture):
    """[heads*d, ...], [groups*d, ...], [groups*d, ...] -> Megatron fused qkv [groups*(hpg+2)*d, ...]."""
    g, d, hpg = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(g, hpg * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return fused.reshape(g * (hpg + 2) * d, *rest)


def split_qkv(fused: torch.Tensor, arch: ModelArchitecture):
    """Inverse of `fuse_qkv`: Megatron fused qkv -> (q, k, v) in HF layout."""
    g, d, hpg = arch.num_query_groups, arch.head_dim, arch.heads_per_group
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (hpg + 2) * d, *rest)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def fc1_shard(gate: torch.Tensor, up: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Rank `tp_rank`'s Megatron linear_fc1 shard: [gate_r; up_r]."""
    return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]], dim=0)


def split_fc1_shards(shards: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fc1_shard` over all TP ranks: the shards -> full (gate, up)."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])


def pad_vocab(weight: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """Zero-pad a [vocab, hidden] matrix to [padded_rows, hidden]."""
    extra = padded_rows - weight.shape[0]
    if extra < 0:
        raise ValueError(f"vocabulary of {weight.shape[0]} rows exceeds padded size {padded_rows}")
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])]) if extra else weight


def megatron_shard_from_hf(
    name: str,
    get_hf: Callable[[str], torch.Tensor],
    arch: ModelArchitecture,
    coords: ShardCoords,
    layer_offset: int = 0,
) -> torch.Tensor:
    """The local shard of Megatron parameter `name` at `coords`, built from HF tensors.

    `get_hf(hf_name)` returns a full HF tensor. Raises KeyError for a name this mapping does
    not know, so nothing is silently left at its random initialisation.
    """
    tp_rank, tp_size = coords.tp_rank, coords.tp

    def column(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=0)[tp_rank]

    def row(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(tp_size, dim=1)[tp_rank]

    vocab_rows = arch.padded_vocab_size(tp_size)
    if name == "embedding.word_embeddings.weight":
        return column(pad_vocab(get_hf("model.embed_tokens.weight"), vocab_rows))
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return column(pad_vocab(get_hf(hf), vocab_rows))
    if name == "decoder.final_layernorm.weight":
        return get_hf("model.norm.weight")

    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")
    prefix = f"model.layers.{int(match.group(1)) + layer_offset}."
    suffix = match.group(2)
    if suffix in _LAYER_DIRECT:
        return get_hf(prefix + _LAYER_DIRECT[suffix])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        qkv = [get_hf(f"{prefix}self_attn.{p}_proj.{kind}") for p in "qkv"]
        return column(fuse_qkv(*qkv, arch))
    if suffix == "self_attention.linear_proj.weight":
        return row(get_hf(prefix + "self_attn.o_proj.weight"))
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        kind = suffix.rsplit(".", 1)[1]
        gate, up = get_hf(f"{prefix}mlp.gate_proj.{kind}"), get_hf(f"{prefix}mlp.up_proj.{kind}")
        return fc1_shard(gate, up, tp_rank, tp_size)
    if suffix == "mlp.linear_fc2.weight":
        return row(get_hf(prefix + "mlp.down_proj.weight"))
    if suffix in _ROW_BIAS:  # added after the row-parallel reduction: whole on every rank
        return get_hf(prefix + _ROW_BIAS[suffix])
    if arch.is_moe and suffix == "mlp.router.weight":
        return get_hf(prefix + _MOE_NAMES[arch.model_type][0])
    expert = _expert(suffix) if arch.is_moe else None
    if expert is not None:
        local, fc = expert
        per_rank = arch.num_moe_experts // coords.ep
        gate, up, down = _expert_hf_names(arch, prefix, coords.ep_rank * per_rank + local)
        if fc == "fc1":
            return fc1_shard(get_hf(gate), get_hf(up), coords.etp_rank, coords.etp)
        return get_hf(down).chunk(coords.etp, dim=1)[coords.etp_rank]
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")


def hf_tensors_from_megatron(
    name: str,
    shards: list[torch.Tensor],
    arch: ModelArchitecture,
    layer_offset: int = 0,
    expert_offset: int = 0,
) -> dict[str, torch.Tensor]:
    """Inverse of `megatron_shard_from_hf`: all TP shards of one Megatron parameter (in TP
    rank order; for an expert, its expert-TP shards) -> the HF tensors it holds, vocabulary
    padding removed. `expert_offset`: the global index of this rank's first local expert
    (ep_rank * experts / EP).

    Norm weights are replicated: shard 0 is taken. Raises KeyError for unknown names.
    """
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = torch.cat(shards, dim=0)[: arch.vocab_size]
        if name == "output_layer.weight":
            return {} if arch.tie_word_embeddings else {"lm_head.weight": full}
        return {"model.embed_tokens.weight": full}
    if name == "decoder.final_layernorm.weight":
        return {"model.norm.weight": shards[0]}
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")
    prefix = f"model.layers.{int(match.group(1)) + layer_offset}."
    suffix = match.group(2)
    if suffix in _LAYER_DIRECT:
        return {prefix + _LAYER_DIRECT[suffix]: shards[0]}
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = split_qkv(torch.cat(shards, dim=0), arch)
        return {
            f"{prefix}self_attn.{p}_proj.{kind}": t for p, t in zip("qkv", (q, k, v), strict=True)
        }
    if suffix == "self_attention.linear_proj.weight":
        return {prefix + "self_attn.o_proj.weight": torch.cat(shards, dim=1)}
    if suffix in ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        kind = suffix.rsplit(".", 1)[1]
        gate, up = split_fc1_shards(shards)
        return {f"{prefix}mlp.gate_proj.{kind}": gate, f"{prefix}mlp.up_proj.{kind}": up}
    if suffix == "mlp.linear_fc2.weight":
        return {prefix + "mlp.down_proj.weight": torch.cat(shards, dim=1)}
    if suffix in _ROW_BIAS:
        return {prefix + _ROW_BIAS[suffix]: shards[0]}
    if arch.is_moe and suffix == "mlp.router.weight":
        return {prefix + _MOE_NAMES[arch.model_type][0]: shards[0]}
    expert = _expert(suffix) if arch.is_moe else None
    if expert is not None:
        local, fc = expert
        gate, up, down = _expert_hf_names(arch, prefix, expert_offset + local)
        if fc == "fc1":
            gate_t, up_t = split_fc1_shards(shards)
            return {gate: gate_t, up: up_t}
        return {down: torch.cat(shards, dim=1)}
    raise KeyError(f"no Hugging Face mapping for Megatron parameter {name!r}")


def expected_hf_shapes(arch: ModelArchitecture, role: str = "actor") -> dict[str, tuple]:
    """Every tensor an HF checkpoint of `arch` must hold, with its shape.

    role "actor": a causal LM (`lm_head.weight` unless tied); "critic": a sequence-
    classification reward model (`score.weight` [1, hidden], no LM head).
    """
    h, ffn, v = arch.hidden_size, arch.ffn_hidden_size, arch.vocab_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_query_groups * arch.head_dim
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if role == "critic":
        shapes["score.weight"] = (1, h)
    elif not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
            }
        )
        if arch.is_moe:
            shapes[p + _MOE_NAMES[arch.model_type][0]] = (arch.num_moe_experts, h)
            moe_ffn = arch.moe_ffn_hidden_size
            for e in range(arch.num_moe_experts):
                gate, up, down = _expert_hf_names(arch, p, e)
                shapes.update({gate: (moe_ffn, h), up: (moe_ffn, h), down: (h, moe_ffn)})
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (ffn, h),
                    p + "mlp.up_proj.weight": (ffn, h),
                    p + "mlp.down_proj.weight": (h, ffn),
                }
            )
        if arch.linear_bias:
            shapes.update(
                {
                    p + "self_attn.o_proj.bias": (h,),
                    p + "mlp.gate_proj.bias": (ffn,),
                    p + "mlp.up_proj.bias": (ffn,),
                    p + "mlp.down_proj.bias": (h,),
                }
            )
        if arch.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (arch.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (arch.head_dim,)
        if arch.qkv_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
    return shapes


class HFCheckpointReader:
    """Reads tensors by name from a Hugging Face safetensors checkpoint, lazily, one at a time.

    Errors (unreadable or truncated file, missing tensor) name the file and the tensor.
    """

    def __init__(self, hf_dir: str | Path):
        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
        else:
            single = self.hf_dir / "model.safetensors"
            if not single.exists():
                raise FileNotFoundError(f"no model.safetensors(.index.json) in {self.hf_dir}")
            with self._open(single.name) as f:
                weight_map = {k: single.name for k in f.keys()}
        self._weight_map = weight_map

    def _open(self, file: str):
        path = self.hf_dir / file
        try:
            return safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None

    def keys(self) -> list[str]:
        return list(self._weight_map)

    def _file(self, name: str) -> str:
        if name not in self._weight_map:
            raise KeyError(f"{self.hf_dir}: checkpoint has no tensor {name!r}")
        return self._weight_map[name]

    def shape(self, name: str) -> tuple:
        """Shape from the file header, without reading the data."""
        with self._open(self._file(name)) as f:
            return tuple(f.get_slice(name).get_shape())

    def __call__(self, name: str) -> torch.Tensor:
        file = self._file(name)
        with self._open(file) as f:
            try:
                return f.get_tensor(name)
            except Exception as e:
                raise ValueError(
                    f"{self.hf_dir / file}: cannot read tensor {name!r} ({e})"
                ) from None


def check_every_tensor_is_mapped(reader, arch: ModelArchitecture) -> None:
    """Refuse a checkpoint holding a tensor nothing here maps (e.g. an o_proj bias the config
    did not announce), naming it, instead of dropping it. Heads are not role-specific: a
    critic initialised from a causal LM leaves its `lm_head` unused by design."""
    known = expected_hf_shapes(arch, "actor").keys() | expected_hf_shapes(arch, "critic").keys()
    if arch.tie_word_embeddings:
        known.add("lm_head.weight")  # checked below: must equal the embedding it is tied to
    unmapped = sorted(k for k in reader.keys() if k not in known and not _BUFFER.match(k))
    if unmapped:
        shown = ", ".join(unmapped[:5]) + (f" and {len(unmapped) - 5} more" * (len(unmapped) > 5))
        raise ValueError(
            f"{reader.hf_dir}: {len(unmapped)} tensor(s) that model_type={arch.model_type} with "
            f"this config does not have, so they would be dropped: {shown}"
        )
    if arch.tie_word_embeddings and "lm_head.weight" in reader.keys():
        if not torch.equal(reader("lm_head.weight"), reader("model.embed_tokens.weight")):
            raise ValueError(
                f"{reader.hf_dir}: tie_word_embeddings is true but lm_head.weight differs from "
                "model.embed_tokens.weight"
            )


def validate_hf_checkpoint(reader, arch: ModelArchitecture, role: str = "actor") -> None:
    """Check every expected tensor is present with the right shape (headers only) and every
    tensor present is mapped."""
    check_every_tensor_is_mapped(reader, arch)
    for name, shape in expected_hf_shapes(arch, role).items():
        found = reader.shape(name)
        if found != shape:
            raise ValueError(
                f"{reader.hf_dir}: tensor {name!r} has shape {list(found)}, "
                f"expected {list(shape)} for this config"
            )


@torch.no_grad()
def load_hf_into_megatron(
    model_chunks: list,
    source,
    arch: ModelArchitecture,
    skip: set[str] = frozenset(),
) -> None:
    """Copy an HF checkpoint's weights into this rank's Megatron model chunks, in place.

    `source` is an HF directory or a reader (e.g. one that merges a LoRA adapter). Every
    parameter not named in `skip` must be mapped and shape-matched; a mismatch names the
    parameter and both shapes. Tensors are read one at a time (one layer's worth at most).
    """
    reader = source if callable(source) else HFCheckpointReader(source)
    check_every_tensor_is_mapped(reader, arch)
    coords = ShardCoords.current()
    for chunk in model_chunks:
        offset = layer_offset(chunk)
        for name, param in chunk.named_parameters():
            if name in skip:
                continue
            shard = megatron_shard_from_hf(name, reader, arch, coords, offset)
            if shard.shape != param.shape:
                raise ValueError(
                    f"{reader.hf_dir}: parameter {name} expects shape {tuple(param.shape)}, "
                    f"the checkpoint gives {tuple(shard.shape)}"
                )
            param.copy_(shard)


def unwrap(chunk):
    """The GPTModel inside its wrappers (DDP, Float16Module), or the chunk itself."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def export_hf_tensors(
    chunks: list, arch: ModelArchitecture, *, grads: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for this rank's pipeline stage, TP shards gathered, and
    for a MoE model every expert: its expert-TP shards gathered, then each expert-parallel
    rank's experts.

    grads=True yields the reduced gradients (DDP's main_grad) instead of the weights. A
    critic's value head is yielded as `score.weight`, as in HF sequence classification.
    A LoRA-adapted linear (`models/lora.py`) yields its merged weight W + s B A (its base
    weight while adapters are off), never its factors: the model as a plain HF model.
    Every rank of the stage (all its TP, and EP, ranks) yields the same tensors.
    """
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state as ps

    tp_group, etp_group = ps.get_tensor_model_parallel_group(), None
    if arch.is_moe:
        etp_group, ep_group = (
            ps.get_expert_tensor_parallel_group(),
            ps.get_expert_model_parallel_group(),
        )
        ep = ep_group.size()
    for chunk in chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        adapted = {} if grads else _adapted_linears(model)
        for name, param in model.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                continue
            if name in adapted:  # one merged weight at a time: no copy of the model
                tensor = adapted[name].merged_weight()
            else:
                tensor = param.main_grad if grads else param.detach()
            if name == "output_layer.weight" and isinstance(model.output_layer, ValueHead):
                yield "score.weight", tensor.clone()
                continue
            expert = arch.is_moe and is_expert_param(name)
            shards = [tensor]
            if getattr(param, "tensor_model_parallel", False):
                shards = _all_gather(tensor, etp_group if expert else tp_group)
            if not expert:
                yield from hf_tensors_from_megatron(name, shards, arch, offset).items()
                continue
            # each EP rank's shards of its own local expert
            by_rank = zip(*(_all_gather(s, ep_group) for s in shards), strict=True)
            per_rank = arch.num_moe_experts // ep
            for r, rank_shards in enumerate(by_rank):
                yield from hf_tensors_from_megatron(
                    name, list(rank_shards), arch, offset, expert_offset=r * per_rank
                ).items()


def _adapted_linears(model) -> dict:
    """Weight name -> its LoRA-adapted linear, for every adapted linear of `model`."""
    return {f"{name}.weight": m for _, name, m in lora_modules([model])}


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """`tensor` from every rank of `group`, in rank order (no copy in a group of one)."""
    if group.size() == 1:
        return [tensor]
    out = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(out, tensor.contiguous(), group=group)
    return out
