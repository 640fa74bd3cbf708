"""Environments of multi-turn rollouts: what answers the policy's tool calls.

- `base`: the interface (`Environment`: reset / step with explicit, picklable state), the
  action and step records;
- `config`: `EnvConfig`, the `rollout.multi_turn.env` entry (built-in type or import path);
- `pool`: `EnvPool`, environment steps in killable worker processes with a time limit each;
- `code_interpreter`: the built-in tool, Python code run by `sandbox`;
- `sandbox`, `sandbox_child`: one fresh, limited, isolated process per code call.

The agent loop that drives them from the rollout engine is `rollout/agent.py`'s.
"""
