"""The MoE router's losses of one gradient pass, for the logs.

megatron-core adds the load-balancing and z-losses to the router's gradient itself (never to
the loss the schedule returns, so `pg_loss` stays the policy's) and records each MoE layer's
value, unscaled by its coefficient, in a process-wide tracker. Read once per
`compute_gradients`, reported as `moe/<name>`: the mean over MoE layers and micro-batches,
averaged over data-parallel ranks, as Megatron-LM logs them; then the tracker is emptied.
"""

from __future__ import annotations


def router_loss_metrics(num_microbatches: int, num_moe_layers: int) -> dict[str, float]:
    """Every rank of the role calls this (the reduction is over pipeline and data-parallel
    ranks); {} when no router loss was recorded."""
    # why: megatron-core takes seconds to import: loaded on first use
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    metrics = {}
    dp = parallel_state.get_data_parallel_group()
    for name in sorted(tracker):
        total = tracker[name]["values"].sum().clone()
        if tracker[name].get("reduce_group") is None:  # megatron averaged the others over DP
            torch.distributed.all_reduce(total, group=dp, op=torch.distributed.ReduceOp.AVG)
        metrics[f"moe/{name}"] = total.item() / (num_moe_layers * num_microbatches)
    tracker.clear()  # not only zeroed (megatron's clear): a loss switched off is not reported
    return metrics
