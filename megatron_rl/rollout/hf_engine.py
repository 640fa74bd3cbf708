"""A rollout engine on a plain Hugging Face model, for runs without vLLM (`rollout.name: hf`).

For debugging and small GPU checks (a tiny recipe on a machine with only torch,
megatron-core and transformers), NOT for speed: every call is one padded batch decoded
token by token in Python with transformers' KV cache (`AutoModelForCausalLM`,
`use_cache=True`). What vLLM adds and this leaves out, on purpose: continuous batching, a
paged KV cache sized by `gpu_memory_utilization` (here the cache grows with batch x length
and is freed after each call), prefix caching (`reset_prefix_cache` is a no-op), CUDA graphs,
and tensor parallelism: each rank holds the whole model (tensor_parallel_size 1), so under
torchrun every rank is an engine of its own and `ReplicaEngine` splits a replica's prompts
over its ranks.

It honours `VLLMEngine`'s contract, which the trainer and the weight sync rely on:
- `Sample.logprobs` are vLLM's `processed_logprobs`: log softmax(logits / temperature) after
  top-k, then top-p, with vLLM's tie and "keep at least one" rules; greedy (temperature 0)
  reports the raw log-softmax. `score` is the raw log-softmax of the prompt tokens.
- per-request seeds: sample j of a prompt seeded s is drawn from its own generator seeded
  by (s, j), by vLLM's exponential race (argmax p / q, q ~ Exp(1)), so it does not depend on
  which engine or batch generated it (up to float rounding of a padded batch); without
  seeds, request seeds come from the engine's seed in call order.
- EOS (the model's and its generation config's) and `stop_token_ids` end a response and are
  its last token (finish_reason "stop"); `max_new_tokens` or `max_model_len` give "length".
- `update_weights` takes (HF name, tensor) pairs, refuses an unknown name, a wrong shape or a
  missing weight, and copies in place in the engine's dtype (streamed: a failure part-way
  leaves earlier tensors updated, as with vLLM).
- `sleep` / `wake_up`: on CUDA the weights move to host memory and back (the KV cache only
  exists inside `generate`); on CPU only the `awake` flags change, as with vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_rl.parallel import distributed
from megatron_rl.rollout.types import (
    ENGINE_MEMORY,
    EngineConfig,
    Sample,
    SamplingConfig,
    check_generate,
    require_awake,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")
"""vLLM's `load_format` values this engine takes: the checkpoint's weights, or random ones
(a Megatron checkpoint has no HF weights; the trainer syncs the actor's at once)."""


def sample_seed(request_seed: int, sample_index: int) -> int:
    """The seed of sample `sample_index` of a request: distinct requests and samples draw
    unrelated streams (a sum or product of the two would collide)."""
    digest = hashlib.blake2b(f"{request_seed}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def processed_logprobs(logits_bv: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """vLLM's `processed_logprobs` of logits [B, V] (fp32): temperature, then top-k, then
    top-p on the sorted logits (a token is dropped while the ascending cumulative probability
    is <= 1 - top_p; the most likely always stays), renormalised. Greedy: the raw ones."""
    if sampling.temperature == 0:
        return torch.log_softmax(logits_bv, dim=-1)
    x = logits_bv / sampling.temperature
    top_k = sampling.top_k if 0 < sampling.top_k < x.shape[-1] else 0
    if top_k or sampling.top_p < 1:
        x_sort, order = x.sort(dim=-1, descending=False)
        if top_k:
            kth = x_sort[:, x.shape[-1] - top_k, None]  # [B, 1]: ties with the k-th stay
            x_sort = x_sort.masked_fill(x_sort < kth, float("-inf"))
        if sampling.top_p < 1:
            cumulative = x_sort.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1 - sampling.top_p
            drop[:, -1] = False
            x_sort = x_sort.masked_fill(drop, float("-inf"))
        x = x.scatter(-1, order, x_sort)
    return torch.log_softmax(x, dim=-1)


def draw(logprobs_bv: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row [B] from exp(logprobs) [B, V], each row from its own generator
    (vLLM's exponential race: argmax p / q with q ~ Exp(1)); a None generator: argmax."""
    tokens = torch.empty(len(generators), dtype=torch.long, device=logprobs_bv.device)
    probs = logprobs_bv.exp()
    for row, g in enumerate(generators):
        if g is None:
            tokens[row] = logprobs_bv[row].argmax()
            continue
        q = torch.empty_like(probs[row]).exponential_(generator=g)
        tokens[row] = (probs[row] / q).argmax()
    return tokens


class HFEngine:
    """A Hugging Face causal LM behind `VLLMEngine`'s interface (module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        config: EngineConfig | None = None,
        device: torch.device | None = None,
    ):
        # why: transformers takes seconds to import: only this path needs it
        from transformers import AutoConfig, AutoModelForCausalLM

        self.config = cfg = config or EngineConfig()
        if cfg.tensor_parallel_size != 1:
            raise ValueError(
                f"the hf rollout engine holds the whole model on each rank: "
                f"tensor_parallel_size must be 1, got {cfg.tensor_parallel_size}"
            )
        if cfg.dtype not in DTYPES:
            raise ValueError(f"hf engine dtype must be one of {sorted(DTYPES)}, got {cfg.dtype!r}")
        unknown = set(cfg.extra) - {"load_format"}
        load_format = cfg.extra.get("load_format", "auto")
        if unknown or load_format not in LOAD_FORMATS:
            raise ValueError(
                f"hf engine: EngineConfig.extra takes only load_format in {LOAD_FORMATS}, got "
                f"{cfg.extra}"
            )
        self.device = device or distributed.device()
        torch_dtype = DTYPES[cfg.dtype]
        if load_format == "dummy":
            hf_config = AutoConfig.from_pretrained(model_dir)
            # Random weights, replaced by the first weight sync; the global RNG is left as
            # the trainer seeded it.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                self.model = AutoModelForCausalLM.from_config(hf_config, dtype=torch_dtype)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        self.model.eval().requires_grad_(False).to(self.device)
        self.max_model_len = cfg.max_model_len or self.model.config.max_position_embeddings
        self.eos_token_ids = _eos_ids(self.model)
        self.sleep_mode = self.device.type == "cuda"
        self.awake: set[str] = set(ENGINE_MEMORY)
        # Request seeds when the caller gives none: repeatable runs for a fixed engine seed.
        self._seeds = torch.Generator(device="cpu").manual_seed(cfg.seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    # ------------------------------------------------------------------ memory

    def shutdown(self) -> None:
        """Nothing to release beyond the model, which goes with the engine."""

    def sleep(self, level: int = 1) -> None:
        """Free device memory for training: on CUDA the weights go to host memory (levels 1
        and 2 alike: the copy back is cheap next to a decode loop)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_mode and "weights" in self.awake:
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self.awake = set()

    def wake_up(self, tags: Iterable[str] = ENGINE_MEMORY) -> None:
        """Bring `tags` back ("weights" moves the model to the device; "kv_cache" is only a
        flag: the cache is made inside `generate`)."""
        tags = tuple(tags)
        unknown = set(tags) - set(ENGINE_MEMORY)
        if unknown:
            raise ValueError(f"wake_up tags must be among {ENGINE_MEMORY}, got {sorted(unknown)}")
        if self.sleep_mode and "weights" in tags and "weights" not in self.awake:
            self.model.to(self.device)
        self.awake |= set(tags)

    def reset_prefix_cache(self) -> None:
        """No prefix cache: nothing outlives a `generate` call."""

    # ------------------------------------------------------------------ weights

    def load_adapter(self, path) -> None:
        raise ValueError(
            "rollout.name=hf serves no LoRA adapter: sync a LoRA policy merged "
            "(actor.lora.merge=true)"
        )

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (HF name, tensor) pairs into the model in place (tied embeddings: the model
        has no separate `lm_head.weight`); every weight must arrive, each once or more."""
        require_awake(self, "weights", use="take weights")
        params = dict(self.model.named_parameters())
        seen = set()
        for name, t in weights:
            if name not in params:
                raise ValueError(f"hf engine: {name!r} is not a weight of the engine's model")
            if tuple(t.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"hf engine: {name!r} has shape {list(t.shape)}, the engine expects "
                    f"{list(params[name].shape)}"
                )
            params[name].copy_(t)
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(f"hf engine: {len(missing)} weights never arrived, e.g. {missing[:3]}")

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token after the first of each sequence at temperature 1:
        [len(seq) - 1] per sequence (like vLLM's prompt log-probs, from the raw logits)."""
        require_awake(self, *ENGINE_MEMORY, use="score")
        if not sequences:
            return []
        self._check_lengths(sequences, 0)
        longest = max(map(len, sequences))
        ids = torch.zeros(len(sequences), longest, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(sequences):  # right-padded: positions 0..len-1 as they are
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long, device=self.device)
            mask[i, : len(s)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token_lp = logprobs[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # [B, S - 1]
        return [token_lp[i, : len(s) - 1].tolist() for i, s in enumerate(sequences)]

    aborts_generation = False
    """`generate` runs to its end: a stop request waits for it (no `should_stop`)."""
    multi_turn = False
    partial_rollouts = False
    continues_partial = False
    """A stop never cuts a response (it waits for the call's end): nothing to continue."""
    streams = False

    def drop_ahead(self) -> None:
        """Nothing is ever admitted ahead (no partial rollouts)."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        seeds: list[int] | None = None,
        should_stop: None = None,
        tasks: None = None,
        refresh: None = None,
        partial: None = None,
    ) -> list[Sample]:
        """Sample `sampling.n` responses for each prompt (token ids); prompt-major order.

        `seeds`: one per prompt; a request's samples then depend only on its prompt, seed,
        sampling and the weights (not on the other prompts of the call)."""
        check_generate(self, prompts, seeds, should_stop, tasks, refresh, partial)
        if not prompts:
            return []
        require_awake(self, *ENGINE_MEMORY, use="generate")
        self._check_lengths(prompts, 1)
        if seeds is None:
            seeds = torch.randint(2**31, (len(prompts),), generator=self._seeds, device="cpu")
            seeds = seeds.tolist()
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        generators = [
            None
            if sampling.temperature == 0
            else torch.Generator(device=self.device).manual_seed(sample_seed(seeds[i], j))
            for i, j in rows
        ]
        budgets = [
            min(sampling.max_new_tokens, self.max_model_len - len(prompts[i])) for i, _ in rows
        ]
        tokens, logprobs, finished = self._decode(
            [prompts[i] for i, _ in rows], sampling, generators, budgets
        )
        return [
            Sample(
                prompt_index=i,
                sample_index=j,
                prompt_token_ids=list(prompts[i]),
                token_ids=tokens[r],
                logprobs=logprobs[r],
                finish_reason=finished[r],
            )
            for r, (i, j) in enumerate(rows)
        ]

    @torch.no_grad()
    def _decode(
        self,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        generators: list[torch.Generator | None],
        budgets: list[int],
    ) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """The decode loop over rows (one per sample): left-padded prefill [B, P], then one
        token per row per step [B, 1] through the KV cache, until every row stopped.
        Returns per row its tokens, their processed log-probs and its finish reason."""
        # why: transformers takes seconds to import: only this path needs it
        from transformers import DynamicCache

        b, longest = len(prompts), max(map(len, prompts))
        ids = torch.zeros(b, longest, dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for r, p in enumerate(prompts):
            ids[r, longest - len(p) :] = torch.tensor(p, dtype=torch.long, device=self.device)
            mask[r, longest - len(p) :] = 1
        # Left padding shifts each prompt: positions count its real tokens only.
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_token_ids)
        tokens: list[list[int]] = [[] for _ in range(b)]
        logprobs: list[list[float]] = [[] for _ in range(b)]
        finish: list[str | None] = [None] * b
        cache = DynamicCache(config=self.model.config)
        for _ in range(max(budgets)):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            lp_bv = processed_logprobs(out.logits[:, -1].float(), sampling)
            drawn = draw(lp_bv, generators)
            drawn_lp = lp_bv.gather(-1, drawn[:, None])[:, 0]
            for r, (tok, lp) in enumerate(zip(drawn.tolist(), drawn_lp.tolist(), strict=True)):
                if finish[r] is not None:
                    continue
                tokens[r].append(tok)
                logprobs[r].append(lp)
                if tok in stop:
                    finish[r] = "stop"
                elif len(tokens[r]) >= budgets[r]:
                    finish[r] = "length"
            if all(f is not None for f in finish):
                break
            ids = drawn[:, None]  # finished rows decode on; what they draw is dropped
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
        return tokens, logprobs, finish

    def _check_lengths(self, sequences: list[list[int]], room: int) -> None:
        for i, s in enumerate(sequences):
            if len(s) + room > self.max_model_len:
                raise ValueError(
                    f"sequence {i} has {len(s)} tokens: the hf engine's max_model_len "
                    f"{self.max_model_len} leaves no room for it"
                    + (" and one generated token" if room else "")
                )


def _eos_ids(model) -> set[int]:
    """EOS ids of the model config and its generation config (an int or a list each)."""
    ids = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids |= {value} if isinstance(value, int) else set(value)
    return ids
