"""One step's rollout as both placements make it: the engine built from the run's config,
the sampling settings, and `generate_round`, the rated groups of one model replica's share of
a step's prompts. Colocated, every trainer rank calls it (`LocalRollout`); disaggregated, the
engine ranks do (`engine_worker.py`), so both draw the same prompts with the same request
seeds and give the same samples for the same weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from megatron_rl.config import TrainConfig
from megatron_rl.data import load_prompts
from megatron_rl.envs.code_interpreter import TOOL_SCHEMA
from megatron_rl.envs.pool import EnvPool
from megatron_rl.models.source import ModelSource
from megatron_rl.rollout.agent import AgentEngine, AgentSpec, EnvSteps, SharedEnvSteps
from megatron_rl.rollout.evaluation import EVAL_STAGE, Evaluator
from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl.rollout.progress import RolloutProgress
from megatron_rl.rollout.rating import RatedRollout, generate_samples_with_rating
from megatron_rl.rollout.tool_formats import call_end_id, tool_format
from megatron_rl.rollout.types import EngineConfig, SamplingConfig, WeightRefresh, request_seed
from megatron_rl.rollout.vllm_engine import VLLMEngine

STAGES = {"value_pretrain": 1, "train": 2, "eval": EVAL_STAGE}
"""Each stage's part of the request seeds: a step of one stage never repeats another's."""


class DataParallelShard:
    """Every replica draws the same prompts from the shared stream and keeps its slice, so
    the data position is one number for the whole run."""

    def __init__(self, stream, dp_rank: int, dp_size: int):
        self.stream, self.dp_rank, self.dp_size = stream, dp_rank, dp_size

    def take(self, k: int) -> list:
        drawn = self.stream.take(k * self.dp_size)
        return drawn[self.dp_rank * k : (self.dp_rank + 1) * k]


def build_engine(
    config: TrainConfig, source: ModelSource, tensor_parallel_size: int, external_launcher: bool
):
    """This rank's rollout engine (vLLM, or `rollout.name=hf`), as `config.rollout` sets it,
    started from the policy's Hugging Face weights (random ones for a Megatron checkpoint,
    which the trainer then sends). `external_launcher`: under torchrun, the default process
    group is the engines' world."""
    r, t = config.rollout, config.trainer
    params_dtype = config.model.precision.params_dtype
    # rollout.name=hf: a plain HF model per rank, no vLLM import (`rollout/hf_engine.py`)
    return (HFEngine if r.name == "hf" else VLLMEngine)(
        source.hf_dir,
        EngineConfig(
            tensor_parallel_size=tensor_parallel_size,
            dtype=r.dtype or str(params_dtype).removeprefix("torch."),
            seed=t.seed,
            max_model_len=r.max_model_len,
            gpu_memory_utilization=r.gpu_memory_utilization,
            cpu_kv_cache_space_gib=r.cpu_kv_cache_space_gib,
            external_launcher=external_launcher,
            # routing replay, or its mismatch measure, needs the engine's routes
            record_routes=config.actor.router_replay.needs_routes,
            # a LoRA actor synced as adapters (`sync/lora_sync.py`)
            max_lora_rank=0 if config.actor.lora.merge else config.actor.lora.rank,
            # A Megatron checkpoint has no HF weights: vLLM starts from random ones and
            # takes the actor's at once, as after every update.
            extra={"load_format": "dummy"} if source.is_megatron else {},
        ),
    )


def agent_spec(config: TrainConfig, tokenizer) -> AgentSpec:
    """The multi-turn loop's format and limits; refuses a format whose call does not end
    at one token of the policy's tokenizer."""
    m = config.rollout.multi_turn
    fmt = tool_format(m.format)
    return AgentSpec(
        fmt, call_end_id(fmt, tokenizer), m.max_turns, m.max_response_length,
        m.max_tool_response_length, m.tool_response_truncate_side,
    )  # fmt: skip


