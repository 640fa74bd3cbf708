"""GPU tier (skipped without CUDA; the TE/FP8 tests also without Transformer Engine).

Single process, world size 1. Never a substitute for the CPU tests: they check what only a
GPU has (bf16 kernels, the TE layer spec, FP8 GEMMs).
"""

import pytest
import torch

from megatron_rl.models.gpt import (
    PrecisionConfig,
    build_gpt_model_chunks,
    transformer_engine_available,
)
from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import load_hf_into_megatron
from megatron_rl.models.lm_head import emit_hidden_states
from megatron_rl.parallel import distributed
from megatron_rl.workers.losses_config import PolicyLossConfig
from megatron_rl.workers.policy import Actor
from megatron_rl.workers.spec import RoleModel
from tests.tolerances import BF16_MODEL, assert_close

pytestmark = pytest.mark.gpu
needs_te = pytest.mark.skipif(not transformer_engine_available(), reason="needs Transformer Engine")


@pytest.fixture
def single_rank(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "29533")
    yield
    distributed.destroy()


def tokens(arch, b=2, s=64):
    return torch.randint(
        0, arch.vocab_size, (b, s), generator=torch.Generator().manual_seed(0)
    ).cuda()


def cuda_global_batch(arch):
    """The workers tests' global batch (tests/torchrun/actor_critic.py), on the GPU."""
    from tests.torchrun.actor_critic import global_batch

    batch = global_batch(arch.vocab_size)
    return batch.with_fields(
        **{k: v.cuda() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    )


def forward(chunks, ids):
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with torch.no_grad():
        return chunks[0](ids, pos, None)[..., :500].float()


def test_bf16_actor_step_runs_and_matches_fp32_logits(single_rank, tiny_model_dir):
    arch = read_hf_config(tiny_model_dir)
    distributed.initialize(distributed.ParallelLayout(), arch=arch)
    ids = tokens(arch)
    fp32 = build_gpt_model_chunks(arch, distributed.ParallelLayout(), use_transformer_engine=False)
    load_hf_into_megatron(fp32, tiny_model_dir, arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    actor = Actor(
        RoleModel(arch, distributed.ParallelLayout(), model_path=tiny_model_dir, precision=bf16)
    )
    emit_hidden_states(actor.chunks, on=False)  # logits, as the fp32 model gives
    assert_close(forward(actor.chunks, ids), forward(fp32, ids), BF16_MODEL)
    emit_hidden_states(actor.chunks, on=True)
    batch = cuda_global_batch(arch)
    metrics = actor.update(batch, PolicyLossConfig(nll_coef=0.1), num_microbatches=2)
    assert metrics["update_ok"] and torch.isfinite(torch.tensor(metrics["grad_norm"]))


@needs_te
def test_te_spec_matches_local_spec_in_bf16(single_rank, tiny_model_dir):
    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    local = build_gpt_model_chunks(arch, layout, bf16, use_transformer_engine=False)
    te = build_gpt_model_chunks(arch, layout, bf16, use_transformer_engine=True)
    load_hf_into_megatron(local, tiny_model_dir, arch)
    load_hf_into_megatron(te, tiny_model_dir, arch)
    ids = tokens(arch)
    assert_close(forward(te, ids), forward(local, ids), BF16_MODEL)


@needs_te
def test_te_grouped_experts_load_and_match_the_local_experts_in_bf16(single_rank, family_dir):
    """A mixture of experts with TE's grouped-GEMM experts (`TEGroupedMLP`, names
    `linear_fc1.weight{j}`) loads the same Hugging Face tensors as the CPU layout
    (`SequentialMLP`) and computes the same logits; a bf16 step trains it."""
    hf = family_dir("qwen3-moe")
    arch = read_hf_config(hf)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    local = build_gpt_model_chunks(arch, layout, bf16, use_transformer_engine=False)
    te = build_gpt_model_chunks(arch, layout, bf16, use_transformer_engine=True)
    assert any(".linear_fc1.weight0" in n for n, _ in te[0].named_parameters())
    load_hf_into_megatron(local, hf, arch)
    load_hf_into_megatron(te, hf, arch)
    ids = tokens(arch)
    assert_close(forward(te, ids), forward(local, ids), BF16_MODEL)
    actor = Actor(RoleModel(arch, layout, model_path=hf, precision=bf16))
    metrics = actor.update(cuda_global_batch(arch), PolicyLossConfig(), num_microbatches=2)
    assert metrics["update_ok"]


@needs_te
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
    reason="needs Hopper",
)
def test_fp8_actor_step_runs(single_rank, tiny_model_dir):
    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    fp8 = PrecisionConfig(params_dtype=torch.bfloat16, fp8="hybrid", fp8_recipe="tensorwise")
    actor = Actor(RoleModel(arch, layout, model_path=tiny_model_dir, precision=fp8))
    batch = cuda_global_batch(arch)  # S=23: padded to 16-multiples by the actor
    metrics = actor.update(batch, PolicyLossConfig(), num_microbatches=2)
    assert metrics["update_ok"]


def test_distributed_optimizer_checkpoint_resumes_exactly(single_rank, tiny_model_dir, tmp_path):
    """The distributed optimizer's fp32 masters and Adam moments go into the role's
    distributed checkpoint (megatron's sharded optimizer state, models/dist_checkpoint.py).
    Step, save, step again; a fresh actor loaded from the save takes the same second step."""
    from megatron_rl.models.dist_checkpoint import load_role, save_role
    from megatron_rl.workers.optimizer import OptimConfig

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    optim = OptimConfig(lr=1e-3, use_distributed_optimizer=True)
    batch = cuda_global_batch(arch)
    loss = PolicyLossConfig(nll_coef=0.1)

    model = RoleModel(arch, layout, model_path=tiny_model_dir, precision=bf16)
    first = Actor(model, optim=optim)
    first.update(batch, loss, num_microbatches=2)
    save_role(first.chunks, first.optimizer, tmp_path / "actor")
    first.update(batch, loss, num_microbatches=2)

    resumed = Actor(model, optim=optim)
    load_role(resumed.chunks, resumed.optimizer, tmp_path / "actor")
    resumed.update(batch, loss, num_microbatches=2)
    for a, b in zip(first.chunks[0].parameters(), resumed.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_bf16_master_weights_step_with_torchs_fused_adamw_as_with_its_default(
    single_rank, tiny_model_dir
):
    """On CUDA the fp32 master weights of bf16 training step with torch's fused AdamW, their
    step counts on the device, with no host synchronisation in the step (the master weights'
    copy into the model's is one foreach copy, the clip its `grad_scale`); two clipped
    updates give the weights torch's default (foreach, counts on the host, the clip a pass
    of its own) gives; an optimizer offload and restore leaves the
    counts where the fused kernel reads them."""
    from megatron_rl.models.dist_checkpoint import inner_optimizers
    from megatron_rl.workers.optimizer import OptimConfig, step_with_grad_norm

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    model = RoleModel(arch, layout, model_path=tiny_model_dir, precision=bf16)
    optim = OptimConfig(lr=1e-3, clip_grad=1e-3)  # every step clips: inside the fused kernel
    fused, default = Actor(model, optim=optim), Actor(model, optim=optim)
    groups = [g for inner in inner_optimizers(fused.optimizer) for g in inner.param_groups]
    assert groups and all(g["fused"] is True for g in groups)
    for inner in inner_optimizers(default.optimizer):
        for g in inner.param_groups:
            g["fused"] = None
    batch, loss = cuda_global_batch(arch), PolicyLossConfig(nll_coef=0.1)
    for _ in range(2):
        default.update(batch, loss, num_microbatches=2)
        fused.compute_gradients(batch, loss, num_microbatches=2)
        assert not fused.optimizer.prepare_grads()
        norm = float(fused.optimizer.get_grad_norm())  # the update's one read of the norm
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
        try:
            assert step_with_grad_norm(fused.optimizer, norm)  # clipped as `update` clips
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(fused.chunks[0].parameters(), default.chunks[0].parameters(), strict=True):
        assert_close(a.float(), b.float(), BF16_MODEL)
    fused.offload(optimizer=True)
    fused.restore_offloaded()
    for inner in inner_optimizers(fused.optimizer):
        steps = [s["step"] for s in inner.state.values()]
        assert steps and all(s.is_cuda and s.item() == 2 for s in steps)
    for inner in inner_optimizers(default.optimizer):
        assert all(s["step"].device.type == "cpu" for s in inner.state.values())


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_offloaded_grads_and_optimizer_state_give_the_same_steps(
    single_rank, tiny_model_dir, distributed_optimizer
):
    """grad_offload / optimizer_offload / param_offload free device memory between updates:
    the device memory drops by at least the parameters' bytes, which wait in pinned host
    memory (one storage per DDP param buffer with the distributed optimizer, one per
    parameter without), and two steps with offloading in between equal two steps without."""
    from megatron_rl.workers.optimizer import OptimConfig

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    optim = OptimConfig(lr=1e-3, use_distributed_optimizer=distributed_optimizer)
    batch = cuda_global_batch(arch)
    loss = PolicyLossConfig()
    model = RoleModel(arch, layout, model_path=tiny_model_dir, precision=bf16)
    plain = Actor(model, optim=optim)
    offloaded = Actor(model, optim=optim)
    for _ in range(2):
        plain.update(batch, loss, num_microbatches=2)
        offloaded.update(batch, loss, num_microbatches=2)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        offloaded.offload(grads=True, optimizer=True, params=True)
        away = offloaded._params_away
        params = [p for c in offloaded._chunks for p in c.parameters()]
        assert all(p.is_cuda and p.untyped_storage().nbytes() == 0 for p in params)
        assert all(h.is_pinned() and h.device.type == "cpu" for h in away.host)
        buffers = sum(len(c.buffers) for c in offloaded._chunks)
        assert len(away.storages) == (buffers if distributed_optimizer else len(params))
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        assert offloaded.offloaded_param_bytes >= param_bytes
        assert before - torch.cuda.memory_allocated() > param_bytes
    for a, b in zip(plain.chunks[0].parameters(), offloaded.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_a_rewind_undoes_bf16_updates_bit_for_bit(
    single_rank, tiny_model_dir, distributed_optimizer
):
    """The stopped step's rewind on the GPU path: bf16 parameters with fp32 masters (the distributed
    optimizer's shards, or megatron's Float16 optimizer), the copy in pinned host memory, the
    optimizer offloaded and brought back between the copy and the rewind (new tensor objects).
    After the rewind, redoing the updates equals an actor that never rewound."""
    from megatron_rl.workers.optimizer import OptimConfig

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    optim = OptimConfig(lr=1e-3, lr_warmup_steps=4, use_distributed_optimizer=distributed_optimizer)
    batch = cuda_global_batch(arch)
    loss = PolicyLossConfig()
    model = RoleModel(arch, layout, model_path=tiny_model_dir, precision=bf16)
    plain = Actor(model, optim=optim)
    rewound = Actor(model, optim=optim)
    for actor in (plain, rewound):
        actor.update(batch, loss, num_microbatches=2)
    rewound.snapshot_updates()
    assert all(h.is_pinned() for h in rewound.update_snapshot.host)
    for _ in range(2):
        rewound.update(batch, loss, num_microbatches=2)
    rewound.offload(optimizer=True)
    rewound.restore_offloaded()
    rewound.rewind_updates()
    for a, b in zip(plain.chunks[0].parameters(), rewound.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)
    for _ in range(2):
        for actor in (plain, rewound):
            actor.update(batch, loss, num_microbatches=2)
    for a, b in zip(plain.chunks[0].parameters(), rewound.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)


def test_host_batches_enter_roles_on_their_device_and_collectives_run_under_nccl(
    single_rank, tiny_model_dir
):
    """The device policy on a real GPU: a batch built in host memory (as the trainer builds
    it from vLLM's samples) moves where it enters a role; results come back on the device;
    the collectives' metadata is made on the device, which NCCL requires."""
    from megatron_rl.parallel.collectives import (
        any_rank,
        data_parallel_min,
        global_token_counts,
        reduce_over_ranks,
    )
    from megatron_rl.workers.critic import Critic
    from megatron_rl.workers.losses_config import ValueLossConfig
    from tests.torchrun.actor_critic import global_batch

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    ctx = distributed.initialize(layout, arch=arch)
    assert ctx.backend == "nccl" and distributed.device().type == "cuda"
    batch = global_batch(arch.vocab_size)
    assert batch.input_ids.device.type == "cpu"
    actor, critic = (
        Actor(RoleModel(arch, layout, model_path=tiny_model_dir)),
        Critic(RoleModel(arch, layout, model_path=tiny_model_dir)),
    )
    assert actor.device.type == critic.device.type == "cuda"
    logprobs = actor.compute_logprobs(batch, num_microbatches=2)
    values = critic.compute_values(batch)
    assert logprobs.device.type == values.device.type == "cuda"
    counts = global_token_counts(batch.to(actor.device).response_mask, None)
    assert counts.device.type == "cuda" and counts[0] == batch.response_mask.sum()
    assert actor.update(batch, PolicyLossConfig(), num_microbatches=2)["update_ok"]
    assert critic.update(batch, ValueLossConfig())["update_ok"]
    assert any_rank(True) and not any_rank(False) and data_parallel_min(3) == 3
    assert reduce_over_ranks({"x": 1.0}) == {"x": 1.0}


@pytest.mark.parametrize("packed", [False, True])
def test_the_micro_batches_of_an_update_make_one_host_synchronisation(
    single_rank, tiny_model_dir, packed
):
    """Forward, losses and backward of every micro-batch run with the host ahead of the
    device: in the actor's (PPO with dual clip, positive-sample NLL, entropy and KL terms)
    and the critic's `compute_gradients` the one synchronising call after the split is the
    metrics' single copy to the host. A read in a micro-batch's loss would make the host wait
    for the device's whole forward before it queues the backward. Packed micro-batches
    (`use_remove_padding`) read their rows' lengths and copy their segments' bounds at the
    split, before any forward is queued; attention then slices by the host's bounds."""
    import warnings

    from megatron_rl.data import batch as batch_module
    from megatron_rl.data import packing
    from megatron_rl.workers import roles
    from megatron_rl.workers.critic import Critic
    from megatron_rl.workers.losses_config import ValueLossConfig

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    actor = Actor(RoleModel(arch, layout, model_path=tiny_model_dir, precision=bf16))
    critic = Critic(RoleModel(arch, layout, model_path=tiny_model_dir, precision=bf16))
    actor.use_remove_padding = critic.use_remove_padding = packed
    batch = cuda_global_batch(arch)
    policy = PolicyLossConfig(dual_clip_c=3.0, nll_coef=0.1, entropy_coef=0.01, kl_loss_coef=0.1)
    at_split = (batch_module.__file__, packing.__file__)  # before any forward is queued
    for role, cfg in ((actor, policy), (critic, ValueLossConfig())):
        role.compute_gradients(batch, cfg, num_microbatches=2)  # compiles the head's backward
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                metrics = role.compute_gradients(batch, cfg, num_microbatches=2)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
        after_split = [s for s in syncs if not s.startswith(at_split)]
        assert metrics and len(after_split) == 1, syncs
        assert after_split[0].startswith(roles.__file__), syncs
        assert packed or len(syncs) == 1, syncs


def test_a_bad_mask_on_the_device_is_refused_without_a_host_synchronisation():
    """`check_mask` on the device checks the values there: no host read, and a mask that is
    not 0/1 stops the process with a device-side assertion (it leaves CUDA unusable, hence
    a process of its own)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import torch\n"
        "from megatron_rl.algorithms.checks import check_mask\n"
        "good = torch.ones(2, 3, device='cuda')\n"
        "bad = torch.full((2, 3), 0.5, device='cuda')\n"
        "torch.cuda.synchronize()\n"
        "torch.cuda.set_sync_debug_mode('error')\n"
        "check_mask(good)\n"
        "check_mask(bad)\n"
        "torch.cuda.set_sync_debug_mode('default')\n"
        "print('queued', flush=True)\n"
        "torch.cuda.synchronize()\n"
        "print('not refused', flush=True)\n"
    )
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert "queued" in run.stdout and "not refused" not in run.stdout, run.stdout + run.stderr
    assert run.returncode != 0 and "device-side assert" in run.stderr, run.stderr


def test_bf16_long_sequence_packed_equals_unpacked_and_holds_no_s_squared(
    single_rank, tiny_model_dir
):
    """Fused attention, chunked log-probs and packing in bf16 on CUDA: the log-probs of two
    rows packed equal theirs unpacked, and a 16k-token update of the tiny actor stays far
    below what [heads, s, s] fp32 scores of one layer alone would take (4 GiB)."""
    arch = read_hf_config(tiny_model_dir)
    distributed.initialize(distributed.ParallelLayout(), arch=arch)
    bf16 = PrecisionConfig(params_dtype=torch.bfloat16)
    actor = Actor(
        RoleModel(arch, distributed.ParallelLayout(), model_path=tiny_model_dir, precision=bf16)
    )
    batch = cuda_global_batch(arch)
    unpacked = actor.compute_logprobs(batch, num_microbatches=2)
    actor.use_remove_padding = True
    packed = actor.compute_logprobs(batch, num_microbatches=2)
    seen = torch.arange(batch.seq_length, device="cuda") < batch.sequence_lengths()[:, None]
    assert_close(packed, torch.where(seen, unpacked, 0.0), BF16_MODEL)

    from tools.bench_train_step import synthetic_batch, to_device

    long = to_device(synthetic_batch(arch, 1, 16384), torch.device("cuda"))
    torch.cuda.reset_peak_memory_stats()
    metrics = actor.update(long, PolicyLossConfig(nll_coef=0.1), num_microbatches=1)
    assert metrics["update_ok"]
    assert torch.cuda.max_memory_allocated() < 2 * 2**30


def test_packed_attention_in_one_flash_kernel_equals_one_call_a_segment(monkeypatch):
    """On CUDA in bf16, packed segments go to flash attention's variable-length kernel in
    one call (`models/attention.py`): its outputs and gradients equal one fused-kernel call
    a segment (the CPU's way), at qwen2.5-0.5b's heads (14 query, 2 key/value, 64 wide)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_rl.models import attention
    from tests.models.test_attention_unit import _module

    bounds = (0, 300, 317, 1000, 1024)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    params.host_bounds = bounds
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = [
        torch.randn(1024, n, 64, generator=g, device="cuda", dtype=torch.bfloat16)
        for n in (14, 2, 2)
    ]
    grad_out = torch.randn(1024, 14 * 64, generator=g, device="cuda", dtype=torch.bfloat16)
    assert attention.flash_varlen_runs(qkv[0])
    results = []
    for varlen in (True, False):
        monkeypatch.setattr(attention, "flash_varlen_runs", lambda query, on=varlen: on)
        inputs = [x.clone().requires_grad_(True) for x in qkv]
        out = _module()(*inputs, None, packed_seq_params=params)
        out.backward(grad_out)
        results.append([out.detach(), *(x.grad for x in inputs)])
    for name, ours, theirs in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert theirs.abs().max() > 0.1  # not a degenerate comparison
        assert_close(ours.float(), theirs.float(), BF16_MODEL, name)


@pytest.mark.parametrize("sums", ["eager", "compiled"])
@pytest.mark.parametrize("keep_probs", [False, True])
@pytest.mark.parametrize("entropy", ["in_loss", "not_in_loss", "not_calculated"])
def test_bf16_chunked_logprobs_entropy_and_gradients_equal_the_fp32_full_logits(
    single_rank, entropy, keep_probs, sums
):
    """The tiled head in bf16 on CUDA (its backward's maths compiled where Triton is, the
    GEMMs writing fp32; tiles of 64 tokens x 300 rows: four blocks of rows) against the full
    logits in fp32 of the same bf16 inputs, and at most twice as far from them as whole bf16
    logits, the unchunked head, are; the entropy in the loss, out of it, or not calculated
    (`calculate_entropy=False`: the compiled backward without one); backward from
    recomputed logits or from the probabilities forward kept in bf16 (`keep_probs`); the
    forward's tile sums eager or compiled (`model.use_fused_kernels`)."""
    from torch.utils._triton import has_triton

    from megatron_rl.parallel import vocab, vocab_fused
    from megatron_rl.parallel.vocab import (
        chunked_logprobs_entropy,
        vocab_parallel_entropy,
        vocab_parallel_logprobs,
    )

    distributed.initialize(distributed.ParallelLayout())
    assert (vocab_fused.compiled_grad("cuda") is not None) == has_triton()
    assert (vocab_fused.compiled_kept_grad("cuda") is not None) == has_triton()
    assert (vocab_fused.compiled_sums("cuda") is not None) == has_triton()
    # the gradients' GEMMs sum into fp32 accumulators in place (else: a bf16 product cast)
    assert vocab._fp32_gemm("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    vocab_size, padded, hidden_size, n = 1000, 1024, 64, 300
    hidden = torch.randn(n, hidden_size, generator=g).cuda().bfloat16()
    weight = (torch.randn(padded, hidden_size, generator=g) * 0.3).cuda().bfloat16()
    labels = torch.randint(0, vocab_size, (n,), generator=g).cuda()
    coef = torch.randn(2, n, generator=g).cuda()

    def run(how: str):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if how == "chunked":
            calculate = entropy != "not_calculated"
            lp, ent = chunked_logprobs_entropy(
                h,
                w,
                labels,
                vocab_size,
                0.8,
                tile=(64, 300),
                calculate_entropy=calculate,
                keep_probs=keep_probs,
                compiled_sums=sums == "compiled",
            )
            assert (ent is None) != calculate
        else:
            logits = h.float() @ w.float().t() if how == "fp32" else h @ w.t()
            lp = vocab_parallel_logprobs(logits, labels, vocab_size, 0.8)
            ent = vocab_parallel_entropy(logits, vocab_size, 0.8)
        loss = (coef[0] * lp).sum() + ((coef[1] * ent).sum() if entropy == "in_loss" else 0.0)
        loss.backward()
        kept = (lp, h.grad, w.grad) if entropy == "not_calculated" else (lp, ent, h.grad, w.grad)
        return [x.detach().float() for x in kept]

    fp32, chunked, whole_bf16 = run("fp32"), run("chunked"), run("bf16")
    # the compiled forms ran: one that failed (vocab_fused.FallBack) would test the eager ones
    assert vocab_fused.FELL_BACK == []
    for got, bf16, want in zip(chunked, whole_bf16, fp32, strict=True):
        assert_close(got, want, BF16_MODEL)
        assert (got - want).abs().max() <= 2 * (bf16 - want).abs().max()


def test_bf16_layer_forward_equals_megatrons_to_the_bit(single_rank, tiny_model_dir):
    """`models/layer.py`'s decoder-layer forward against megatron-core's own on CUDA in bf16
    (the CPU test is fp32): the same logits and every gradient to the bit, and the same
    logits in eval mode without gradients, where the residual sums run in place."""
    from tools.bench_train_step import megatron_own

    arch = read_hf_config(tiny_model_dir)
    layout = distributed.ParallelLayout()
    distributed.initialize(layout, arch=arch)
    chunks = build_gpt_model_chunks(arch, layout, PrecisionConfig(params_dtype=torch.bfloat16))
    load_hf_into_megatron(chunks, tiny_model_dir, arch)
    ids = tokens(arch)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)

    def run():
        chunks[0].zero_grad()
        logits = chunks[0](ids, pos, None)
        logits.float().logsumexp(-1).mean().backward()
        grads = {n: p.grad.clone() for n, p in chunks[0].named_parameters()}
        chunks[0].eval()
        try:
            evaluated = forward(chunks, ids)
        finally:
            chunks[0].train()
        return logits.detach(), grads, evaluated

    ours = run()
    with megatron_own("layer"):
        theirs = run()
    assert all(layer.__dict__.get("_lean_forward") for layer in chunks[0].decoder.layers)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[2], theirs[2])
    assert sorted(ours[1]) == sorted(theirs[1])
    for name, grad in theirs[1].items():
        assert torch.equal(ours[1][name], grad), name
