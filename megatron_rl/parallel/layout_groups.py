"""A second set of Megatron process groups in the same world, for a role on a layout of its
own (a distillation teacher at TP 8 beside a student at TP 4).

megatron-core reads its groups from module globals in `parallel_state` (our schedules, the
vocabulary-parallel log-prob head and the data-parallel collectives do too), and
`initialize_model_parallel` builds one set. `LayoutGroups.build(layout)` has every rank build
another set over the same world, keeps it aside and puts the job's back; `active()` swaps
it in around whatever the role does: building its model, loading its checkpoint, a forward
pass. Everything inside then sees the role's TP / PP / DP ranks and groups, with no argument
threaded through.

How a batch crosses from the job's layout to the role's: `workers/own_layout.py`.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass

from megatron_rl.parallel.distributed import ParallelLayout, initialize_model_parallel

_STATE = re.compile(r"_[A-Z][A-Z0-9_]*")
"""parallel_state's module globals: groups, their ranks and the cached sizes (all None, or an
empty dict, before `initialize_model_parallel`)."""


def _parallel_state():
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    return parallel_state


def _capture() -> dict[str, object]:
    ps = _parallel_state()
    return {k: v for k, v in vars(ps).items() if _STATE.fullmatch(k)}


def _apply(state: dict[str, object]) -> None:
    ps = _parallel_state()
    for name, value in state.items():
        setattr(ps, name, value)


def _pristine(state: dict[str, object]) -> dict[str, object]:
    return {k: {} if isinstance(v, dict) else None for k, v in state.items()}


@dataclass
class LayoutGroups:
    """Megatron's groups for `layout` over the job's world, kept aside from the job's."""

    layout: ParallelLayout
    state: dict[str, object]

    @classmethod
    def build(cls, layout: ParallelLayout, world_size: int, arch=None) -> LayoutGroups:
        """Collective: every rank of the world calls it, in the same order (each group is a
        `new_group`). `layout` is checked against the world and `arch` first."""
        layout.validate(world_size, arch)
        job = _capture()
        _apply(_pristine(job))  # initialize_model_parallel refuses groups already set
        try:
            initialize_model_parallel(layout)
            return cls(layout, _capture())
        finally:
            _apply(job)

    @contextmanager
    def active(self):
        """parallel_state holds these groups inside, the job's again after (what the role
        set up lazily inside, e.g. megatron's global buffer, stays with its groups)."""
        job = _capture()
        _apply(self.state)
        try:
            yield self
        finally:
            self.state = _capture()
            _apply(job)