def prompt_tools(config: TrainConfig) -> dict | None:
    """The chat template's keywords that write the code interpreter into every prompt, as
    the format's family expects (`ToolFormat.chat_template_kwargs`: Qwen's `tools=` system
    block, Llama-3.1's `builtin_tools=`); None for `code` (inline calls) and for `python`
    environments, whose prompts describe their tools."""
    m = config.rollout.multi_turn
    if not m.enable or m.env.type != "code_interpreter":
        return None
    return tool_format(m.format).chat_template_kwargs([TOOL_SCHEMA]) or None


def build_env_pool(config: TrainConfig, rank: int, vllm_tensor_parallel_size: int):
    """The environment's worker pool of a multi-turn run, on each engine's first rank only
    (its other ranks get the answers from it: `SharedEnvSteps`); None elsewhere. Built
    before any model, so an environment that cannot be built fails in seconds."""
    if rank % vllm_tensor_parallel_size:
        return None
    return EnvPool(config.rollout.multi_turn.env)


def agent_engine(engine, spec: AgentSpec, pool, tokenizer, rank: int, vllm_tp: int):
    """This rank's engine running multi-turn rollouts; with vLLM TP > 1 the engine's first
    rank runs `pool` and broadcasts the answers over the engine's gloo group."""
    local = None if pool is None else EnvSteps(pool)
    if vllm_tp == 1:
        return AgentEngine(engine, spec, local, tokenizer)
    # why: vLLM is optional and slow to import: only a vLLM engine of several ranks needs it
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().cpu_group
    return AgentEngine(engine, spec, SharedEnvSteps(local, group, rank - rank % vllm_tp), tokenizer)


def sampling_config(config: TrainConfig) -> SamplingConfig:
    r = config.rollout
    return SamplingConfig(
        n=r.n_samples_per_prompt,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
    )


def build_evaluator(
    config: TrainConfig, engine, pool, tokenizer, dp_rank: int, dp_size: int, device
) -> Evaluator:
    """The `Evaluator` of `trainer.eval_sets` for replica `dp_rank` of `dp_size` (`engine`
    None: one that only summarizes sums made elsewhere, on the engine ranks)."""
    c, r = config, config.rollout
    sets = [
        (spec, load_prompts(replace(c.data, path=spec.path), tokenizer, prompt_tools(c)).records)
        for spec in c.trainer.eval_sets
    ]
    return Evaluator(
        sets=sets,
        engine=engine,
        pool=pool,
        tokenizer=tokenizer,
        seed=c.trainer.seed,
        dp_rank=dp_rank,
        dp_size=dp_size,
        device=torch.device(device),
        max_new_tokens=r.max_new_tokens,
        max_sequences=r.rollout_batch_size // dp_size * r.n_samples_per_prompt,
    )


def round_seed(config: TrainConfig, stage: str, step: int) -> int:
    """The seed of `stage` step `step`'s rollout, its requests' seeds made from it."""
    return request_seed(config.trainer.seed, STAGES[stage], step)


def generate_round(
    config: TrainConfig,
    stage: str,
    step: int,
    prompts: DataParallelShard,
    engine,
    pool,
    tokenizer,
    should_stop: Callable[[], bool],
    stop_generation: Callable[[], bool] | None,
    refresh: WeightRefresh | None = None,
    progress: RolloutProgress | None = None,
    version: int = 0,
) -> RatedRollout:
    """The rated groups of `prompts.dp_rank`'s share (rollout_batch_size / dp_size prompts)
    of `stage` step `step`; `RolloutStopped` when `should_stop` says so (see
    `generate_samples_with_rating`); `refresh`: partial rollouts (`VLLMEngine.generate`);
    `progress`: what a stopped run of this rollout generated (`rollout/progress.py`);
    `version`: the policy version it starts under (engines apart count them)."""
    return generate_samples_with_rating(
        prompts,
        config.rollout.rollout_batch_size // prompts.dp_size,
        engine,
        pool,
        sampling_config(config),
        tokenizer,
        config.rollout.rating,
        seed=round_seed(config, stage, step),
        should_stop=should_stop,
        stop_generation=stop_generation if engine.aborts_generation else None,
        refresh=refresh,
        progress=progress,
        stage=stage,
        step=step,
        replicas=prompts.dp_size,
        version=version,
    )
