"""Chat templates, applied by the tokenizer that owns them.

The actor and a reward model may come from different families (a Qwen actor scored by a Llama
RM, a known pitfall of OpenRLHF's PPO): each renders text with its own tokenizer's template, so
nothing here assumes one template for the whole run.
"""

from __future__ import annotations

from typing import Any

Messages = list[dict[str, str]]


class TemplateError(ValueError):
    """A chat template could not render a conversation."""


def as_messages(prompt: str | Messages, where: str) -> Messages:
    """A plain-string prompt becomes one user turn; a message list is checked and kept."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise TemplateError(
            f"{where}: expected a string or a non-empty list of chat messages, got {prompt!r:.120}"
        )
    for i, m in enumerate(prompt):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise TemplateError(
                f"{where}: message {i} must be a dict with string 'role' and 'content', got {m!r:.120}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def _render(tokenizer: Any, messages: Messages, where: str, **kwargs) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise TemplateError(
            f"{where}: tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template "
            "(set apply_chat_template: false to feed raw prompt text)"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # jinja raises many kinds: report them all the same way
        raise TemplateError(
            f"{where}: the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} failed to "
            f"render: {type(e).__name__}: {e}"
        ) from e
    if not isinstance(text, str):
        raise TemplateError(f"{where}: the chat template returned {type(text).__name__}, not text")
    return text


def render_prompt(
    tokenizer: Any,
    prompt: str | Messages,
    apply_chat_template: bool = True,
    where: str = "prompt",
    chat_template_kwargs: dict | None = None,
) -> str:
    """The text the policy is asked to continue: the template with the generation prompt
    (e.g. ChatML's `<|im_start|>assistant\\n`), or the raw string when templates are off.
    `chat_template_kwargs` go to the template (multi-turn rollouts: the tools, which it
    writes where its family expects them, `ToolFormat.chat_template_kwargs`)."""
    if not apply_chat_template:
        if chat_template_kwargs:
            raise TemplateError(
                f"{where}: tools are written by a chat template; apply_chat_template is false"
            )
        if not isinstance(prompt, str):
            raise TemplateError(
                f"{where}: apply_chat_template is false, so the prompt must be a string, "
                f"got {type(prompt).__name__}"
            )
        return prompt
    extra = chat_template_kwargs or {}
    return _render(
        tokenizer, as_messages(prompt, where), where, add_generation_prompt=True, **extra
    )


def render_conversation(
    tokenizer: Any, prompt: str | Messages, response: str, where: str = "conversation"
) -> str:
    """Prompt plus the assistant's response, rendered by this tokenizer's template: what a
    reward model trained on its own template expects to read."""
    messages = as_messages(prompt, where) + [{"role": "assistant", "content": response}]
    return _render(tokenizer, messages, where, add_generation_prompt=False)
