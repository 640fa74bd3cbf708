"""Distributed tier: LoRA adapters on the Megatron linears (`models/lora.py`) at TP2+SP,
TP2, PP2+VPP2, DP2 and, on a mixture of experts, EP2, against Hugging Face + PEFT and against
one process (tests/torchrun/lora_layouts.py sets the same adapted model at every layout).

- the log-probs with adapters equal PEFT's on the exported adapter (`models/peft_export.py`);
  with them off, the base model's (the reference policy, `AdapterOffReference`);
- the merged weights (what the weight sync sends) are the adapted model as a plain one;
- only adapters train: DDP's buffers and the optimizer hold them alone, no frozen weight
  has a gradient; the critic's value head trains too;
- one step at TP2+SP, TP2, PP2+VPP2, DP2 moves the adapters as one process does;
- a checkpoint holds the adapters alone and resumes at another layout."""

import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoModelForCausalLM

from checkpoints_convert.lora import LoraMergedReader
from examples.tiny_model import TinyModelSpec, make_tiny_model
from megatron_rl.launch import run_torchrun
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import HFCheckpointReader
from megatron_rl.models.presets import lora_layer_param_count
from tests.tolerances import FP32_MODEL, assert_close
from tests.torchrun.actor_critic import global_batch
from tests.torchrun.lora_layouts import DENSE_LORA

pytestmark = pytest.mark.distributed

DENSE_LAYOUTS = ("tp2_sp", "tp2", "pp2_vpp2", "dp2")
WORKER = "tests.torchrun.lora_layouts"


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """A 4-layer Qwen2 (q/k/v biases) and its results: one process, then TP2+SP (which
    saves its checkpoint after the step), PP2+VPP2 and DP2 (which resume from it)."""
    root = tmp_path_factory.mktemp("lora_dense")
    hf = make_tiny_model(root / "hf", TinyModelSpec(seed=40))
    out = root / "out"
    out.mkdir()
    run_torchrun(
        WORKER, ["--hf-dir", str(hf), "--out-dir", str(out), "--layouts", "single"], nproc=1
    )
    layouts = ",".join(DENSE_LAYOUTS)
    args = ["--hf-dir", str(hf), "--out-dir", str(out), "--layouts", layouts]
    run_torchrun(WORKER, [*args, "--save-from", "tp2_sp"])
    return hf, out


@pytest.fixture(scope="module")
def moe(family_dir, tmp_path_factory):
    hf = family_dir("qwen3-moe")
    out = tmp_path_factory.mktemp("lora_moe")
    run_torchrun(WORKER, ["--hf-dir", str(hf), "--out-dir", str(out), "--layouts", "ep2"])
    return hf, out


def whole(out, layout, key):
    """A per-DP-rank result put back in the global batch's row order."""
    parts = [torch.load(out / layout / f"rank{r}.pt") for r in range((layout != "single") + 1)]
    rows = {p["rows"]: p[key] for p in parts}
    return torch.cat([rows[k] for k in sorted(rows)])


