"""The CPU compatibility layer: lets megatron-core run on CPU with the gloo backend.

megatron-core assumes CUDA in a handful of places. On a machine without CUDA we patch exactly
those, and nothing else; `apply()` is a no-op when CUDA is available, so GPU runs execute
megatron-core untouched. The patches (each tied to a call site in megatron-core 0.16.1):

1. `torch.cuda.current_device()` returns "cpu": megatron allocates buffers with
   `device=torch.cuda.current_device()` (tensor_parallel, p2p communication, rotary embedding).
2. `torch.cuda.synchronize()` is a no-op (timers, schedules).
3. The pipeline schedules create `torch.zeros(..., device="cuda")` for the token counter, the
   unfused softmax builds its default causal mask with `device="cuda"`, and the fp32
   optimizer and its gradient-norm helpers allocate scalars on "cuda", and tied embeddings
   split over pipeline stages are synchronised through `weight.data.cuda()`: those run
   under a torch-function mode that maps a "cuda" device argument to "cpu". The mode is
   scoped to those calls only, so other code (vLLM, our own) never pays for it. Inside a
   schedule it is lifted again around megatron's `forward_step` and `backward_step` (the
   model's forward, the loss, the backward): nothing there names "cuda" (the causal-mask
   builders keep a scope of their own), and the mode's Python call on each of a step's
   ~1,500 ops cost a fifth of a small update's time.
4. `clip_grad_by_total_norm_fp32` asserts `grad.type() == 'torch.cuda.FloatTensor'`; it is
   replaced by the same scaling written device-agnostically.
5. Activation recompute (`tensor_parallel.random.CheckpointFunction`) saves and restores the
   CUDA generator's state next to the CPU one; on CPU the CPU generator is the only one, and
   the same function already saves and restores it, so the CUDA half becomes a no-op.
6. The MoE alltoall token dispatcher (`MoEAlltoAllTokenDispatcher`) creates a CUDA stream at
   construction and copies its split sizes to the host on it: on CPU no stream is made, and
   the split sizes become the NumPy arrays the CUDA path hands to `all_to_all` (left as
   tensors, gloo's all_to_all_single takes them as tensors and fails).

`define_missing_te_names()` is separate, and applied on CUDA too: megatron's MoE router
tests `te_general_gemm is not None`, a name only defined when Transformer Engine imports.

What is left out: fp16/bf16 optimizer wrappers and the distributed optimizer, which check for
`torch.cuda.*Tensor` types; on CPU we train in fp32 with `use_distributed_optimizer=False`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _pop_mode_temporarily
from torch.overrides import _get_current_function_mode as _current_function_mode

_APPLIED = False

WRITTEN_FOR = "0.16"
"""The megatron-core minor release whose internals the patches below name (0.16.x)."""


def check_megatron_version(version: str) -> None:
    """Refuse a megatron-core other than 0.16.x: the patches replace private functions by
    name, and another release may have moved or changed them without any error at patch
    time (the run would then fail, or silently use CUDA paths, later)."""
    if version != WRITTEN_FOR and not version.startswith(WRITTEN_FOR + "."):
        raise RuntimeError(
            f"megatron_rl's CPU compatibility layer was written for megatron-core "
            f"{WRITTEN_FOR}.x, but megatron-core {version} is installed: install "
            f"megatron-core=={WRITTEN_FOR}.1 (the `cpu` extra), or run on CUDA, where the "
            "layer is not applied"
        )


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return False


class CudaToCpuDeviceMode(TorchFunctionMode):
    """Rewrites `device="cuda"` keyword arguments of torch calls to "cpu", and makes
    `tensor.cuda()` return the tensor unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _on_cpu_devices(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with CudaToCpuDeviceMode():
            return fn(*args, **kwargs)

    wrapper.__megatron_rl_cpu_compat__ = True
    return wrapper


def _without_device_mode(fn: Callable) -> Callable:
    """`fn` with `CudaToCpuDeviceMode` lifted where it is the innermost mode."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not isinstance(_current_function_mode(), CudaToCpuDeviceMode):
            return fn(*args, **kwargs)
        with _pop_mode_temporarily():
            return fn(*args, **kwargs)

    wrapper.__megatron_rl_cpu_compat__ = True
    return wrapper


def _wrap_attr(module: Any, name: str, wrap: Callable = _on_cpu_devices) -> None:
    fn = getattr(module, name)
    if not getattr(fn, "__megatron_rl_cpu_compat__", False):
        setattr(module, name, wrap(fn))


def _clip_grad_by_total_norm_fp32(
    parameters, max_norm, total_norm, use_decoupled_grad: bool = False
) -> None:
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff >= 1.0:
        return
    grads = [g.detach() for g in (getattr(p, attr, None) for p in parameters) if g is not None]
    if grads:
        torch._foreach_mul_(grads, clip_coeff)


def _dtoh_without_streams(self, point: str, tokens_per_expert=None):
    """`MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize` on CPU: the tensors already
    are on the host; the split sizes become arrays at the point the CUDA path copies them."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if torch.is_tensor(value):
                setattr(self, name, value.numpy())
    return tokens_per_expert


def define_missing_te_names() -> None:
    """Define megatron's MoE router's `te_general_gemm` as None when Transformer Engine is
    absent (its import failed, so the name was never bound and the router raises NameError).
    Harmless with TE, where the name exists. CPU or GPU alike."""
    from megatron.core.transformer.moe import moe_utils  # why: megatron loads late

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def apply() -> bool:
    """Patch megatron-core for CPU execution when CUDA is absent.

    Returns True when the layer is (or already was) active, False on a CUDA machine, where
    nothing is touched. Idempotent.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    # why: megatron-core is imported only on the CPU path that patches it (seconds at start-up)
    import megatron.core.optimizer as optimizer_pkg
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_mod
    from megatron.core.package_info import __version__ as megatron_version
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    check_megatron_version(megatron_version)
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    for name in (
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ):
        _wrap_attr(schedules, name)
    for name in ("forward_step", "backward_step"):
        _wrap_attr(schedules, name, _without_device_mode)
    # fused_softmax imported the mask builders by name, so patch both bindings.
    for module in (transformer_utils, fused_softmax):
        _wrap_attr(module, "get_default_causal_mask")
        _wrap_attr(module, "get_sliding_window_causal_mask")
    _wrap_attr(optimizer_pkg, "get_megatron_optimizer")
    _wrap_attr(LanguageModule, "setup_embeddings_and_output_layer")
    _wrap_attr(optimizer_mod.FP32Optimizer, "step")
    # optimizer.py imported the clip helpers by name, so patch both bindings.
    for module in (clip_grads, optimizer_mod):
        _wrap_attr(module, "get_grad_norm_fp32")
        _wrap_attr(module, "count_zeros_fp32")
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32
    tp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(
        0, dtype=torch.uint8, device="cpu"
    )
    tp_random._set_cuda_rng_state = lambda *args, **kwargs: None
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on CPU"  # never None: not made
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _dtoh_without_streams

    _APPLIED = True
    return True


def is_active() -> bool:
    """Whether the CPU compatibility layer has been applied in this process."""
    return _APPLIED
