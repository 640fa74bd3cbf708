"""The child side of `EnvPool`: builds one environment from its config and answers requests.

A plain `python -m megatron_rl.envs.worker READ_FD WRITE_FD`, not a fork of the rank (which
holds threads, process groups and a vLLM engine), as `rewards/isolated.py`'s children. It
ignores the job's stop signals (the rank stops it) and dies with its rank.

Protocol, one message each way per request: the pool sends the `EnvConfig`, the worker
answers READY or ("error", why); then ("reset", task) or ("step", state, action), answered
with the `EnvReset` / `StepResult`, or ("error", "Type: message") when the environment
raised. The pool enforces time limits by killing the worker's process group.
"""

from __future__ import annotations

import sys
import traceback
from multiprocessing.connection import Connection

from megatron_rl.procutil import outlive_job_signals

READY = "ready"


def _answer(env, request):
    kind, *args = request
    try:
        return env.reset(*args) if kind == "reset" else env.step(*args)
    except Exception as e:  # the environment's bug: reported, the worker goes on
        where = traceback.extract_tb(e.__traceback__)[-1]
        return ("error", f"{type(e).__name__}: {e} ({where.filename}:{where.lineno})")


def main(read_fd: int, write_fd: int) -> None:
    outlive_job_signals()
    inbox, out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    config = inbox.recv()
    try:
        env = config.build()
    except ValueError as e:  # the config's own refusal (`load_callable`): it names the path
        out.send(("error", str(e)))
        return
    except Exception as e:
        out.send(("error", f"{type(e).__name__}: {e}"))
        return
    out.send(READY)
    while True:
        try:
            request = inbox.recv()
        except EOFError:  # the pool closed the pipe: done
            return
        out.send(_answer(env, request))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
