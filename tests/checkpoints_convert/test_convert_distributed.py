"""Distributed tier: checkpoint conversion HF <-> megatron dist checkpoint, LoRA, RM -> critic.

Commands are run as a user runs them (`python -m checkpoints_convert.X`): they check inputs,
then start themselves under torchrun.
"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.models.hf_mapping import HFCheckpointReader
from tests.tolerances import FP32_MODEL, assert_close

pytestmark = pytest.mark.distributed
# e2e variants left out of CI's e2e tier: the MoE layouts' conversion is the MoE checkpoint's test
EXTENDED = pytest.mark.extended


def convert(*args, check=True):
    cmd = [sys.executable, "-m", *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{result.stdout}\n{result.stderr[-4000:]}")
    return result


def hf_to_megatron(hf, out, tp=1, pp=1, *extra, check=True):
    return convert(
        "checkpoints_convert.hf_to_megatron",
        "--hf-dir",
        str(hf),
        "--out-dir",
        str(out),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        *extra,
        check=check,
    )


def megatron_to_hf(ckpt, out, tp=1, pp=1, *extra):
    return convert(
        "checkpoints_convert.megatron_to_hf",
        "--ckpt-dir",
        str(ckpt),
        "--out-dir",
        str(out),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        *extra,
    )


def verify(hf, ckpt, tp=1, pp=1, outputs=None, experts=()):
    extra = [*experts, *(["--outputs", str(outputs)] if outputs else [])]
    r = convert(
        "checkpoints_convert.verify",
        "--hf-dir",
        str(hf),
        "--ckpt-dir",
        str(ckpt),
        "--tp",
        str(tp),
        "--pp",
        str(pp),
        *extra,
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_bit_identical(a_dir, b_dir):
    a, b = HFCheckpointReader(a_dir), HFCheckpointReader(b_dir)
    assert sorted(a.keys()) == sorted(b.keys())
    for name in a.keys():
        assert torch.equal(a(name), b(name)), name


@pytest.mark.parametrize(
    "model, save, load",
    [
        # TP2PP2 once (tied: the embedding shared across the first and last stage is the
        # harder case). Untied TP=2 -> TP=1: the reward-model -> critic test; untied TP2 ->
        # trained -> TP1 and PP2: tests/trainer/test_journey_distributed.py. ~30 s each: the
        # journeys' tier (make test reached 21 min 24 s).
        pytest.param("tied", (2, 2), (1, 2), marks=pytest.mark.e2e),
        # Qwen3: the q/k norms through megatron's sharded checkpoint, head_dim != hidden/heads.
        ("qwen3", (2, 1), (1, 2)),
        # Experts saved split over EP (4 per rank), loaded whole on two pipeline stages; and
        # saved split over expert-TP (TP2+SP), loaded at EP2 with the dense part whole.
        pytest.param("qwen3-moe", (1, 1, "--ep", "2"), (1, 2), marks=[pytest.mark.e2e, EXTENDED]),
        # ~30 s: the journeys' tier (make test reached 19 min 41 s with the LoRA tests)
        pytest.param("mixtral", (2, 1), (1, 1, "--ep", "2"), marks=[pytest.mark.e2e, EXTENDED]),
    ],
)
def test_round_trip_is_bit_identical(
    tiny_model_dir, tiny_tied_model_dir, family_dir, tmp_path, model, save, load
):
    hf = {"untied": tiny_model_dir, "tied": tiny_tied_model_dir}.get(model) or family_dir(model)
    hf_to_megatron(hf, tmp_path / "mcore", *save)
    megatron_to_hf(tmp_path / "mcore", tmp_path / "back", *load)
    assert_bit_identical(hf, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (hf / "config.json").read_text()
    )
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp dirs left


@pytest.mark.e2e  # ~40 s: the journeys' tier (make test reached 19 min 41 s)
def test_a_moe_checkpoint_saved_at_ep2_gives_transformers_logits_at_tp2_ep2_and_pp2(
    family_dir, tmp_path
):
    """Experts saved over EP=2 and loaded at TP=2+SP with EP=2 and expert-TP 1, and over two
    pipeline stages: the logits of the checkpoint, resharded, are transformers' (softmax over
    every expert, no renormalising)."""
    hf = family_dir("qwen3-moe-nonorm")
    hf_to_megatron(hf, tmp_path / "mcore", 1, 1, "--ep", "2")
    result = verify(hf, tmp_path / "mcore", 2, 1, experts=["--ep", "2", "--etp", "1"])
    assert result["ok"] and result["layout"] == "TP2PP1EP2ETP1" and result["mismatched"] == 0
    at_pp2 = verify(hf, tmp_path / "mcore", 1, 2)  # each stage one MoE layer, experts whole
    assert at_pp2["ok"] and at_pp2["layout"] == "TP1PP2" and at_pp2["mismatched"] == 0


@pytest.fixture(scope="module")
def lora_adapter(tiny_model_dir, tmp_path_factory):
    """A PEFT LoRA adapter on every linear of the tiny model, with random non-zero B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    model = get_peft_model(base, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("lora") / "adapter"
    model.save_pretrained(out)
    return out, model


@pytest.mark.e2e  # ~30 s: the journeys' tier (make test reached 21 min 24 s)
def test_lora_merge_equals_peft_forward(tiny_model_dir, lora_adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    adapter, peft_model = lora_adapter
    convert(
        "checkpoints_convert.merge_lora",
        "--hf-dir",
        str(tiny_model_dir),
        "--lora-dir",
        str(adapter),
        "--out-dir",
        str(tmp_path / "merged"),
    )
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got, before = peft_model(ids).logits, merged(ids).logits, base(ids).logits
    assert_close(got, expected, FP32_MODEL)
    assert (expected - before).abs().max() > 1e-3  # the adapter really changes the model
    # The same merge inside hf_to_megatron gives the merged weights in Megatron too: saved at
    # TP=2, loaded at PP=2 (resharded), its logits equal the merged HF model's.
    hf_to_megatron(tiny_model_dir, tmp_path / "mcore", 2, 1, "--lora-dir", str(adapter))
    at_pp2 = verify(tmp_path / "merged", tmp_path / "mcore", 1, 2)
    assert at_pp2["ok"] and at_pp2["mismatched"] == 0 and at_pp2["shape"] == [2, 32, 500]


def test_lora_adapter_that_does_not_fit_is_a_clear_error(tiny_model_dir, lora_adapter, tmp_path):
    adapter, _ = lora_adapter
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = next(k for k in tensors if "layers.0.mlp.gate_proj.lora_B" in k)
    tensors[key] = torch.zeros(0)  # a ZeRO-3 partitioned save (seed 002)
    save_file(tensors, bad / "adapter_model.safetensors")
    r = hf_to_megatron(tiny_model_dir, tmp_path / "out", 1, 1, "--lora-dir", str(bad), check=False)
    assert r.returncode != 0
    assert "model.layers.0.mlp.gate_proj.weight" in r.stderr and "lora_B [0]" in r.stderr
    assert not (tmp_path / "out").exists()


def test_lora_rank_must_match_its_config(tiny_model_dir, lora_adapter, tmp_path):
    """The merge scale is lora_alpha / r: tensors of another rank than the config's `r` (or
    its rank_pattern) would be merged with the wrong scale, so they are refused."""
    from checkpoints_convert.lora import LoraMergedReader

    adapter, _ = lora_adapter
    config = json.loads((adapter / "adapter_config.json").read_text())
    for change, message in (
        ({"r": 8}, "has rank 4 .* says r=8"),
        (
            {"rank_pattern": {"q_proj": 2}},
            "q_proj.weight' has rank 4 .* r=2 \\(with rank_pattern\\)",
        ),
    ):
        bad = tmp_path / f"bad-{len(change)}-{next(iter(change))}"
        bad.mkdir()
        (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
        (bad / "adapter_model.safetensors").write_bytes(
            (adapter / "adapter_model.safetensors").read_bytes()
        )
        with pytest.raises(ValueError, match=message):
            LoraMergedReader(HFCheckpointReader(tiny_model_dir), bad)
    LoraMergedReader(HFCheckpointReader(tiny_model_dir), adapter)  # the real one passes


@pytest.fixture(scope="module")
def reward_model(tiny_model_dir, tmp_path_factory):
    """A tiny HF sequence-classification reward model built on the tiny transformer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm = AutoModelForSequenceClassification.from_pretrained(
        tiny_model_dir, num_labels=1, dtype=torch.float32
    )
    torch.manual_seed(2)
    with torch.no_grad():
        rm.score.weight.copy_(torch.randn_like(rm.score.weight))
    rm.config.pad_token_id = 0
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    rm.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


@pytest.mark.e2e  # ~45 s (convert, then train on the critic): the journeys' tier
def test_reward_model_converts_to_critic(reward_model, tmp_path):
    from transformers import AutoModelForSequenceClassification

    hf_to_megatron(reward_model, tmp_path / "critic", 2, 1, "--role", "critic")
    result = verify(reward_model, tmp_path / "critic", 1, 2, outputs=tmp_path / "values.pt")
    assert result["compared"] == "values" and result["ok"] and result["mismatched"] == 0
    # The critic's value at the last token is the reward model's score of the sequence.
    from checkpoints_convert.verify import fixed_tokens

    ids = fixed_tokens(500)
    ids[ids == 0] = 1  # no pad token inside, so the RM pools the last position
    rm = AutoModelForSequenceClassification.from_pretrained(reward_model, dtype=torch.float32)
    values = torch.load(tmp_path / "values.pt")
    with torch.no_grad():
        scores = rm(fixed_tokens(500)).logits[:, 0]
    assert_close(values[:, -1], scores, FP32_MODEL)
    megatron_to_hf(tmp_path / "critic", tmp_path / "back")
    assert_bit_identical(reward_model, tmp_path / "back")


def test_actor_checkpoint_is_not_a_reward_model(tiny_model_dir, tmp_path):
    r = hf_to_megatron(tiny_model_dir, tmp_path / "out", 1, 1, "--role", "critic", check=False)
    assert r.returncode != 0 and "no tensor 'score.weight'" in r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated", "missing", "wrong_shape"])
def test_corrupted_checkpoints_fail_in_one_line(tiny_model_dir, tmp_path, damage):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, bad)
    weights = bad / "model.safetensors"
    if damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        expected = f"{weights}: not a readable safetensors file"
    else:
        tensors = load_file(weights)
        if damage == "missing":
            del tensors["model.layers.2.mlp.up_proj.weight"]
            expected = "checkpoint has no tensor 'model.layers.2.mlp.up_proj.weight'"
        else:
            tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 128)
            expected = "tensor 'model.layers.1.self_attn.k_proj.weight' has shape [32, 128], expected [64, 128]"
        save_file(tensors, weights)
    r = hf_to_megatron(bad, tmp_path / "out", 2, 1, check=False)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], r.stderr[-2000:]
    assert not (tmp_path / "out").exists() and not any(
        p.name.startswith(".out") for p in tmp_path.iterdir()
    )
