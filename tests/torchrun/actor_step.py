"""torchrun worker: one optimizer step with TP=2 moves every actor and critic parameter, the
same weights as megatron-core's own `optimizer.step()`, and the reference policy
(forward-only) never changes. Writes a summary to --out (rank 0)."""

import argparse
import dataclasses

import torch
from megatron.core.optimizer import clip_grads
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.models.hf_config import read_hf_config
from megatron_rl.models.hf_mapping import export_hf_tensors
from megatron_rl.parallel import distributed, vocab_fused
from megatron_rl.procutil import exit_now
from megatron_rl.workers.critic import Critic
from megatron_rl.workers.losses_config import PolicyLossConfig, ValueLossConfig
from megatron_rl.workers.optimizer import OptimConfig
from megatron_rl.workers.policy import Actor, ReferencePolicy
from megatron_rl.workers.spec import RoleModel
from tests.tolerances import FP32_EXACT_ORDER, FP32_MODEL
from tests.torchrun.actor_critic import global_batch


def snapshot(chunks, arch):
    return {k: v.clone() for k, v in export_hf_tensors(chunks, arch)}


def modes(role):
    """The training flags of every module of the role's chunks (one value when they agree)."""
    return sorted({m.training for c in role.chunks for m in c.modules()})


def unchanged(before, after):
    return sorted(k for k in before if torch.equal(before[k], after[k]))


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    arch = read_hf_config(a.hf_dir)
    layout = distributed.ParallelLayout(tensor_model_parallel_size=2)
    ctx = distributed.initialize(layout, arch=arch)
    batch = global_batch(arch.vocab_size)
    optim = OptimConfig(lr=1e-3, weight_decay=0.0)

    model = RoleModel(arch, layout, model_path=a.hf_dir)
    actor = Actor(model, optim=optim)
    reference = ReferencePolicy(model)
    critic = Critic(model, optim=optim)
    actor_before, ref_before = snapshot(actor.chunks, arch), snapshot(reference.chunks, arch)
    critic_before = snapshot(critic.chunks, arch)
    ref_logprobs = reference.compute_logprobs(batch)
    actor_logprobs = actor.compute_logprobs(batch)
    # the head's tile sums compiled (`model.use_fused_kernels`), merged over the TP ranks
    fused_reference = ReferencePolicy(dataclasses.replace(model, use_fused_kernels=True))
    compiled_sums, asked = vocab_fused.compiled_sums, []
    vocab_fused.compiled_sums = lambda device_type: (
        asked.append(device_type) or compiled_sums(device_type)
    )
    fused_logprobs = fused_reference.compute_logprobs(batch)
    vocab_fused.compiled_sums, fused_reference = compiled_sums, None
    fused = {
        "asked_on_its_device": sorted(set(asked)) == [ctx.device.type],
        "compiled": compiled_sums(ctx.device.type) is not None,
        "close": torch.allclose(fused_logprobs, ref_logprobs, **FP32_MODEL),
    }
    mode_sequence = [modes(actor)]

    def pg_loss_and_grad_norm(b):
        m = actor.compute_gradients(b, PolicyLossConfig(), 2)
        actor.optimizer.prepare_grads()
        norm = float(actor.optimizer.get_grad_norm())
        actor.optimizer.zero_grad()
        return m["pg_loss"], norm

    # Rollout-correction weights reach the gradient: all weights 3 -> loss and gradient x 3.
    tis = [pg_loss_and_grad_norm(batch)]
    mode_sequence.append(modes(actor))
    actor.compute_logprobs(batch)
    mode_sequence.append(modes(actor))
    tis += [
        pg_loss_and_grad_norm(
            batch.with_fields(rollout_is_weights=torch.full_like(batch.advantages, 3.0))
        ),
    ]

    # grad_offload: the buffers' storage is released; the next backward re-allocates them
    # (zeroed) and gives the same gradient.
    actor.offload(grads=True)
    offloaded_bytes = sum(
        b.grad_data.untyped_storage().nbytes() for c in actor.chunks for b in c.buffers
    )
    after_offload = pg_loss_and_grad_norm(batch)

    # param_offload: every parameter storage (one per parameter without the distributed
    # optimizer) is emptied; the next use brings the same bits back, and the same gradient.
    weights = [p.detach().clone() for c in actor._chunks for p in c.parameters()]
    actor.offload(params=True)
    reference.offload_params()
    param_offload = {
        "storages": len(actor._params_away.storages),
        "params": len(weights),
        "bytes_while_away": sum(
            p.untyped_storage().nbytes()
            for role in (actor, reference)
            for c in role._chunks
            for p in c.parameters()
        ),
        "host_bytes": actor._params_away.nbytes,
        "param_bytes": sum(w.numel() * w.element_size() for w in weights),
        "loss_and_norm": pg_loss_and_grad_norm(batch),
        "reference_logprobs_equal": torch.equal(reference.compute_logprobs(batch), ref_logprobs),
        "weights_equal": all(
            torch.equal(p, w)
            for p, w in zip(
                (p for c in actor._chunks for p in c.parameters()), weights, strict=True
            )
        ),
    }

    cfg = PolicyLossConfig(nll_coef=0.1, entropy_coef=0.01, kl_loss_coef=0.01)
    # Our step (the norm taken once, `step_with_grad_norm`; the clip inside torch's fused
    # AdamW) against megatron's own `optimizer.step()` (a pass scaling every gradient, then
    # the step), on twins from the same weights, with every gradient clipped: the same
    # weights up to the gradients' one rounding, g / (1 / c) against g * c.
    clipped = OptimConfig(lr=1e-3, weight_decay=0.0, clip_grad=1e-3)
    ours, megatrons = Actor(model, optim=clipped), Actor(model, optim=clipped)
    separate_clips = []  # passes scaling the gradients before our step (none: in it)
    clip = clip_grads.clip_grad_by_total_norm_fp32
    clip_grads.clip_grad_by_total_norm_fp32 = lambda *a, **k: separate_clips.append(clip(*a, **k))
    try:
        ours_metrics = ours.update(batch, cfg, 2)
    finally:
        clip_grads.clip_grad_by_total_norm_fp32 = clip
    megatrons.compute_gradients(batch, cfg, 2)
    megatron_ok, megatron_norm, _ = megatrons.optimizer.step()
    stepped, theirs = snapshot(ours.chunks, arch), snapshot(megatrons.chunks, arch)
    twins = {
        "ours": ours_metrics,
        "megatron": (megatron_ok, float(megatron_norm)),
        "weights_close": stepped.keys() == theirs.keys()
        and all(torch.allclose(stepped[k], theirs[k], **FP32_EXACT_ORDER) for k in stepped),
        "separate_clips": len(separate_clips),
        "unchanged": len(unchanged(actor_before, stepped)),
    }
    actor_metrics = actor.update(batch.with_fields(ref_logprobs=ref_logprobs), cfg, 2)
    critic_metrics = critic.update(batch, ValueLossConfig(), 2)

    # A NaN in the advantages poisons the gradient: the step is skipped on every rank and no
    # weight moves.
    before_nan = snapshot(actor.chunks, arch)
    nan_batch = batch.with_fields(
        ref_logprobs=ref_logprobs, advantages=torch.full_like(batch.advantages, float("nan"))
    )
    nan_metrics = actor.update(nan_batch, cfg, 2)
    nan_unchanged = len(unchanged(before_nan, snapshot(actor.chunks, arch)))
    mode_sequence.append(modes(actor))  # after an update, before the summary's forward passes

    summary = {
        "twins": twins,
        "tis": tis,
        "mode_sequence": mode_sequence,
        "offloaded_bytes": offloaded_bytes,
        "after_offload": after_offload,
        "param_offload": param_offload,
        "nan_metrics": nan_metrics,
        "nan_unchanged": nan_unchanged,
        "initial_logprob_gap": (ref_logprobs - actor_logprobs).abs().max().item(),
        "fused_reference": fused,
        "actor_unchanged": unchanged(actor_before, snapshot(actor.chunks, arch)),
        "actor_params": len(actor_before),
        "critic_unchanged": unchanged(critic_before, snapshot(critic.chunks, arch)),
        "critic_params": len(critic_before),
        "reference_changed": sorted(
            set(ref_before) - set(unchanged(ref_before, snapshot(reference.chunks, arch)))
        ),
        "reference_has_grads": any(
            p.requires_grad for c in reference.chunks for p in c.parameters()
        ),
        "reference_logprob_drift": (reference.compute_logprobs(batch) - ref_logprobs)
        .abs()
        .max()
        .item(),
        "actor_logprob_change": (actor.compute_logprobs(batch) - actor_logprobs).abs().max().item(),
        "actor_metrics": actor_metrics,
        "critic_metrics": critic_metrics,
    }
    if ctx.rank == 0:
        torch.save(summary, a.out)
    distributed.destroy()


if __name__ == "__main__":
    main()
    exit_now()  # past the interpreter's teardown of torch, megatron and vLLM
