"""Unit tier: `EnvPool` with real worker processes and the scripted environments of
`tests/envs/scripted_envs.py`: state carried by the caller, time limits that kill the
worker and leave the other trajectories alone, the environment's errors and deaths
reported, a stop that cancels everything, and configs refused by name."""

from __future__ import annotations

import os
import time

import pytest

from megatron_rl.envs.base import Action, EnvReset, StepResult, Task
from megatron_rl.envs.config import EnvConfig
from megatron_rl.envs.pool import EnvFailure, EnvPool, EnvWorkerError
from megatron_rl.envs.sandbox import SandboxConfig

ENVS = "tests.envs.scripted_envs"


def pool_of(cls: str, **options) -> EnvPool:
    return EnvPool(EnvConfig(type="python", path=f"{ENVS}:{cls}", **options))


def act(text: str) -> Action:
    return Action(text=text, ended_by="call")


def drain(pool: EnvPool, limit_s: float = 30.0) -> dict:
    """Every outcome until nothing is pending, by key."""
    out, end = {}, time.monotonic() + limit_s
    while pool.pending:
        assert time.monotonic() < end, "the pool never answered"
        out.update(pool.poll(0.5))
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_steps_carry_the_callers_state_over_any_worker():
    pool = pool_of("Counter", kwargs={"turns": 2}, num_workers=2)
    try:
        pool.submit("a", ("reset", Task("sums")))
        pool.submit("b", ("reset", Task("maze")))
        resets = drain(pool)
        assert resets["a"] == EnvReset(state=0, observation="task sums")
        states = {k: r.state for k, r in resets.items()}
        for turn in (1, 2):
            for key in ("a", "b"):
                pool.submit(key, ("step", states[key], act(f"{key}{turn}")))
            steps = drain(pool)
            for key, result in steps.items():
                assert result.observation == f"step {turn}: {key}{turn}"
                assert (result.state, result.reward, result.done) == (turn, 0.5, turn == 2)
                states[key] = result.state
    finally:
        pool.close()


@pytest.mark.parametrize("on_timeout", ["observe", "terminate"])
def test_a_step_that_never_answers_is_killed_and_the_others_go_on(on_timeout):
    pool = pool_of("Sleeper", num_workers=2, step_timeout_s=1.0, on_timeout=on_timeout)
    try:
        pool.submit("hang", ("step", "kept", act("3600")))
        pool.submit("fast", ("step", None, act("0.1")))
        first = pool.poll(5.0)
        assert [key for key, _ in first] == ["fast"]  # answered while the other hangs
        hung_pid = next(w.proc.pid for w in pool.workers if w.job is not None)
        outcomes = drain(pool, limit_s=5.0)
        result = outcomes["hang"]
        assert result.info == {
            "status": "timeout",
            "error": "environment did not answer within 1 s",
        }
        assert result.state == "kept"  # the trajectory goes on from before the step
        if on_timeout == "observe":
            assert (result.observation, result.done) == (result.info["error"], False)
        else:
            assert (result.observation, result.done) == (None, True)
        assert not alive(hung_pid) and pool.restarts == 1
        pool.submit("next", ("step", None, act("0")))  # the fresh worker answers
        assert drain(pool)["next"].observation == "slept 0"
    finally:
        pool.close()


def test_the_environments_exceptions_and_deaths_end_their_trajectory_with_the_reason():
    pool = pool_of("Faulty", num_workers=1)
    try:
        pool.submit("raise", ("step", 7, act("raise")))
        pool.submit("exit", ("step", 8, act("exit")))
        pool.submit("reset", ("reset", Task("row 3")))
        outcomes = drain(pool)
        error = outcomes["raise"]
        assert (error.observation, error.done, error.state) == (None, True, 7)
        assert error.info["status"] == "env_error"
        assert error.info["error"].startswith("ValueError: cannot step on 'raise' (")
        assert "scripted_envs.py:" in error.info["error"]
        died = outcomes["exit"]
        assert died.info == {
            "status": "died",
            "error": "environment worker died (exit code 3)",
        }
        assert died.observation == died.info["error"] and not died.done
        assert outcomes["reset"] == EnvFailure("env_error", outcomes["reset"].message)
        assert outcomes["reset"].message.startswith("KeyError: 'row 3'")
    finally:
        pool.close()


