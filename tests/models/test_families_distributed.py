"""Distributed tier: every supported Hugging Face family (tests/families.py) gives
transformers' logits in Megatron at TP=1, TP=2 and TP=2 with sequence parallelism (mixtures
of experts: TP=1, EP=2 with the alltoall and the allgather dispatcher, TP=2+SP with the
experts split over expert-TP, TP=2+SP with EP=2), on 96 tokens (past the 64- and 32-token
original contexts of the Llama-3.1/3.2 and yarn rows), and exports back to exactly the
tensors it was loaded from. The engine side: vLLM greedy-decodes the new families as
transformers does."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatron_rl.launch import run_torchrun
from megatron_rl.models.hf_mapping import HFCheckpointReader
from tests.families import MOE, SUPPORTED
from tests.tolerances import FP32_MODEL, assert_close
from tests.torchrun.family_logits import DENSE
from tests.torchrun.family_logits import MOE as MOE_SPLITS

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def results(family_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("family_logits")
    dirs = [str(family_dir(name)) for name in SUPPORTED]
    run_torchrun("tests.torchrun.family_logits", ["--hf-dirs", *dirs, "--out-dir", str(out)])
    return {name: torch.load(out / f"{name}.pt") for name in SUPPORTED}


def hf_logits(hf_dir, tokens, unscaled_rope=False):
    config = AutoConfig.from_pretrained(hf_dir)
    if unscaled_rope:
        config.rope_parameters = {"rope_type": "default", **{
            k: v for k, v in config.rope_parameters.items() if k == "rope_theta"
        }}  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(hf_dir, config=config, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("family", SUPPORTED)
def test_megatron_logits_equal_transformers_at_every_split(results, family_dir, family):
    r = results[family]
    expected = hf_logits(family_dir(family), r["tokens"])
    assert expected.abs().max() > 0.1  # not a degenerate all-zero comparison
    for split in MOE_SPLITS if family in MOE else DENSE:
        assert_close(r[split], expected, FP32_MODEL, f"{family} {split}")


@pytest.mark.parametrize("family", SUPPORTED)
def test_export_gives_back_every_tensor_bit_for_bit(results, family_dir, family):
    reader = HFCheckpointReader(family_dir(family))
    exported = results[family]["exported"]
    assert sorted(exported) == sorted(reader.keys())
    for name in reader.keys():
        assert torch.equal(exported[name], reader(name)), name


@pytest.mark.parametrize(
    "family", ["llama-3.1", "llama-3.2", "llama-linear-rope", "qwen2.5-yarn", "qwen3-yarn"]
)
def test_rope_scaling_changes_the_logits_it_is_checked_on(results, family_dir, family):
    """The scaled rows would fail if the scaling were dropped: without it transformers'
    logits move far beyond the tolerance (so the equality above tests the scaling)."""
    tokens = results[family]["tokens"]
    unscaled = hf_logits(family_dir(family), tokens, unscaled_rope=True)
    assert (unscaled - results[family]["tp1"]).abs().max() > 1e-3


GREEDY_FAMILIES = [
    "qwen2.5", "qwen3", "llama-3.1", "llama-biases", "llama-linear-rope", "qwen3-yarn",
    "qwen3-moe", "mixtral",
]  # fmt: skip


@pytest.fixture(scope="module")
def vllm_greedy(family_dir, tmp_path_factory):
    """vLLM's greedy responses for GREEDY_FAMILIES, from one process with its own engines."""
    out = tmp_path_factory.mktemp("vllm_greedy")
    dirs = [str(family_dir(name)) for name in GREEDY_FAMILIES]
    cmd = [sys.executable, "-m", "tests.torchrun.vllm_greedy", str(out), *dirs]
    subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    return {name: json.loads((out / f"{name}.json").read_text()) for name in GREEDY_FAMILIES}


@pytest.mark.vllm
@pytest.mark.parametrize("family", GREEDY_FAMILIES)
def test_vllm_greedy_tokens_are_transformers_argmax(vllm_greedy, family_dir, family):
    """vLLM greedy-decodes 80 tokens; fed back through transformers, each is its argmax (or
    within 1e-4 of it: a near-tie may fall either way on other kernels)."""
    model = AutoModelForCausalLM.from_pretrained(family_dir(family), dtype=torch.float32)
    for prompt, response in vllm_greedy[family]:
        assert len(response) == 80
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1]
        chosen = logits.gather(-1, torch.tensor(response)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max() <= 1e-4
