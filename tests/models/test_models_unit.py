"""Unit tier: architecture parsing and the HF <-> Megatron layout functions."""

import json

import pytest
import torch

from megatron_rl.models import hf_mapping
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import ShardCoords


def arch(**overrides):
    base = dict(
        model_type="qwen2",
        num_layers=2,
        hidden_size=8,
        ffn_hidden_size=6,
        num_attention_heads=4,
        num_query_groups=2,
        head_dim=1,
        vocab_size=10,
        max_position_embeddings=32,
        rope_theta=1e4,
        norm_epsilon=1e-6,
        qkv_bias=True,
        tie_word_embeddings=False,
    )
    return ModelArchitecture(**{**base, **overrides})


def test_from_hf_config_reads_qwen2(tiny_model_dir):
    a = read_hf_config(tiny_model_dir)
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.num_query_groups) == (
        4,
        128,
        4,
        2,
    )
    assert a.head_dim == 32 and a.qkv_bias and not a.tie_word_embeddings
    assert a.rope_theta == 10000.0 and a.vocab_size == 500


def test_from_hf_config_rejects_unknown_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match=r"config.json: model_type='gpt2' is not supported"):
        read_hf_config(tmp_path)


def test_from_hf_config_names_missing_field(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "num_attention_heads": 4})
    )
    with pytest.raises(ValueError, match="missing field 'hidden_size'"):
        read_hf_config(tmp_path)


def test_padded_vocab_is_the_same_for_every_tp_up_to_8():
    assert {arch(vocab_size=500).padded_vocab_size(tp) for tp in (1, 2, 4, 8)} == {1024}
    assert arch(vocab_size=152064).padded_vocab_size(4) == 152576  # Qwen2.5: +512 rows
    assert arch(vocab_size=1025).padded_vocab_size(2) == 2048
    assert arch(vocab_size=500).padded_vocab_size(3) == 3072  # lcm(1024, 3)


def test_fuse_qkv_interleaves_per_query_group():
    a = arch()  # 2 groups of 2 query heads, head_dim 1
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = hf_mapping.fuse_qkv(q, k, v, a)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    for x, y in zip(hf_mapping.split_qkv(fused, a), (q, k, v), strict=True):
        assert torch.equal(x, y)


def test_qkv_round_trip_random_and_bias():
    a = arch(hidden_size=64, num_attention_heads=8, num_query_groups=2, head_dim=8)
    q, k, v = torch.randn(64, 64), torch.randn(16, 64), torch.randn(16, 64)
    assert all(
        torch.equal(x, y)
        for x, y in zip(
            hf_mapping.split_qkv(hf_mapping.fuse_qkv(q, k, v, a), a), (q, k, v), strict=True
        )
    )
    qb, kb, vb = torch.randn(64), torch.randn(16), torch.randn(16)
    assert hf_mapping.fuse_qkv(qb, kb, vb, a).shape == (96,)


def test_fc1_shards_hold_gate_then_up_per_rank():
    gate, up = torch.arange(4.0).unsqueeze(1), torch.arange(10.0, 14.0).unsqueeze(1)
    s0, s1 = (hf_mapping.fc1_shard(gate, up, r, 2) for r in range(2))
    assert s0.flatten().tolist() == [0, 1, 10, 11] and s1.flatten().tolist() == [2, 3, 12, 13]
    g, u = hf_mapping.split_fc1_shards([s0, s1])
    assert torch.equal(g, gate) and torch.equal(u, up)


def test_unknown_megatron_name_is_an_error():
    with pytest.raises(KeyError, match="decoder.layers.0.self_attention.mystery.weight"):
        hf_mapping.megatron_shard_from_hf(
            "decoder.layers.0.self_attention.mystery.weight", lambda n: None, arch(), ShardCoords()
        )


def test_layer_offset_maps_local_to_global_hf_layer():
    seen = []
    hf_mapping.megatron_shard_from_hf(
        "decoder.layers.1.input_layernorm.weight",
        lambda n: seen.append(n) or torch.ones(8),
        arch(),
        ShardCoords(),
        layer_offset=2,
    )
    assert seen == ["model.layers.3.input_layernorm.weight"]


def test_tied_output_layer_reads_embeddings():
    seen = []
    get = lambda n: seen.append(n) or torch.ones(10, 8)  # noqa: E731
    out = hf_mapping.megatron_shard_from_hf(
        "output_layer.weight", get, arch(tie_word_embeddings=True), ShardCoords(1, 2)
    )
    # 10 rows padded to 1024; rank 1 holds rows 512..1023, all padding.
    assert seen == ["model.embed_tokens.weight"] and out.shape == (512, 8)
    assert out.abs().sum() == 0


def test_reader_names_missing_tensor(tiny_model_dir):
    reader = hf_mapping.HFCheckpointReader(tiny_model_dir)
    assert "model.embed_tokens.weight" in reader.keys()
    with pytest.raises(KeyError, match="checkpoint has no tensor 'nope'"):
        reader("nope")


