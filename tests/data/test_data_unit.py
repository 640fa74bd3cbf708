"""Prompt data: formats, field names, templates, length filtering, errors, resumable order."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from megatron_rl.data import (
    PromptDataConfig,
    PromptSampler,
    PromptStream,
    TemplateError,
    load_prompts,
    render_conversation,
    render_prompt,
)

ROWS = [
    {"question": "What is 1 + 1?", "solution": "2"},
    {
        "question": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "3*3?"},
        ],
        "solution": "9",
    },
    {"question": "What is 10 - 4?", "solution": "6"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(path, **kw):
    return PromptDataConfig(path=str(path), prompt_key="question", label_key="solution", **kw)


def test_jsonl_strings_and_messages_get_the_actor_template(tmp_path, tokenizer):
    ds = load_prompts(config(write_jsonl(tmp_path / "p.jsonl", ROWS)), tokenizer)
    assert len(ds) == 3 and [r.label for r in ds.records] == ["2", "9", "6"]
    assert (
        ds[0].prompt_text == "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ds[1].prompt_text.startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3*3?"
    )
    assert (
        ds[0].prompt_token_ids
        == tokenizer(ds[0].prompt_text, add_special_tokens=False)["input_ids"]
    )
    assert ds[1].prompt == ROWS[1]["question"]  # kept as messages, for reward models


def test_parquet_and_saved_directory_load_the_same(tmp_path, tokenizer):
    import datasets

    rows = [ROWS[0], ROWS[2]]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "p.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved"))
    from_jsonl = load_prompts(config(write_jsonl(tmp_path / "p.jsonl", rows)), tokenizer)
    for path in (tmp_path / "p.parquet", tmp_path / "saved"):
        ds = load_prompts(config(path), tokenizer)
        assert [r.prompt_token_ids for r in ds.records] == [
            r.prompt_token_ids for r in from_jsonl.records
        ]


def test_raw_prompts_without_template(tmp_path, tokenizer):
    ds = load_prompts(
        config(write_jsonl(tmp_path / "p.jsonl", [ROWS[0]]), apply_chat_template=False), tokenizer
    )
    assert ds[0].prompt_text == "What is 1 + 1?"
    with pytest.raises(TemplateError, match="row 1: apply_chat_template is false"):
        load_prompts(
            config(write_jsonl(tmp_path / "m.jsonl", ROWS[:2]), apply_chat_template=False),
            tokenizer,
        )


def test_overlong_prompts_are_dropped_and_counted_or_refused(tmp_path, tokenizer):
    rows = ROWS + [{"question": "word " * 200, "solution": "0"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    ds = load_prompts(config(path, max_prompt_length=64), tokenizer)
    assert len(ds) == 3 and ds.num_dropped_overlong == 1
    assert ds.metrics["data/dropped_overlong"] == 1.0
    assert [r.row for r in ds.records] == [0, 1, 2]
    with pytest.raises(ValueError, match=r"p.jsonl row 3: \d+ tokens > max_prompt_length 64"):
        load_prompts(config(path, max_prompt_length=64, filter_overlong_prompts=False), tokenizer)
    with pytest.raises(ValueError, match="all 4 prompts are longer"):
        load_prompts(config(path, max_prompt_length=2), tokenizer)


def test_bad_input_names_the_file_and_row(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "a", "solution": "1"}\n{"question": "b", "solution": \n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_prompts(config(bad), tokenizer)
    missing = write_jsonl(tmp_path / "missing.jsonl", [ROWS[0], {"other": "x", "solution": "1"}])
    with pytest.raises(
        ValueError, match=r"missing.jsonl row 1: field 'question' is missing or empty"
    ):
        load_prompts(config(missing), tokenizer)
    other = write_jsonl(tmp_path / "other.jsonl", [{"other": "x", "solution": "1"}])
    with pytest.raises(ValueError, match=r"no column 'question' \(prompt_key\); columns are"):
        load_prompts(config(other), tokenizer)
    with pytest.raises(ValueError, match=r"no column 'answer' \(label_key\).*label_key: null"):
        load_prompts(PromptDataConfig(path=str(other), prompt_key="other"), tokenizer)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty.jsonl: the file is empty"):
        load_prompts(config(empty), tokenizer)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_prompts(config(tmp_path / "nope.jsonl"), tokenizer)
    with pytest.raises(ValueError, match=r"unknown format '.csv'"):
        (tmp_path / "p.csv").write_text("a\n")
        load_prompts(config(tmp_path / "p.csv"), tokenizer)


def test_a_row_that_is_not_utf8_is_named(tmp_path, tokenizer):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(
        b'{"question": "a", "solution": "1"}\n{"question": "caf\xe9", "solution": "2"}\n'
    )
    with pytest.raises(
        ValueError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 0xe9 at column 18\)"
    ):
        load_prompts(config(bad), tokenizer)


def test_labels_are_kept_as_written(tmp_path, tokenizer):
    """`datasets` reads a column mixing 7 and "007" as JSON and gives [7, 7], and 1e3 as
    1000.0: reference answers are read as the file writes them."""
    rows = ['"007"', "7", "1e3", "0.10", '["1", 2]', "null"]
    path = tmp_path / "labels.jsonl"
    path.write_text(
        "".join(f'{{"question": "q{i}", "solution": {r}}}\n' for i, r in enumerate(rows))
    )
    labels = [r.label for r in load_prompts(config(path), tokenizer).records]
    assert labels == ["007", "7", "1e3", "0.10", ["1", "2"], None]
    as_list = tmp_path / "labels.json"
    as_list.write_text(
        "[" + ",".join(f'{{"question": "q", "solution": {r}}}' for r in rows[:4]) + "]"
    )
    assert [r.label for r in load_prompts(config(as_list), tokenizer).records] == labels[:4]


def test_empty_dataset_is_refused(tmp_path, tokenizer):
    import datasets

    empty = datasets.Dataset.from_dict({"question": ["a"], "solution": ["1"]}).select([])
    empty.to_parquet(str(tmp_path / "empty.parquet"))
    with pytest.raises(ValueError, match="empty.parquet: the dataset has no rows"):
        load_prompts(config(tmp_path / "empty.parquet"), tokenizer)


def test_template_that_fails_to_render_names_the_row(tmp_path, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    with pytest.raises(TemplateError, match=r"p.jsonl row 1: the chat template .* no system role"):
        load_prompts(config(path), tok)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="has no chat template"):
        render_prompt(tok, "hi")
    with pytest.raises(TemplateError, match="message 0 must be a dict"):
        render_prompt(tokenizer_with_template(tiny_model_dir), [{"role": "user"}])


def tokenizer_with_template(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def test_render_conversation_closes_the_assistant_turn(tokenizer):
    text = render_conversation(tokenizer, "2+2?", r"\boxed{4}")
    assert text == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n\\boxed{4}<|im_end|>\n"


def test_sampler_is_a_deterministic_permutation_per_epoch():
    a, b = PromptSampler(10, seed=3), PromptSampler(10, seed=3)
    first = a.take(10)
    assert sorted(first) == list(range(10)) and first != list(range(10))
    assert b.take(4) + b.take(6) == first
    second = a.take(10)
    assert sorted(second) == list(range(10)) and second != first  # reshuffled per epoch
    assert PromptSampler(10, shuffle=False).take(12) == list(range(10)) + [0, 1]


def test_sampler_resumes_exactly():
    run = PromptSampler(7, seed=1)
    run.take(5)
    state = run.state_dict()
    expected = run.take(9)  # crosses into epoch 1 and beyond
    resumed = PromptSampler(7, seed=1)
    resumed.load_state_dict(state)
    assert resumed.take(9) == expected
    assert state["epoch"] == 0 and state["index"] == 5
    with pytest.raises(ValueError, match="num_prompts=7 in the checkpoint but 8 now"):
        PromptSampler(8, seed=1).load_state_dict(state)


def test_stream_returns_records_in_sampler_order(tmp_path, tokenizer):
    ds = load_prompts(config(write_jsonl(tmp_path / "p.jsonl", ROWS)), tokenizer)
    stream = PromptStream(ds, seed=0)
    order = PromptSampler(3, seed=0).take(3)
    assert [r.row for r in stream.take(3)] == order


def test_tool_schemas_are_written_by_the_policys_template(tmp_path, tiny_tools_model_dir):
    """Multi-turn rollouts with the `hermes` format: the code interpreter's schema reaches
    every prompt through the template (`chatml_tools` lists tools as Qwen2.5's does); with
    templates off there is nowhere to write them, which is refused."""
    from megatron_rl.envs.code_interpreter import TOOL_SCHEMA
    from megatron_rl.rollout.tool_formats import tool_format

    tok = AutoTokenizer.from_pretrained(tiny_tools_model_dir)
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    ds = load_prompts(config(path), tok, tool_format("hermes").chat_template_kwargs([TOOL_SCHEMA]))
    assert ds[0].prompt_text.startswith(
        '<|im_start|>system\n# Tools\n\n<tools>\n{"type": "function", "function": '
        '{"name": "code_interpreter"'
    )
    assert ds[0].prompt_text.endswith(
        "<|im_start|>user\nWhat is 1 + 1?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" not in load_prompts(config(path), tok)[0].prompt_text
    with pytest.raises(TemplateError, match="tools are written by a chat template"):
        render_prompt(tok, "2 + 2?", False, chat_template_kwargs={"tools": [TOOL_SCHEMA]})
