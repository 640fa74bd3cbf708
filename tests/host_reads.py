"""`HostReads`: records the calls that read a tensor's values back to the host.

On a GPU each such read (`.item()`, `.tolist()`, `bool(t)`, `torch.equal`, `nonzero`, a
boolean mask's index, `repeat_interleave` without its output size) makes the host wait for
every kernel queued before it, so the device idles while the host queues the next ones. On
the CPU, where the tests run, nothing waits; this names each read and where it was made, so
a test can say which code may read and which may not."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_REPO = str(Path(__file__).resolve().parents[1]) + "/"
_CPU_COMPAT = _REPO + "megatron_rl/parallel/cpu_compat.py"
_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "masked_select"})
"""aten ops whose result depends on the values read back (`.item()`, `bool(t)`, `int(t)`,
`float(t)` all dispatch `_local_scalar_dense`)."""


class HostReads:
    """Within it (`with HostReads() as reads:`), `reads.sites` counts each read by
    "op path:function", the first caller outside torch (a path relative to site-packages or
    the repository). Seen at the dispatcher, so in autograd's backward too; `.tolist()`,
    which copies without the dispatcher on the CPU, is seen where Python calls it (not in a
    backward)."""

    def __init__(self):
        self.sites: Counter[str] = Counter()
        self._modes = (_Dispatched(self.sites), _ToList(self.sites))

    def __enter__(self) -> HostReads:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _Dispatched(TorchDispatchMode):
    def __init__(self, sites: Counter):
        super().__init__()
        self.sites = sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if _reads(name, args, kwargs):
            self.sites[f"{name} {_caller()}"] += 1
        return func(*args, **kwargs)


class _ToList(TorchFunctionMode):
    def __init__(self, sites: Counter):
        super().__init__()
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "tolist":
            self.sites[f"tolist {_caller()}"] += 1
        return func(*args, **(kwargs or {}))


def _reads(name: str, args, kwargs) -> bool:
    if name in _OPS:
        return True
    if name.startswith("index") and len(args) > 1:  # a boolean mask's index: nonzero inside
        index = args[1] if isinstance(args[1], tuple | list) else (args[1],)
        masks = [i for i in index if getattr(i, "dtype", None) == torch.bool]
        # `t[mask] = 0`: torch fills through the one mask (`masked_fill_`), nothing read
        fill = name.startswith("index_put") and len(index) == 1 and args[2].dim() == 0
        return bool(masks) and not fill
    if name == "repeat_interleave":  # its output's size is the repeats' sum, unless given
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    return False


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and _in_torch(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename.split("site-packages/")[-1].removeprefix(_REPO)
    return f"{path}:{frame.f_code.co_name}"


def _in_torch(filename: str) -> bool:
    # the CPU-only compatibility layer forwards calls: the caller is whoever called it
    return "/torch/" in filename or filename in (__file__, _CPU_COMPAT)
