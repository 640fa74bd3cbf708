"""The random state of seeded vLLM requests: read when a stop cuts them, put back into the
requests that continue them, so a continued response draws the tokens the uninterrupted
request would have drawn (same seed, same state), not a new stream.

vLLM's V1 model runner gives each seeded request its own `torch.Generator`
(`CachedRequestState.generator`, made in `_update_states` from the seed) and advances it by
every token it samples. `read_worker` returns, per request, the generator's state and how
many tokens the runner has sampled with it: a state is only usable when that count equals
the tokens the caller received (an engine scheduling asynchronously may have sampled one
more); `install_worker` wraps the runner's `_update_states` so that a request added later
under a given id gets a given state (`restore_worker`) before its first sample. A continued
response is re-prefilled, so its next logits come from a prefill rather than a decode step:
equal up to the kernels' rounding, which can flip a sample only at a near-tie.

Runners without `_update_states` (vLLM's Model Runner V2) are not hooked: continuations
there draw from their own `continuation_seed` instead (`install_worker` says False).

Functions named `*_worker` run on every vLLM worker through `LLM.collective_rpc`; the state
lives on the worker's model runner.
"""

from __future__ import annotations

import torch

_ATTR = "_megatron_rl_sampler_states"


def install_worker(worker) -> bool:
    """Hook this worker's runner (once); False where it cannot be hooked."""
    runner = worker.model_runner
    if hasattr(runner, _ATTR):
        return True
    if not hasattr(runner, "_update_states") or not hasattr(runner, "requests"):
        return False
    pending: dict[str, torch.Tensor] = {}
    update = runner._update_states

    def update_states(scheduler_output, *args, **kwargs):
        out = update(scheduler_output, *args, **kwargs)
        for rid in [r for r in pending if r in runner.requests]:
            generator = runner.requests[rid].generator
            state = pending.pop(rid)
            if generator is not None:
                generator.set_state(state)
        return out

    runner._update_states = update_states
    setattr(runner, _ATTR, pending)
    return True


def read_worker(worker, request_ids: list[str]) -> dict[str, tuple[int, bytes]]:
    """(tokens sampled, generator state) of each of `request_ids` this runner holds with
    a generator (a seeded request)."""
    requests = worker.model_runner.requests
    found = {}
    for rid in request_ids:
        state = requests.get(rid)
        if state is not None and state.generator is not None:
            found[rid] = (
                len(state.output_token_ids),
                state.generator.get_state().numpy().tobytes(),
            )
    return found


def restore_worker(worker, states: dict[str, bytes]) -> None:
    """Give the requests added under these ids these generator states."""
    pending = getattr(worker.model_runner, _ATTR)
    for rid, state in states.items():
        pending[rid] = torch.frombuffer(bytearray(state), dtype=torch.uint8)
