"""The child side of `EnvPool`: builds one environment from its config and answers requests.

Run as `python -m megatron_rl.envs.worker` by `child_process.ChildProcess` (its own process
group, the job's stop signals ignored, dead with its rank). Protocol, one message each way per
request: the pool sends the `EnvConfig`, the worker answers READY or ("error", why); then
("reset", task) or ("step", state, action), answered with the `EnvReset` / `StepResult`, or
("error", "Type: message") when the environment raised. The pool enforces time limits by
killing the worker's process group.
"""

from __future__ import annotations

import traceback

from megatron_rl.child_process import serve


def _answer(env, request) -> list:
    """The one reply to `request`."""
    kind, *args = request
    try:
        return [env.reset(*args) if kind == "reset" else env.step(*args)]
    except Exception as e:  # the environment's bug: reported, the worker goes on
        where = traceback.extract_tb(e.__traceback__)[-1]
        return [("error", f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})")]


if __name__ == "__main__":
    serve(lambda config: config.build(), _answer)