def test_megatron_shards_round_trip_to_hf_tensors(tiny_model_dir):
    """HF -> Megatron TP shards -> HF is exact for every parameter at TP=1 and TP=2."""
    a = read_hf_config(tiny_model_dir)
    reader = hf_mapping.HFCheckpointReader(tiny_model_dir)
    names = [
        "embedding.word_embeddings.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
    ]
    for local in (
        "input_layernorm.weight",
        "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        "mlp.linear_fc2.weight",
        "self_attention.linear_proj.weight",
        "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv.bias",
    ):
        names.append(f"decoder.layers.1.{local}")
    for tp in (1, 2):
        rebuilt = {}
        for name in names:
            shards = [
                hf_mapping.megatron_shard_from_hf(
                    name, reader, a, ShardCoords(r, tp), layer_offset=2
                )
                for r in range(tp)
            ]
            rebuilt.update(hf_mapping.hf_tensors_from_megatron(name, shards, a, layer_offset=2))
        assert (
            len(rebuilt) == 3 + 12
        )  # embed, lm_head, norm + one layer: 2 norms, q/k/v w+b, o, gate, up, down
        for hf_name, tensor in rebuilt.items():
            assert torch.equal(tensor, reader(hf_name)), (tp, hf_name)


def test_model_source_reads_hf_directories_and_megatron_checkpoints(tiny_model_dir, tmp_path):
    from megatron_rl.models.dist_checkpoint import copy_side_files, write_metadata
    from megatron_rl.models.source import ModelSource

    hf = ModelSource(tiny_model_dir)
    assert not hf.is_megatron and hf.hf_dir == tiny_model_dir and hf.saved_role is None
    for role in ("actor", "critic"):
        ckpt = tmp_path / role
        ckpt.mkdir()
        write_metadata(ckpt, role, hf.architecture())
        copy_side_files(tiny_model_dir, ckpt / "hf_meta")
        source = ModelSource(str(ckpt))
        assert source.is_megatron and source.saved_role == role
        assert source.hf_dir == ckpt / "hf_meta" and (source.hf_dir / "tokenizer.json").exists()
        assert source.architecture() == hf.architecture()
    # Refused before any tensor is touched: a value head cannot become a vocabulary projection.
    with pytest.raises(ValueError, match="is a critic checkpoint .* cannot start a policy"):
        ModelSource(tmp_path / "critic").load_policy([], hf.architecture())


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("naming", ["local", "grouped"])
@pytest.mark.parametrize("tp, etp, ep", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (1, 1, 4)])
def test_expert_shards_round_trip_to_hf_tensors(family_dir, family, naming, tp, etp, ep):
    """HF -> the expert shards of every (ETP, EP) rank -> HF is exact, in megatron-core's
    local (SequentialMLP) and Transformer Engine grouped-GEMM namings; each EP rank holds the
    contiguous block of experts ep_rank * E/EP + j."""
    hf = family_dir(family)
    a = read_hf_config(hf)
    reader = hf_mapping.HFCheckpointReader(hf)
    per_rank = a.num_moe_experts // ep

    def names(j):
        if naming == "local":
            return [
                f"decoder.layers.0.mlp.experts.local_experts.{j}.linear_fc{i}.weight"
                for i in (1, 2)
            ]
        return [f"decoder.layers.0.mlp.experts.linear_fc{i}.weight{j}" for i in (1, 2)]

    rebuilt = {}
    for ep_rank in range(ep):
        for j in range(per_rank):
            for name in names(j):
                shards = [
                    hf_mapping.megatron_shard_from_hf(
                        name,
                        reader,
                        a,
                        ShardCoords(r % tp, tp, r, etp, ep_rank, ep),
                        layer_offset=1,
                    )
                    for r in range(etp)
                ]
                width = a.moe_ffn_hidden_size // etp
                assert shards[0].shape == ((2 * width, 128) if "fc1" in name else (128, width))
                rebuilt.update(
                    hf_mapping.hf_tensors_from_megatron(
                        name, shards, a, layer_offset=1, expert_offset=ep_rank * per_rank
                    )
                )
    router = "decoder.layers.0.mlp.router.weight"
    shard = hf_mapping.megatron_shard_from_hf(router, reader, a, ShardCoords(1, tp), layer_offset=1)
    rebuilt.update(hf_mapping.hf_tensors_from_megatron(router, [shard], a, layer_offset=1))
    expected = {
        k
        for k in reader.keys()
        if k.startswith("model.layers.1.") and ("experts" in k or k.endswith("gate.weight"))
    }
    assert set(rebuilt) == expected and len(rebuilt) == 3 * a.num_moe_experts + 1
    for hf_name, tensor in rebuilt.items():
        assert torch.equal(tensor, reader(hf_name)), (hf_name, tp, etp, ep)


def test_a_stray_expert_tensor_is_refused_by_name(family_dir, tmp_path):
    """A checkpoint with a ninth expert the config does not announce is refused, not dropped."""
    from tests.models.test_hf_config_unit import checkpoint_with

    stray = {"model.layers.0.mlp.experts.8.up_proj.weight": torch.zeros(64, 128)}
    hf = checkpoint_with(family_dir("qwen3-moe"), tmp_path / "hf", **stray)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) .* model.layers.0.mlp.experts.8.up_proj"):
        hf_mapping.validate_hf_checkpoint(hf_mapping.HFCheckpointReader(hf), read_hf_config(hf))