def hf_logprobs(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(lp, (1, 0))  # aligned to tokens, as the trainer's


def response(values, batch):
    return values[batch.response_mask.bool()]


def check_against_peft(hf, out, layout):
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    batch = global_batch(base.config.vocab_size)
    on, off = whole(out, layout, "on"), whole(out, layout, "off")
    base_lp = hf_logprobs(base, batch.input_ids)
    assert_close(response(off, batch), response(base_lp, batch), FP32_MODEL, f"{layout} off")
    peft = PeftModel.from_pretrained(base, out / layout / "adapter")
    peft_lp = hf_logprobs(peft, batch.input_ids)
    assert_close(response(on, batch), response(peft_lp, batch), FP32_MODEL, f"{layout} on")
    assert (response(on - off, batch)).abs().max() > 0.1  # the adapters change the policy
    # the on -> off -> on switch leaves the adapters as they were
    assert torch.equal(on, whole(out, layout, "on_again"))
    return peft.merge_and_unload()


@pytest.mark.parametrize("layout", ["single", *DENSE_LAYOUTS])
def test_dense_logprobs_equal_peft_and_the_base_with_adapters_off(dense, layout):
    hf, out = dense
    merged_hf = check_against_peft(hf, out, layout)
    merged = torch.load(out / layout / "rank0.pt")["merged"]
    assert sorted(merged) == sorted(merged_hf.state_dict())
    for name, tensor in merged_hf.state_dict().items():
        assert_close(merged[name], tensor, FP32_MODEL, f"{layout} merged {name}")


def test_moe_attention_adapters_at_ep2_and_experts_refused(moe):
    hf, out = moe
    check_against_peft(hf, out, "ep2")
    refusal = torch.load(out / "ep2" / "rank0.pt")["experts_refused"]
    assert "mlp.experts" in refusal and "linear_qkv" in refusal


@pytest.mark.parametrize("layout", ["single", *DENSE_LAYOUTS])
def test_only_the_adapters_train(dense, layout):
    hf, out = dense
    r = torch.load(out / layout / "rank0.pt")
    assert r["trained"] and all(n.endswith((".lora_A", ".lora_B")) for n in r["trained"])
    assert r["frozen"] > 0
    assert r["ddp_numel"] == r["optimizer_numel"] == r["trained_numel"]
    # the memory planner's count of them (rank 0 of PP2+VPP2 holds 2 of the 4 layers)
    arch, tp = read_hf_config(hf), 2 if layout.startswith("tp2") else 1
    layers = arch.num_layers // (2 if layout == "pp2_vpp2" else 1)
    assert r["trained_numel"] == layers * lora_layer_param_count(arch, DENSE_LORA.rank, tp)
    assert r["frozen_grads"] == [] and r["update_ok"]
    heads = [n for n in r["critic_trained"] if not n.endswith((".lora_A", ".lora_B"))]
    # the value head trains in full (rank 0 of PP2 holds the first stage: no head)
    assert heads == ([] if layout == "pp2_vpp2" else ["output_layer.weight"])


@pytest.mark.parametrize("layout", DENSE_LAYOUTS)
def test_one_step_moves_the_adapters_as_one_process(dense, layout):
    _, out = dense
    one = load_file(out / "single" / "stepped" / "adapter_model.safetensors")
    here = load_file(out / layout / "stepped" / "adapter_model.safetensors")
    start = load_file(out / "single" / "adapter" / "adapter_model.safetensors")
    assert sorted(here) == sorted(one)
    assert max((one[k] - start[k]).abs().max() for k in one) > 1e-3  # the step moved them
    for k in one:
        assert_close(here[k], one[k], FP32_MODEL, f"{layout} {k}")
    assert_close(whole(out, layout, "stepped_on"), whole(out, "single", "stepped_on"), FP32_MODEL)


@pytest.mark.parametrize("layout", ["pp2_vpp2", "dp2"])
def test_checkpoint_holds_the_adapters_alone_and_resumes_at_another_layout(dense, layout):
    _, out = dense
    keys = FileSystemReader(str(out / "ckpt" / "model")).read_metadata().state_dict_metadata
    assert keys and all(k.endswith((".lora_A", ".lora_B")) for k in keys), sorted(keys)
    assert any(k.startswith("optimizer.state.exp_avg.") for k in keys)
    saved = load_file(out / "tp2_sp" / "stepped" / "adapter_model.safetensors")
    resumed = load_file(out / layout / "resumed" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(resumed)
    for k in saved:
        assert torch.equal(saved[k], resumed[k]), k


@pytest.mark.e2e  # the journeys' tier (~35 s), to keep `make test` under 20 minutes
def test_converters_export_the_checkpoint_merged_and_as_its_adapter_and_import_it_back(
    dense, tmp_path
):
    """`megatron_to_hf` on the adapters-only checkpoint: merged into its base (= PEFT's
    merge of the same adapter), and with --adapter the adapter itself; `hf_to_megatron
    --lora-dir`'s reader merges that adapter into the base to the same tensors."""
    hf, out = dense
    ckpt, saved = out / "ckpt", out / "tp2_sp" / "stepped"
    for extra, dest in (([], "merged"), (["--adapter"], "adapter")):
        cmd = ["--ckpt-dir", str(ckpt), "--out-dir", str(tmp_path / dest), *extra]
        subprocess.run(
            [sys.executable, "-m", "checkpoints_convert.megatron_to_hf", *cmd],
            check=True,
            capture_output=True,
            timeout=300,
        )
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    adapter = load_file(saved / "adapter_model.safetensors")
    assert sorted(exported) == sorted(adapter)
    assert all(torch.equal(exported[k], adapter[k]) for k in adapter)
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    peft_merged = PeftModel.from_pretrained(base, saved).merge_and_unload().state_dict()
    converted = HFCheckpointReader(tmp_path / "merged")
    reimported = LoraMergedReader(HFCheckpointReader(hf), tmp_path / "adapter")
    assert sorted(converted.keys()) == sorted(peft_merged)
    for name, tensor in peft_merged.items():
        assert_close(converted(name), tensor, FP32_MODEL, name)
        assert_close(reimported(name), tensor, FP32_MODEL, name)
