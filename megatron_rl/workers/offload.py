"""A role's parameters to host memory and back, while a colocated rollout engine needs the
device (verl's `param_offload`).

megatron-core 0.16.1 moves parameters only out of the distributed optimizer's contiguous
param buffer (`_ParamAndGradBuffer.offload_to_cpu(move_params=True)`); without the
distributed optimizer `param_data` is None and every parameter has a storage of its own.
Working on storages makes both cases one: each distinct storage under the chunks'
parameters (one per DDP buffer with the distributed optimizer, one per parameter otherwise)
is copied byte for byte into a host buffer (pinned on GPU, kept for the next offload) and
resized to 0 bytes; `restore` re-allocates it and copies the bytes back. The Parameter
objects, `param.data` and every view of those storages (megatron's bucket views, the
distributed optimizer's shard views) stay the same objects; only the memory under them
goes and comes back, so the weights are bit-equal by construction (bytes, no cast).

Left out: module buffers (RoPE frequencies: KiB) and the gradient buffers and optimizer
state, which `TrainableRole.offload` frees with megatron's own calls. Reading a parameter
while it is away is undefined (a segfault on CPU), which is why `MegatronRole.chunks`
restores before it hands the chunks out.
"""

from __future__ import annotations

import torch


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """[nbytes] uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ParamOffload:
    """Host copies of the parameter storages of some model chunks."""

    def __init__(self):
        self.storages: list[torch.UntypedStorage] = []
        self.host: list[torch.Tensor] = []
        """[nbytes] uint8 per storage, reused by every offload of the same layout."""
        self.offloaded = False

    @staticmethod
    def distinct_storages(chunks: list) -> list[torch.UntypedStorage]:
        seen, out = set(), []
        for chunk in chunks:
            for p in chunk.parameters():
                storage = p.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out.append(storage)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes in host memory (the device bytes freed while offloaded)."""
        return sum(h.numel() for h in self.host)

    def offload(self, chunks: list) -> None:
        if self.offloaded:
            return
        storages = self.distinct_storages(chunks)
        fixed = [i for i, s in enumerate(storages) if not s.resizable()]
        if fixed:  # before anything moved: all or nothing
            raise RuntimeError(
                f"param_offload: {len(fixed)} parameter storage(s) cannot be resized (memory "
                "mapped from a file?): copy the weights into the model's own tensors first"
            )
        on_gpu = torch.cuda.is_available()
        if [s.nbytes() for s in storages] != [h.numel() for h in self.host]:
            self.host = [
                torch.empty(s.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=on_gpu)
                for s in storages
            ]
        for storage, host in zip(storages, self.host, strict=True):
            host.copy_(_byte_view(storage), non_blocking=on_gpu)
        if on_gpu:  # the copies must have landed before the device memory goes
            torch.cuda.synchronize()
        for storage in storages:
            storage.resize_(0)
        self.storages, self.offloaded = storages, True

    def restore(self) -> None:
        if not self.offloaded:
            return
        on_gpu = torch.cuda.is_available()
        for storage, host in zip(self.storages, self.host, strict=True):
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=on_gpu)
        if on_gpu:  # the host buffers are written again by the next offload
            torch.cuda.synchronize()
        self.storages, self.offloaded = [], False
