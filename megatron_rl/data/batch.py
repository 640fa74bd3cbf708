"""The rollout -> training batch: its dataclass, building it from the engine's samples, and
splitting it into mini- and micro-batches. Everything that moves a batch imports it from here.

Sequences are prompt + response, right-padded to one length S. Every per-token tensor is
[B, S] and aligned to tokens: entry t concerns token t (its log-prob given tokens < t, the
critic's value of the state before it, its advantage). Entry 0 is never a response token.

Devices: a batch is built from the engine's samples in host memory and moved once, whole, by
`to(device)` where it enters a role or the experience maker; what is derived from it after
that (index tensors, splits, gathered log-probs) is made on the batch's own device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from megatron_rl.data.packing import Packing, pack_rows, packed_partition


@dataclass(frozen=True)
class TrainingBatch:
    input_ids: torch.Tensor
    """[B, S] token ids (prompt, response, padding)."""
    response_mask: torch.Tensor
    """[B, S] 1 on response tokens, 0 on prompt and padding."""
    old_logprobs: torch.Tensor | None = None
    """[B, S] log-probs of the policy that sampled the batch (PPO ratio denominator)."""
    ref_logprobs: torch.Tensor | None = None
    """[B, S] reference-policy log-probs (KL in the loss); None when beta = 0."""
    advantages: torch.Tensor | None = None
    """[B, S] advantages of response tokens."""
    returns: torch.Tensor | None = None
    """[B, S] critic targets."""
    old_values: torch.Tensor | None = None
    """[B, S] critic values at sampling time (value clipping)."""
    scores: torch.Tensor | None = None
    """[B] outcome rewards (positive-sample NLL)."""
    rollout_is_weights: torch.Tensor | None = None
    """[B, S] truncated importance weights pi_old / pi_rollout on the policy-gradient term
    (`algorithm.rollout_correction.rollout_is`); None: no weighting."""
    routed_experts: torch.Tensor | None = None
    """[B, S, MoE layers, top-k] uint8: the experts the engine routed each token to (routing
    replay, `models/router_replay.py`). Tokens that were never run (each row's last, and
    padding) hold the placeholder experts 0..k-1: distinct, as a route must be, and what
    they compute feeds no loss term."""
    packing: Packing | None = None
    """A micro-batch run packed (`data/packing.py`): where its rows lie in the one row the
    model reads; its per-token fields stay [B, S]."""

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, S], got {tuple(self.input_ids.shape)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("input_ids", "scores", "packing"):
                continue
            if f.name == "routed_experts":
                if value.dim() != 4 or value.shape[:2] != self.input_ids.shape:
                    raise ValueError(
                        f"routed_experts has shape {tuple(value.shape)}, expected "
                        f"{tuple(self.input_ids.shape)} + (MoE layers, top-k)"
                    )
                continue
            if value.shape != self.input_ids.shape:
                raise ValueError(
                    f"{f.name} has shape {tuple(value.shape)}, expected "
                    f"{tuple(self.input_ids.shape)} like input_ids"
                )
        if self.scores is not None and self.scores.shape != (len(self),):
            raise ValueError(f"scores must be [{len(self)}], got {tuple(self.scores.shape)}")

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return torch.arange(self.seq_length, device=self.input_ids.device).expand_as(self.input_ids)

    def to(self, device: torch.device | str) -> TrainingBatch:
        """Every tensor on `device` (the batch itself when they already are)."""
        device = torch.device(device)
        present = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "packing"}
        present = {k: v for k, v in present.items() if v is not None}
        if all(v.device == device for v in present.values()) and self.packing is None:
            return self
        moved = {k: v.to(device) for k, v in present.items()}
        if self.packing is not None:
            moved["packing"] = self.packing.to(device)
        return replace(self, **moved)

    def packed(self, multiple: int = 1, lengths: list[int] | None = None) -> TrainingBatch:
        """This micro-batch to be run packed: its rows, each up to its length
        (`sequence_lengths`, or `lengths` where the caller has read them to the host
        already), back to back in one row of a multiple of `multiple` tokens."""
        if lengths is None:
            lengths = self.sequence_lengths().tolist()
        return replace(self, packing=pack_rows(self.input_ids, lengths, multiple))

    @property
    def model_input_ids(self) -> torch.Tensor:
        """What the model reads: [B, S] token ids, or [1, T] packed."""
        return self.input_ids if self.packing is None else self.packing.input_ids

    def rows(self, index: slice | torch.Tensor) -> TrainingBatch:
        """The same fields restricted to sequences `index`."""
        if self.packing is not None:
            raise ValueError("a packed micro-batch is not split again")
        if isinstance(index, torch.Tensor):
            index = index.to(self.input_ids.device)
        return replace(
            self,
            **{
                f.name: getattr(self, f.name)[index]
                for f in fields(self)
                if getattr(self, f.name) is not None and f.name != "packing"
            },
        )

    def with_fields(self, **updates) -> TrainingBatch:
        return replace(self, **updates)

    def with_length(self, length: int, pad_token_id: int = 0) -> TrainingBatch:
        """Columns cut or right-padded to `length`. Padding is never a response token, and
        a causal model's outputs before a position do not depend on what follows it, so
        cutting right padding changes no loss term."""
        extra = length - self.seq_length
        if extra == 0:
            return self
        if self.packing is not None:
            raise ValueError("a packed micro-batch keeps its length")
        updates = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in ("scores", "packing"):
                continue
            if extra < 0:
                updates[f.name] = value[:, :length]
            elif f.name == "routed_experts":
                updates[f.name] = torch.cat([value, placeholder_routes(value, extra)], dim=1)
            else:
                fill = pad_token_id if f.name == "input_ids" else 0
                updates[f.name] = torch.nn.functional.pad(value, (0, extra), value=fill)
        return replace(self, **updates)

    def padded_to_multiple(self, multiple: int, pad_token_id: int = 0) -> TrainingBatch:
        """Right-pad S to a multiple (sequence parallelism, FP8); padding is never a response
        token, so losses are unchanged. Slice outputs back with [:, :seq_length]."""
        return self.with_length(round_up(self.seq_length, multiple), pad_token_id)

    def sequence_lengths(self) -> torch.Tensor:
        """[B] tokens up to and including each row's last response token: what the model must
        see for every loss term (1 for a row without response tokens)."""
        positions = torch.arange(1, self.seq_length + 1, device=self.response_mask.device)
        return (self.response_mask.bool() * positions).amax(dim=1).clamp(min=1)

    def padding_mask(self) -> torch.Tensor:
        """[B, S] True past each row's last response token: positions no loss term reads."""
        positions = torch.arange(self.seq_length, device=self.input_ids.device)
        return positions >= self.sequence_lengths()[:, None]

    def split(self, num_microbatches: int) -> list[TrainingBatch]:
        """Equal-size micro-batches (pipeline p2p needs one shape for all of them)."""
        if num_microbatches < 1 or len(self) % num_microbatches != 0:
            raise ValueError(
                f"{len(self)} sequences do not split into {num_microbatches} equal micro-batches"
            )
        size = len(self) // num_microbatches
        return [self.rows(slice(i * size, (i + 1) * size)) for i in range(num_microbatches)]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def token_budget_partition(
    lengths: list[int], max_tokens: int, multiple: int = 1
) -> list[list[int]]:
    """Rows -> micro-batches of at most `max_tokens` padded tokens each (verl's
    `use_dynamic_bsz` / `ppo_max_token_len_per_gpu`, NeMo-RL's dynamic batching).

    A micro-batch is padded to its own longest row, rounded up to `multiple` (sequence
    parallelism, FP8), so its cost is rows x that length. Rows are taken longest first and
    each micro-batch is filled while the cost stays within the budget: rows of similar
    length share a micro-batch, which keeps padding small, and the long tail of a reasoning
    model's lengths costs its own tokens instead of setting every micro-batch's length.
    Returns row indices per micro-batch, longest micro-batch first.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    parts: list[list[int]] = []
    for i in order:
        if parts and (len(parts[-1]) + 1) * round_up(lengths[parts[-1][0]], multiple) <= max_tokens:
            parts[-1].append(i)
            continue
        if round_up(lengths[i], multiple) > max_tokens:
            raise ValueError(
                f"a sequence of {lengths[i]} tokens (padded to {round_up(lengths[i], multiple)}) "
                f"does not fit the micro-batch token budget {max_tokens}: raise "
                "ppo_max_token_len_per_gpu to at least max_prompt_length + max_new_tokens"
            )
        parts.append([i])
    return parts


def balanced_assignment(lengths: list[int], counts: list[int]) -> list[list[int]]:
    """Rows -> data-parallel ranks, rank r getting `counts[r]` rows, with sums of lengths as
    even as a greedy can make them (verl's `balance_batch`): longest row first, each to the
    rank with the fewest tokens that still has room. A rank with the long tail of a rollout
    otherwise makes every other rank wait at each gradient all-reduce."""
    if sum(counts) != len(lengths):
        raise ValueError(f"{len(lengths)} rows for ranks of {counts} rows")
    ranks: list[list[int]] = [[] for _ in counts]
    tokens = [0] * len(counts)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(
            (r for r in range(len(counts)) if len(ranks[r]) < counts[r]), key=tokens.__getitem__
        )
        ranks[r].append(i)
        tokens[r] += lengths[i]
    return [sorted(rows) for rows in ranks]


def to_count_multiple(
    parts: list[list[int]], count_multiple: int, why: str = "interleaved pipeline parallelism"
) -> list[list[int]]:
    """Split the micro-batches with the most rows in two until their number is a multiple of
    `count_multiple` (megatron's interleaved schedule runs micro-batches in groups of the
    pipeline size); halves stay within the budget."""
    parts = [list(p) for p in parts]
    while len(parts) % count_multiple:
        i = max(range(len(parts)), key=lambda j: len(parts[j]))
        if len(parts[i]) < 2:
            raise ValueError(
                f"{sum(map(len, parts))} rows cannot make a multiple of {count_multiple} "
                f"micro-batches ({why})"
            )
        half = len(parts[i]) // 2
        parts[i : i + 1] = [parts[i][:half], parts[i][half:]]
    return parts


def to_count(parts: list[list[int]], count: int, why: str) -> list[list[int]]:
    """`parts` split (largest first, as `to_count_multiple`) into exactly `count` micro-batches,
    `count` >= their number."""
    while len(parts) < count:
        parts = to_count_multiple(parts, len(parts) + 1, why)
    return parts


def split_micro_batches(
    batch: TrainingBatch,
    num_microbatches: int = 1,
    max_tokens: int | None = None,
    multiple: int = 1,
    count_multiple: int = 1,
    agree: Callable[[int], int] | None = None,
    pack: bool = False,
) -> tuple[list[TrainingBatch], torch.Tensor | None]:
    """(micro-batches, row order). Without `max_tokens`: `num_microbatches` equal slices
    padded to one length, a multiple of `multiple`; order None (the rows stay in place).
    With it: `token_budget_partition`, made `count_multiple` micro-batches long
    (`to_count_multiple`), each cut to its own padded length; order [B] is the batch row of
    each row of the concatenated micro-batches. `agree(count) -> count`: the number every
    rank must run when they must run the same (expert parallelism: each micro-batch's MoE
    layers exchange tokens with the other data-parallel ranks), the largest split to it.
    `pack`: each micro-batch runs packed (`TrainingBatch.packed`), its rows cut to their
    longest; a token budget then counts packed tokens (`packed_partition`), not padded ones."""
    if max_tokens is None:
        if pack:
            micro = batch.split(num_microbatches)
            lengths = batch.sequence_lengths().tolist()  # one host read for every micro-batch
            size = len(batch) // num_microbatches
            rows = [lengths[i : i + size] for i in range(0, len(batch), size)]
            micro = [
                mb.with_length(max(n)).packed(multiple, n)
                for mb, n in zip(micro, rows, strict=True)
            ]
            return micro, None
        return batch.padded_to_multiple(multiple).split(num_microbatches), None
    if num_microbatches != 1:
        raise ValueError(
            f"num_microbatches={num_microbatches} and max_tokens={max_tokens}: give one, the "
            "token budget decides the number of micro-batches"
        )
    lengths = batch.sequence_lengths().tolist()
    partition = packed_partition if pack else token_budget_partition
    parts = to_count_multiple(partition(lengths, max_tokens, multiple), count_multiple)
    if agree is not None:
        parts = to_count(parts, agree(len(parts)), "as many as another data-parallel rank")
    device = batch.input_ids.device
    micro = []
    for rows in parts:
        rows_lengths = [lengths[i] for i in rows]
        mb = batch.rows(torch.tensor(rows, device=device))
        micro.append(
            mb.with_length(max(rows_lengths)).packed(multiple, rows_lengths)
            if pack
            else mb.with_length(round_up(max(rows_lengths), multiple))
        )
    return micro, torch.tensor([i for rows in parts for i in rows], device=device)


def shift_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """[B, S-1] values computed at positions 0..S-2 about tokens 1..S-1 -> [B, S] aligned to
    tokens (entry 0, the first prompt token, is 0)."""
    return torch.nn.functional.pad(per_position, (1, 0))


def placeholder_routes(like: torch.Tensor, tokens: int) -> torch.Tensor:
    """[B, tokens, L, k] routes to experts 0..k-1 for tokens that were never run."""
    b, _, layers, k = like.shape
    ids = torch.arange(k, dtype=like.dtype, device=like.device)
    return ids.expand(b, tokens, layers, k).clone()


def env_spans_of(sample, row: int = 0) -> list[tuple[int, int]]:
    """A sample's environment blocks ([start, end) in its `token_ids`; none for single-turn
    samples), checked: in order, apart, inside the response, and never its first or last
    token (a policy turn comes before each block, and a trajectory ends on a policy token,
    where its outcome reward lands)."""
    spans = list(getattr(sample, "env_spans", ()))
    n, previous_end = len(sample.token_ids), 0
    for start, end in spans:
        if not previous_end < start < end < n:
            raise ValueError(
                f"sample {row}: environment span ({start}, {end}) of its {n} response tokens; "
                f"expected in order after {previous_end}, not empty, after a policy token "
                "and before the last token"
            )
        previous_end = end
    return spans


def samples_to_batch(samples, pad_token_id: int = 0) -> TrainingBatch:
    """Engine samples (`rollout.vllm_engine.Sample`: `prompt_token_ids`, `token_ids`, and
    `routed_experts` when the engine recorded them) -> right-padded [B, S] prompt+response
    batch with a response mask, in host memory. Multi-turn samples keep their environment
    blocks in the sequence (the model reads them) and out of the response mask (no loss,
    no advantage, no critic target lands on them: every estimator skips mask holes)."""
    seqs = [s.prompt_token_ids + s.token_ids for s in samples]
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), pad_token_id, dtype=torch.long, device="cpu")
    mask = torch.zeros(len(seqs), length, device="cpu")
    for i, (s, seq) in enumerate(zip(samples, seqs, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq, device="cpu")
        start = len(s.prompt_token_ids)
        mask[i, start : len(seq)] = 1
        for a, b in env_spans_of(s, i):
            mask[i, start + a : start + b] = 0
    routes = [getattr(s, "routed_experts", None) for s in samples]
    if all(r is None for r in routes):
        return TrainingBatch(input_ids=ids, response_mask=mask)
    if any(r is None for r in routes):
        raise ValueError("some samples carry routed experts and others not")
    like = torch.zeros((len(seqs), 0, *routes[0].shape[1:]), dtype=torch.uint8, device="cpu")
    routed = placeholder_routes(like, length)
    for i, (r, seq) in enumerate(zip(routes, seqs, strict=True)):
        if r.shape[0] != len(seq) - 1 or r.shape[1:] != routed.shape[2:]:
            raise ValueError(
                f"sample {i}: routed experts of shape {tuple(r.shape)}, expected "
                f"({len(seq) - 1}, {', '.join(map(str, routed.shape[2:]))})"
            )
        routed[i, : len(seq) - 1] = torch.from_numpy(r)
    return TrainingBatch(input_ids=ids, response_mask=mask, routed_experts=routed)


def rated_to_batch(
    groups, pad_token_id: int, device: torch.device | str = "cpu"
) -> tuple[TrainingBatch, torch.Tensor]:
    """(batch with `scores`, group index [B]) from a rollout's groups of `RatedSample`s, on
    `device` (built in host memory, then moved whole)."""
    rated = [r for g in groups for r in g]
    batch = samples_to_batch([r.sample for r in rated], pad_token_id)
    scores = torch.tensor([r.reward for r in rated], dtype=torch.float32, device="cpu")
    group_index = torch.tensor([i for i, g in enumerate(groups) for _ in g], device="cpu")
    return batch.with_fields(scores=scores).to(device), group_index.to(device)


def engine_logprobs_of(samples, batch: TrainingBatch) -> torch.Tensor:
    """The engine's log-probs of the sampled tokens, [B, S] aligned like the actor's, on the
    batch's device; 0 on environment tokens (never sampled)."""
    out = torch.zeros(batch.input_ids.shape, device="cpu")
    for i, s in enumerate(samples):
        start = len(s.prompt_token_ids)
        out[i, start : start + len(s.logprobs)] = torch.tensor(s.logprobs, device="cpu")
        for a, b in env_spans_of(s, i):
            out[i, start + a : start + b] = 0
    return out.to(batch.input_ids.device)