def test_a_reset_that_never_answers_is_a_failure_not_a_hang():
    pool = pool_of("Sleeper", num_workers=1, step_timeout_s=1.0)
    try:
        pool.submit("t", ("reset", Task("hang")))
        assert drain(pool, limit_s=5.0)["t"] == EnvFailure(
            "timeout", "environment did not answer within 1 s"
        )
    finally:
        pool.close()


def test_cancel_all_kills_the_running_steps_and_drops_the_queue():
    pool = pool_of("Sleeper", num_workers=1)
    try:
        for key in ("a", "b", "c"):
            pool.submit(key, ("step", None, act("3600")))
        assert pool.poll(0.3) == [] and pool.pending == 3
        running = pool.workers[0].proc.pid
        pool.cancel_all()
        assert pool.pending == 0 and not alive(running)
        pool.submit("d", ("step", None, act("0")))
        assert drain(pool)["d"].observation == "slept 0"
    finally:
        pool.close()


def test_an_environment_that_cannot_be_built_fails_the_pool_at_start_naming_it():
    with pytest.raises(EnvWorkerError, match=r"Unbuildable'.*RuntimeError: no such maze"):
        pool_of("Unbuildable")
    with pytest.raises(
        EnvWorkerError,
        match=r"^environment 'no_such_pkg.envs:Maze': cannot import module 'no_such_pkg.envs'",
    ):
        EnvPool(EnvConfig(type="python", path="no_such_pkg.envs:Maze"))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"type": "gym"}, "type must be one of"),
        ({"type": "python"}, "type python needs path"),
        ({"path": "a.b:C"}, "path is for type python"),
        ({"kwargs": {"x": 1}}, "kwargs is for type python"),
        ({"num_workers": 0}, "num_workers must be >= 1"),
        ({"on_timeout": "retry"}, "on_timeout must be one of"),
        ({"step_timeout_s": 6.0}, r"step_timeout_s=6 must be >= sandbox.timeout_s \+ 5"),
    ],
)
def test_bad_environment_configs_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        EnvConfig(**options)


def test_a_step_result_that_neither_observes_nor_ends_is_refused():
    with pytest.raises(ValueError, match="must return an observation"):
        StepResult(None)


def test_the_code_interpreter_answers_calls_through_the_pool():
    """The built-in tool end to end: a parsed call runs in the sandbox from a pool worker;
    a malformed call is answered with what was wrong; a turn without a call ends it."""
    from megatron_rl.rollout.tool_formats import tool_format

    code = tool_format("code")
    pool = EnvPool(EnvConfig(num_workers=2, sandbox=SandboxConfig(timeout_s=2.0)))
    try:
        turns = {
            "sum": "Let me add.<tool_call>print(48213 + 90577)</tool_call>",
            "error": "<tool_call>print(a)</tool_call>",
            "loop": "<tool_call>while True: pass</tool_call>",
            "bad": "print(1)</tool_call>",
        }
        for key, text in turns.items():
            call, error = code.parse(text)
            pool.submit(key, ("step", None, Action(text, "call", call, error)))
        pool.submit("answer", ("step", None, Action("The answer is 138790.", "eos")))
        out = drain(pool)
        assert out["sum"].observation == "138790" and out["sum"].info["status"] == "ok"
        assert out["error"].observation == "NameError: name 'a' is not defined"
        assert out["loop"].observation == "TimeoutError: stopped after 2 s"
        assert out["bad"].observation.startswith("Error: a call must start with <tool_call>")
        assert (out["answer"].observation, out["answer"].done) == (None, True)
        assert not any(r.done for k, r in out.items() if k != "answer")
    finally:
        pool.close()


def test_a_stop_request_while_tools_run_kills_them_and_aborts_the_rollout():
    from megatron_rl.preemption import StepAborted
    from megatron_rl.rollout.agent import EnvSteps

    pool = pool_of("Sleeper", num_workers=2)
    try:
        asks, busy = iter([False, False]), []

        def should_stop() -> bool:  # the third ask: a stop request arrives mid-tool
            busy[:] = [w.proc.pid for w in pool.workers if w.job is not None]
            return next(asks, True)

        requests = {k: ("step", None, act("3600")) for k in ("a", "b", "c")}
        with pytest.raises(StepAborted, match="rollout/tools"):
            EnvSteps(pool).run(requests, should_stop)
        assert len(busy) == 2 and not any(alive(pid) for pid in busy)
        assert pool.pending == 0 and all(alive(w.proc.pid) for w in pool.workers)
    finally:
        pool.close()
