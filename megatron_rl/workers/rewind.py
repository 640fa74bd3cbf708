"""A host copy of what a trainable role's optimizer updates change, so that a stop request
between a step's mini-batches can put the role back where the step began.

What an update changes: the model's parameters, the optimizer's master weights (bf16
training; the distributed optimizer's fp32 shards), its per-parameter state (Adam's moments
and step) and the learning-rate schedule (its update count and each param group's lr and
weight decay). `UpdateSnapshot.take` copies all of it into host buffers (pinned on GPU, kept
for the next step's copy) before the step's first optimizer update; `restore` copies it back
into whatever tensors the role holds then: megatron's optimizer offload (`offload_to_cpu`)
replaces the state's tensor objects, so the copy is addressed by position (parameter order,
state key), never by tensor identity. Byte copies, no cast: the restored role is bit-equal.

A parameter whose optimizer state did not exist yet (torch's Adam makes it at the first step)
loses the state made since, so the next update starts it afresh as the uninterrupted run does.
Left out: the gradient buffers (zeroed by every update before use) and module buffers (RoPE
frequencies, never trained).

Cost (docs/reliability.md): host memory of the weights plus the optimizer shard, per role and
GPU, and one device-to-host copy of it per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_rl.models.dist_checkpoint import inner_optimizers


def _main_params(optimizer) -> list[tuple[torch.optim.Optimizer, torch.Tensor]]:
    """(torch optimizer, parameter) for every parameter the optimizers update, in order."""
    return [
        (inner, p)
        for inner in inner_optimizers(optimizer)
        for group in inner.param_groups
        for p in group["params"]
    ]


@dataclass
class UpdateSnapshot:
    """One role's update state at some point, in host memory; `take` again overwrites it."""

    host: list[torch.Tensor] = field(default_factory=list)
    """Host copies, in the order `take` walks: model params, then main params that are not model
    params (bf16 training's masters), then the tensors of the optimizer's state."""
    state_keys: list[tuple[str, ...] | None] = field(default_factory=list)
    """Per main parameter: the keys of its optimizer state (None: it had none yet)."""
    state_devices: list[torch.device] = field(default_factory=list)
    """Per state tensor: its device, for a state made anew on restore."""
    state_values: dict[tuple[int, str], object] = field(default_factory=dict)
    """State entries that are not tensors, by (main parameter index, key)."""
    schedule: tuple[int, list[tuple[float, float]]] | None = None
    """(the schedule's update count, [(lr, weight_decay)] per param group)."""

    @property
    def nbytes(self) -> int:
        """Host memory held."""
        return sum(h.numel() * h.element_size() for h in self.host)

    @staticmethod
    def _params(chunks, optimizer) -> list[torch.Tensor]:
        """Trained model params (a frozen one, LoRA's base, never changes), then the main
        params that are other tensors (never one twice)."""
        model = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
        seen = {id(p) for p in model}
        return model + [p for _, p in _main_params(optimizer) if id(p) not in seen]

    def take(self, chunks, optimizer, scheduler) -> None:
        """Copy the role's update state (its `chunks`, megatron `optimizer` and schedule)."""
        tensors = self._params(chunks, optimizer)
        self.state_keys, self.state_devices, self.state_values = [], [], {}
        for i, (inner, p) in enumerate(_main_params(optimizer)):
            state = inner.state.get(p)
            if not state:
                self.state_keys.append(None)
                continue
            keys = tuple(sorted(state))
            self.state_keys.append(keys)
            for k in keys:
                if isinstance(state[k], torch.Tensor):
                    tensors.append(state[k])
                    self.state_devices.append(state[k].device)
                else:
                    self.state_values[(i, k)] = state[k]
        on_gpu = torch.cuda.is_available()
        if [(h.shape, h.dtype) for h in self.host] != [(t.shape, t.dtype) for t in tensors]:
            self.host = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=on_gpu)
                for t in tensors
            ]
        for host, t in zip(self.host, tensors, strict=True):
            host.copy_(t.detach(), non_blocking=on_gpu)
        if on_gpu:  # landed before the optimizer step that follows changes the tensors
            torch.cuda.synchronize()
        groups = [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups]
        self.schedule = (scheduler.num_steps, groups)

    def restore(self, chunks, optimizer, scheduler) -> None:
        """Put back what `take` copied, into the role's current tensors."""
        if self.schedule is None:
            raise RuntimeError("UpdateSnapshot.restore before any take")
        on_gpu = torch.cuda.is_available()
        params = self._params(chunks, optimizer)
        for p, h in zip(params, self.host, strict=False):
            p.detach().copy_(h, non_blocking=on_gpu)
        host, devices = iter(self.host[len(params) :]), iter(self.state_devices)
        main = _main_params(optimizer)
        for i, ((inner, p), keys) in enumerate(zip(main, self.state_keys, strict=True)):
            if keys is None:
                inner.state.pop(p, None)  # made since: the next step starts it afresh
                continue
            state = inner.state[p]
            for k in set(state) - set(keys):
                del state[k]
            for k in keys:
                if (i, k) in self.state_values:
                    state[k] = self.state_values[(i, k)]
                    continue
                h, device = next(host), next(devices)
                now = state.get(k)
                if isinstance(now, torch.Tensor) and (now.shape, now.dtype) == (h.shape, h.dtype):
                    now.copy_(h, non_blocking=on_gpu)
                else:
                    state[k] = h.to(device, copy=True)
        if on_gpu:  # the host buffers are written again by the next take
            torch.cuda.synchronize()
        num_steps, groups = self.schedule
        scheduler.num_steps = num_steps
        for g, (lr, wd) in zip(optimizer.param_groups, groups, strict=True):
            g["lr"], g["weight_decay"] = lr, wd
