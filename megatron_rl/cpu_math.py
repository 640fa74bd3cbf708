"""The CPU's vector maths settled before a process's first parallel use.

torch's CPU build hands contiguous float32 / float64 unary ops (exp, log, sqrt, tanh, ...) to
oneMKL's vector maths library (VML), which picks each function's kernel on that function's
first call. When the first call runs on several intra-op threads at once, one thread can run
a low-accuracy kernel over its whole share of that call (pytorch/pytorch#188792, oneMKL 2024.2
as torch's wheels bundle it): once per process and function, silently. On a 2-core Intel Xeon
(torch 2.13), a fresh process's first exp of a [90, 1000] fp32 tensor after parallel ops was
1e-4 to 1.5e-4 off in about one process of five (fp32 rounds at 6e-8), and a test of the
log-prob head's entropy failed about once in 30 runs. One call of each function on one
element, on one thread, settles the choice before any concurrent one: 0 of 80 after it
(`tests/test_cpu_math_unit.py`).

`distributed.initialize` calls `warm_up_vector_math` first thing in every trainer process,
`placement.initialize_role` in every engine rank (on the CPU vLLM runs inside that process),
and the test session does. Ray's reward workers are not covered. Pure torch; no process
groups.
"""

from __future__ import annotations

import functools

import torch

VML_FUNCTIONS = (
    "acos",
    "asin",
    "atan",
    "cos",
    "erf",
    "erfc",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log1p",
    "log2",
    "sin",
    "sqrt",
    "tan",
    "tanh",
    "trunc",
)
"""The unary ops torch may route to VML (`aten/src/ATen/cpu/vml.h`; a few of them only in some
builds: calling one that is not routed costs nothing)."""


@functools.cache
def warm_up_vector_math() -> None:
    """Each of `VML_FUNCTIONS` once on a one-element float32 and float64 CPU tensor (on the
    calling thread: one element is below any parallel grain). Once per process."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype, device="cpu")
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
