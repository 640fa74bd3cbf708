"""Unit tier: tool formats: calls parsed from a turn's text, each malformed call with
one clear reason, the answer block, the stop token found in a real tokenizer, truncation."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from megatron_rl.envs.base import ToolCall
from megatron_rl.rollout.tool_formats import call_end_id, tool_format, truncate

CODE, HERMES = tool_format("code"), tool_format("hermes")


@pytest.mark.parametrize(
    "text, code",
    [
        ("Add them.<tool_call>print(48213 + 90577)</tool_call>", "print(48213 + 90577)"),
        ("<tool_call>\n```python\nx = 2\nprint(x)\n```\n</tool_call>", "x = 2\nprint(x)"),
        # the last call of the turn is the one that ended it
        ("<tool_call>a</tool_call> then <tool_call>b</tool_call>", "b"),
    ],
)
def test_code_calls_are_the_text_between_the_markers(text, code):
    assert CODE.parse(text) == (ToolCall("code_interpreter", {"code": code}), None)


def test_hermes_calls_are_json_with_a_name_and_arguments():
    call = (
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}}\n</tool_call>'
    )
    assert HERMES.parse("I will compute.\n" + call) == (
        ToolCall("code_interpreter", {"code": "print(1)"}),
        None,
    )
    as_string = '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
    assert HERMES.parse(as_string) == (ToolCall("f", {"x": 1}), None)


@pytest.mark.parametrize(
    "fmt, text, why",
    [
        (CODE, "print(1)</tool_call>", "a call must start with <tool_call> and end with"),
        (HERMES, "<tool_call>{name: f}</tool_call>", "the call is not valid JSON (Expecting"),
        (HERMES, "<tool_call>[1, 2]</tool_call>", 'the call must be a JSON object {"name"'),
        (HERMES, '<tool_call>{"name": "f", "arguments": 3}</tool_call>', "the arguments of f must"),
    ],
)
def test_a_malformed_call_gives_one_reason_and_no_call(fmt, text, why):
    call, error = fmt.parse(text)
    assert call is None and error.startswith(why)


def test_the_answer_blocks():
    assert CODE.answer("138790") == "<tool_response>138790</tool_response>"
    assert HERMES.answer("3") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_formats_not_built_or_unknown_are_refused_by_name():
    with pytest.raises(ValueError, match=r"'mistral' \(Mistral's \[TOOL_CALLS\]"):
        tool_format("mistral")
    with pytest.raises(ValueError, match=r"unknown tool format 'json'; expected one of"):
        tool_format("json")


def test_the_call_end_must_be_one_token_of_the_policys_tokenizer(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match=r"'</tool_call>' is \d+ tokens .* expected one"):
        call_end_id(CODE, tokenizer)
    tokenizer.add_tokens(["</tool_call>"])
    assert call_end_id(CODE, tokenizer) == tokenizer.convert_tokens_to_ids("</tool_call>")


@pytest.mark.parametrize(
    "side, expected",
    [
        ("left", "abcd...(truncated 6 characters)"),
        ("right", "(truncated 6 characters)...ghij"),
        ("middle", "ab...(truncated 6 characters)...ij"),
    ],
)
def test_truncation_keeps_the_chosen_side_and_says_how_much_was_cut(side, expected):
    assert truncate("abcdefghij", 4, side) == expected
    assert truncate("abc", 4, side) == "abc"


def test_llamas_built_in_interpreter_format(tmp_path):
    """`llama3_python_tag` (Llama-3.1's model card): the call is the code after
    `<|python_tag|>`, ending at `<|eom_id|>`; the answer is an `ipython` message; the template
    is told of the interpreter by `builtin_tools` (Qwen's by `tools`). A tiny Llama-3
    tokenizer with those two tokens added stands for the real one (not at hand)."""
    from examples.tiny_model import TinyModelSpec, build_tokenizer
    from megatron_rl.envs.code_interpreter import TOOL_SCHEMA

    fmt = tool_format("llama3_python_tag")
    call, error = fmt.parse("<|python_tag|>print(6 * 7)<|eom_id|>")
    assert (call, error) == (ToolCall("code_interpreter", {"code": "print(6 * 7)"}), None)
    assert fmt.answer("42") == (
        "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert fmt.chat_template_kwargs([TOOL_SCHEMA]) == {"builtin_tools": ["code_interpreter"]}
    assert HERMES.chat_template_kwargs([TOOL_SCHEMA]) == {"tools": [TOOL_SCHEMA]}
    assert CODE.chat_template_kwargs([TOOL_SCHEMA]) == {}
    tokenizer = build_tokenizer(TinyModelSpec(model_type="llama", chat_template="llama3"))
    with pytest.raises(ValueError, match=r"'<\|eom_id\|>' is \d+ tokens"):
        call_end_id(fmt, tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|eom_id|>"]})
    assert call_end_id(fmt, tokenizer) == tokenizer.convert_tokens_to_ids("<|eom_id|>")
    block = tokenizer.encode(fmt.answer("42"), add_special_tokens=False)
    assert tokenizer.decode(block) == fmt.answer("42")  # its specials are single tokens