def turn_index_of(samples, batch: TrainingBatch) -> torch.Tensor:
    """[B, S] long on the batch's device: k on the tokens of policy turn k and on the
    environment block that answers it, -1 on prompt and padding (per-turn metrics; the
    environment's tokens are those with turn >= 0 outside the response mask)."""
    out = torch.full(batch.input_ids.shape, -1, dtype=torch.long, device="cpu")
    for i, s in enumerate(samples):
        start, turn_start = len(s.prompt_token_ids), 0
        for k, (_, end) in enumerate(env_spans_of(s, i)):
            out[i, start + turn_start : start + end] = k
            turn_start = end
        out[i, start + turn_start : start + len(s.token_ids)] = len(getattr(s, "env_spans", ()))
    return out.to(batch.input_ids.device)


def step_rewards_of(samples, batch: TrainingBatch) -> torch.Tensor | None:
    """[B, S] float64 on the batch's device: each environment step's reward on the policy
    token that caused it (summed where several land on one), 0 elsewhere; None when no
    sample has one (single-turn rollouts, environments rewarding only the outcome)."""
    if not any(getattr(s, "step_rewards", None) for s in samples):
        return None
    out = torch.zeros(batch.input_ids.shape, dtype=torch.float64, device="cpu")
    for i, s in enumerate(samples):
        start, spans = len(s.prompt_token_ids), env_spans_of(s, i)
        for index, reward in s.step_rewards:
            in_env = any(a <= index < b for a, b in spans)
            if not 0 <= index < len(s.token_ids) or in_env:
                raise ValueError(
                    f"sample {i}: step reward {reward} at response token {index}, which is "
                    "not a policy token (expected the last token of the turn that caused it)"
                )
            out[i, start + index] += reward
    return out.to(batch.input_ids.device)


def mini_batches(
    batch: TrainingBatch, size: int, generator: torch.Generator
) -> list[TrainingBatch]:
    """Shuffled mini-batches of `size` rows (PPO reuses a batch over several epochs)."""
    order = torch.randperm(len(batch), generator=generator, device=generator.device)
    return [
        batch.rows(order[start : start + size]) for start in range(0, len(batch) - size + 1, size)
    ]


def forward_microbatches(rows: int, micro_batch_size: int) -> int:
    """Micro-batches for a forward-only pass: about `micro_batch_size` rows each, equal sizes
    (the pipeline schedule needs one shape)."""
    k = max(1, -(-rows // micro_batch_size))
    while rows % k:
        k += 1
    return k
