"""Unit tier: architecture parsing and the HF <-> Megatron layout functions."""

import json

import pytest
import torch

from megatron_rl.models import hf_mapping
from megatron_rl.models.architecture import ModelArchitecture
from megatron_rl.models.hf_config import read_hf_config


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
            "decoder.layers.0.self_attention.mystery.weight", lambda n: None, arch(), 0, 1
        )


def test_layer_offset_maps_local_to_global_hf_layer():
    seen = []
    hf_mapping.megatron_shard_from_hf(
        "decoder.layers.1.input_layernorm.weight",
        lambda n: seen.append(n) or torch.ones(8),
        arch(),
        0,
        1,
        layer_offset=2,
    )
    assert seen == ["model.layers.3.input_layernorm.weight"]


def test_tied_output_layer_reads_embeddings():
    seen = []
    get = lambda n: seen.append(n) or torch.ones(10, 8)  # noqa: E731
    out = hf_mapping.megatron_shard_from_hf(
        "output_layer.weight", get, arch(tie_word_embeddings=True), 1, 2
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
                hf_mapping.megatron_shard_from_hf(name, reader, a, r, tp, layer_offset=2)
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
