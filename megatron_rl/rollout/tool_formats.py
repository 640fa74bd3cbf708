"""How a policy writes a tool call and how the tool's answer is written back: tool formats.

A format is data: the call's start and end markers (the engine stops at the end marker's
single token, so a turn that ends in a call is told apart by token id, never by matching
text), how the call between them is parsed, and the block the answer is appended as.

| format | the policy writes | the answer appended |
|---|---|---|
| `code` (ReTool / ToRL style, the demo) | `<tool_call>print(1 + 2)</tool_call>` | `<tool_response>3</tool_response>` |
| `hermes` (Qwen2.5, Qwen3, Qwen3-MoE) | `<tool_call>\\n{"name": "code_interpreter", "arguments": {"code": "..."}}\\n</tool_call>` | `<\\|im_end\\|>\\n<\\|im_start\\|>user\\n<tool_response>\\n3\\n</tool_response><\\|im_end\\|>\\n<\\|im_start\\|>assistant\\n` |
| `llama3_python_tag` (Llama-3.1 / 3.2 / 3.3) | `<\\|python_tag\\|>print(1 + 2)<\\|eom_id\\|>` | `<\\|start_header_id\\|>ipython<\\|end_header_id\\|>\\n\\n3<\\|eot_id\\|><\\|start_header_id\\|>assistant<\\|end_header_id\\|>\\n\\n` |

`hermes`' block is Qwen's own chat template's rendering of a tool message after an assistant
turn that ended at `</tool_call>` (the turn's `<|im_end|>` is the block's first token, since
the engine stopped before writing it). The answer's text is encoded once, alone, and appended
to the trajectory's ids: no policy token is ever re-encoded (token in / token out).
`llama3_python_tag` is Llama-3.1's built-in code interpreter as its model card and template
write it (the call ends at `<|eom_id|>`; the answer in the `ipython` role), checked here
against a tiny tokenizer with those tokens, not against a Llama-3.1 checkpoint. Llama's
JSON custom-tool calls and Mistral's [TOOL_CALLS] are not built (refused by name).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from megatron_rl.envs.base import ToolCall
from megatron_rl.envs.code_interpreter import NAME as CODE_INTERPRETER

TruncateSide = Literal["left", "middle", "right"]
TRUNCATE_SIDES = ("left", "middle", "right")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    call_start: str
    call_end: str
    """Where a turn that calls a tool ends: must be one token of the policy's tokenizer."""
    json_call: bool
    """The call is `{"name": ..., "arguments": {...}}` (hermes); else raw code for the
    interpreter (code)."""
    answer_block: str
    """The appended block, `{observation}` standing for the tool's (cut) answer."""
    template_kwargs: tuple[tuple[str, str], ...] = ()
    """How the chat template is told of the tools (`chat_template_kwargs`): (keyword,
    "schemas" for the tools' function schemas | "names" for their names)."""

    def chat_template_kwargs(self, schemas: list[dict]) -> dict:
        """The keywords that make the policy's template write `schemas` into the prompt:
        `tools=` for Qwen's (a system block), `builtin_tools=` for Llama-3.1's built-in
        interpreter ("Environment: ipython")."""
        names = [s["function"]["name"] for s in schemas]
        return {key: schemas if what == "schemas" else names for key, what in self.template_kwargs}

    def parse(self, text: str) -> tuple[ToolCall | None, str | None]:
        """(call, None) from a turn's text that ends with `call_end`, or (None, why)."""
        body = text.removesuffix(self.call_end)
        start = body.rfind(self.call_start)
        if start < 0:
            return None, f"a call must start with {self.call_start} and end with {self.call_end}"
        body = body[start + len(self.call_start) :].strip()
        if not self.json_call:
            return ToolCall(CODE_INTERPRETER, {"code": _unfenced(body)}), None
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return None, f"the call is not valid JSON ({e.msg} at character {e.pos})"
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None, 'the call must be a JSON object {"name": ..., "arguments": {...}}'
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            return None, f"the arguments of {call['name']} must be a JSON object"
        return ToolCall(call["name"], arguments), None

    def answer(self, observation: str) -> str:
        """The block appended after the call (the observation already cut to length)."""
        return self.answer_block.replace("{observation}", observation)


def _unfenced(code: str) -> str:
    """Code without a surrounding Markdown fence (```python ... ```), as models write it."""
    if code.startswith("```") and code.endswith("```") and "\n" in code:
        return code[code.index("\n") + 1 : -3].strip("\n")
    return code


TOOL_FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat(
            "code", "<tool_call>", "</tool_call>", json_call=False,
            answer_block="<tool_response>{observation}</tool_response>",
        ),
        ToolFormat(
            "hermes", "<tool_call>", "</tool_call>", json_call=True,
            answer_block="<|im_end|>\n<|im_start|>user\n<tool_response>\n{observation}\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n",
            template_kwargs=(("tools", "schemas"),),
        ),
        ToolFormat(
            "llama3_python_tag", "<|python_tag|>", "<|eom_id|>", json_call=False,
            answer_block="<|start_header_id|>ipython<|end_header_id|>\n\n{observation}"
            "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
            template_kwargs=(("builtin_tools", "names"),),
        ),
    )
}  # fmt: skip
NOT_BUILT = {
    "llama3_json": "Llama-3.x's JSON custom-tool calls",
    "mistral": "Mistral's [TOOL_CALLS] / [TOOL_RESULTS]",
}


def tool_format(name: str) -> ToolFormat:
    """The format called `name`; the ones not built are refused saying what they are."""
    if name in NOT_BUILT:
        raise ValueError(
            f"tool format {name!r} ({NOT_BUILT[name]}) is not built; use one of "
            f"{sorted(TOOL_FORMATS)}"
        )
    if name not in TOOL_FORMATS:
        raise ValueError(f"unknown tool format {name!r}; expected one of {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]


def call_end_id(fmt: ToolFormat, tokenizer) -> int:
    """The token id the engine stops at (`stop_token_ids`): `fmt.call_end` must be exactly
    one token of the policy's tokenizer (an added token, as in Qwen2.5 and Qwen3), else a
    call could end inside a token and the stop would never fire."""
    ids = tokenizer.encode(fmt.call_end, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(
            f"tool format {fmt.name!r}: {fmt.call_end!r} is {len(ids)} tokens {ids} of "
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r}, expected one (add it "
            "as a token, as Qwen2.5 and Qwen3 have it)"
        )
    return ids[0]


def truncate(text: str, limit: int, side: TruncateSide = "middle") -> str:
    """`text` cut to about `limit` characters, with a marker of what was cut (verl's
    `max_tool_response_length` / `tool_response_truncate_side`): "left" keeps the start,
    "right" the end, "middle" both ends."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    if side == "left":
        return f"{text[:limit]}...(truncated {cut} characters)"
    if side == "right":
        return f"(truncated {cut} characters)...{text[-limit:]}"
    head = limit // 2
    return f"{text[:head]}...(truncated {cut} characters)...{text[len(text) - (limit - head) :]}"
