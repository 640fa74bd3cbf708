"""Unit tier: the tiny HF checkpoint builder that every other test stands on."""

import json

import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from examples.tiny_model import TinyModelSpec, main, make_tiny_model


def test_checkpoint_files_and_architecture(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32
    weights = load_file(tiny_model_dir / "model.safetensors")
    assert "lm_head.weight" in weights  # untied by default
    # Norms and biases are random too, so layout bugs in them cannot hide.
    assert (weights["model.norm.weight"] != 1).all()
    assert (weights["model.layers.0.self_attn.q_proj.bias"] != 0).all()


def test_deterministic_given_seed(tmp_path, tiny_model_dir):
    again = make_tiny_model(tmp_path / "again", TinyModelSpec())
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert (tiny_model_dir / "tokenizer.json").read_text() == (again / "tokenizer.json").read_text()
    other = make_tiny_model(tmp_path / "other", TinyModelSpec(seed=5))
    c = load_file(other / "model.safetensors")
    assert not (a["model.embed_tokens.weight"] == c["model.embed_tokens.weight"]).all()


def test_tied_embeddings_option(tiny_tied_model_dir):
    assert "lm_head.weight" not in load_file(tiny_tied_model_dir / "model.safetensors")
    assert json.loads((tiny_tied_model_dir / "config.json").read_text())["tie_word_embeddings"]


def test_tokenizer_and_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("The answer is \\boxed{5}.")["input_ids"]
    assert tok.decode(ids) == "The answer is \\boxed{5}."
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_bad_spec_and_existing_dir_are_clear_errors(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="head dim 16 < 32"):
        TinyModelSpec(hidden=64, heads=4)
    with pytest.raises(ValueError, match="--heads 4 is not a multiple of --kv-heads 3"):
        TinyModelSpec(kv_heads=3)
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["--out", str(tiny_model_dir)])


def test_cli_llama(tmp_path):
    main(["--out", str(tmp_path / "llama"), "--model-type", "llama", "--layers", "2"])
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 2
    assert not any(p.name.startswith(".llama.tmp") for p in tmp_path.iterdir())
