"""The built-in tool: the policy's Python code run in a sandbox, its output the observation.

As the code-interpreter RL papers use it (ReTool, arXiv 2504.11536; ToRL, arXiv 2503.23383):
stateless calls (each a fresh process, SandboxFusion's model), the output or the error's
last line(s) as the answer. A turn that ends without a call ends the trajectory (the policy
has answered); a call that cannot be parsed, or names another function, is answered with
what was wrong, so the policy can learn the format from it.
"""

from __future__ import annotations

from megatron_rl.envs.base import Action, EnvReset, StepResult, Task
from megatron_rl.envs.sandbox import SandboxConfig, check_isolation, run_code

NAME = "code_interpreter"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": NAME,
        "description": "Runs Python 3 code in a sandbox and returns what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The code to run."}},
            "required": ["code"],
        },
    },
}
"""The tool as chat templates' `tools=` take it (OpenAI's function format)."""


class CodeInterpreter:
    def __init__(self, sandbox: SandboxConfig):
        # isolation "strict" refuses here, in the pool's first worker, before any model
        check_isolation(sandbox)
        self.sandbox = sandbox

    def reset(self, task: Task) -> EnvReset:
        return EnvReset()

    def step(self, state, action: Action) -> StepResult:
        if action.call is None and action.parse_error is None:
            return StepResult(None, done=True, state=state, info={"status": "no_call"})
        if action.call is None:
            return self._refuse(state, action.parse_error)
        code = action.call.arguments.get("code")
        if action.call.name != NAME or not isinstance(code, str):
            return self._refuse(
                state,
                f"unknown call {action.call.name}({', '.join(action.call.arguments)}); "
                f"the tool is {NAME}(code)",
            )
        result = run_code(code, self.sandbox)
        return StepResult(
            result.observation(self.sandbox.error_lines),
            state=state,
            info={
                "status": result.status,
                "seconds": result.seconds,
                "isolation": result.isolation,
            },
        )

    @staticmethod
    def _refuse(state, why: str) -> StepResult:
        return StepResult(f"Error: {why}", state=state, info={"status": "bad_call"})
