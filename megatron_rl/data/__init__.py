"""Prompt data: datasets from JSONL / Parquet / saved directories, chat templates, a resumable
shuffled sampler."""

from megatron_rl.data.prompts import PromptDataConfig, PromptDataset, PromptRecord, load_prompts
from megatron_rl.data.sampler import PromptSampler, PromptStream
from megatron_rl.data.templates import TemplateError, render_conversation, render_prompt

__all__ = [
    "PromptDataConfig",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "PromptStream",
    "TemplateError",
    "load_prompts",
    "render_conversation",
    "render_prompt",
]
