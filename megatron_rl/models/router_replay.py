"""Rollout routing replay (R3; Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv 2510.11370): the trainer's MoE routers take
the experts the engine chose for each token instead of choosing their own, so the policy
that is trained routes as the one that sampled. The router's probabilities stay those of the
trainer's own logits (megatron-core gathers its scores at the given experts), so its gradient
still flows.

Built on megatron-core's `RouterReplay` (one per `TopKRouter` with `moe_enable_routing_replay`),
driven per router, never through its process-wide instance list (which holds every router
ever built in the process: actor, reference, discarded models; NeMo-RL does the same).

Per micro-batch, layer by layer, the batch's routes [b, s, layers, k] become each router's
targets in megatron's token order: [s, b] flattened s-major, this rank's slice of the
sequence under sequence parallelism; before the forward the routers replay them, after it
they switch to replaying them again for activation recompute in backward (FIFO, the order
1F1B runs backwards). Or, recording (routing replay off, `log_mismatch`): the routers choose
their own experts, which are compared with the engine's on the response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.data.batch import TrainingBatch
from megatron_rl.models.hf_mapping import unwrap

ROUTER_REPLAY_MODES = ("disabled", "R3")


@dataclass(frozen=True)
class RouterReplayConfig:
    """`actor.router_replay` (verl's names)."""

    mode: str = "disabled"
    """"disabled": the trainer routes on its own; "R3": the actor's old-log-prob pass and
    every update replay the experts the rollout engine chose (the engine records them;
    the reference policy and a critic always route on their own)."""
    log_mismatch: bool = False
    """With mode "disabled": record the trainer's routes in the old-log-prob pass and log
    where they differ from the engine's (`routing/mismatch/*`; the R3 paper's measure)."""

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_REPLAY_MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {ROUTER_REPLAY_MODES}")
        if self.log_mismatch and self.mode != "disabled":
            raise ValueError("log_mismatch is for mode disabled: under R3 the routes are equal")

    @property
    def needs_routes(self) -> bool:
        """Whether the engine must record its routes and the routers replay or record."""
        return self.mode != "disabled" or self.log_mismatch


def routers(model) -> list:
    """(global MoE layer index, its router) of a model chunk's layers."""
    out = []
    for layer in unwrap(model).decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            if router.router_replay is None:
                raise ValueError(
                    "the model was built without moe_enable_routing_replay (MoEConfig"
                    ".routing_replay): its routers cannot replay or record"
                )
            out.append((layer.layer_number - 1, router))
    return out


def local_routes(mb: TrainingBatch, layer: int, model) -> torch.Tensor:
    """[tokens on this rank, k] int64: the micro-batch's routes of one layer in megatron's
    token order ([s, b] flattened s-major; under sequence parallelism this TP rank's
    contiguous slice of the sequence)."""
    # why: megatron-core takes seconds to import: loaded on first use
    from megatron.core import parallel_state

    routes = mb.routed_experts[:, :, layer, :].transpose(0, 1)  # [s, b, k]
    if unwrap(model).config.sequence_parallel:
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        routes = routes.chunk(tp, dim=0)[rank]
    return routes.reshape(-1, routes.shape[-1]).long()


class RouteReplay:
    """Hooks for `workers.schedule.run_schedule`: replay the batch's routes (`record=False`)
    or record the routers' own and count where they differ from the batch's."""

    def __init__(self, chunks: list, record: bool = False):
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.actions = RouterReplayAction
        self.routers = {id(chunk): routers(chunk) for chunk in chunks}
        self.sequence_parallel = unwrap(chunks[0]).config.sequence_parallel
        self.record = record
        self.mismatch: dict[int, tuple[TrainingBatch, torch.Tensor]] = {}
        """Recording: per micro-batch (in schedule order) [b, s] mismatched layers of each
        token, of this rank's layers and tokens."""

    def before_forward(self, mb: TrainingBatch, model) -> None:
        if mb.routed_experts is None:
            raise ValueError("routing replay: the batch carries no routed_experts")
        for layer, router in self.routers[id(model)]:
            replay = router.router_replay
            if self.record:
                replay.set_router_replay_action(self.actions.RECORD)
            else:
                replay.set_target_indices(local_routes(mb, layer, model))
                replay.set_router_replay_action(self.actions.REPLAY_FORWARD)

    def after_forward(self, mb: TrainingBatch, model) -> None:
        if not self.record:
            for _, router in self.routers[id(model)]:
                router.router_replay.set_router_replay_action(self.actions.REPLAY_BACKWARD)
            return
        counts = None
        for layer, router in self.routers[id(model)]:
            mine = router.router_replay.get_recorded_indices()
            theirs = local_routes(mb, layer, model).to(mine.device)
            differs = (mine.sort(-1).values != theirs.sort(-1).values).any(-1)
            counts = differs.long() if counts is None else counts + differs.long()
        if counts is not None:
            counts = self._to_batch_positions(counts, mb, model)
            if id(mb) in self.mismatch:  # another model chunk (virtual pipeline stage)
                counts = counts + self.mismatch[id(mb)][1]
            self.mismatch[id(mb)] = (mb, counts)

    def mismatch_metrics(self, layers: int) -> dict[str, float]:
        """After a recording pass, on every rank of the role: the share of (response token, layer) pairs whose experts differ from the
        engine's, of response tokens with at least one such layer, and the layers per such
        token. Each row's last token is left out (the engine never ran it)."""
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core import parallel_state

        device = next(iter(self.mismatch.values()))[1].device
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        for mb, counts in self.mismatch.values():
            torch.distributed.all_reduce(
                counts, group=parallel_state.get_pipeline_model_parallel_group()
            )
            if self.sequence_parallel:  # each TP rank saw its own tokens
                torch.distributed.all_reduce(
                    counts, group=parallel_state.get_tensor_model_parallel_group()
                )
            positions = torch.arange(mb.seq_length, device=counts.device)
            ran = positions < mb.sequence_lengths().to(counts.device)[:, None] - 1
            seen = mb.response_mask.to(counts.device).bool() & ran
            totals += torch.stack(
                [counts[seen].sum(), seen.sum(), (counts[seen] > 0).sum()]
            ).double()
        group = parallel_state.get_data_parallel_group()
        torch.distributed.all_reduce(totals, group=group)
        pairs, tokens, tokens_off = totals.tolist()
        return {
            "routing/mismatch/layer_frac": pairs / max(tokens * layers, 1),
            "routing/mismatch/token_frac": tokens_off / max(tokens, 1),
            "routing/mismatch/layers_per_token": pairs / max(tokens_off, 1),
        }

    @staticmethod
    def _to_batch_positions(counts: torch.Tensor, mb: TrainingBatch, model) -> torch.Tensor:
        """[local tokens] in megatron's order -> [b, s] (zeros outside this rank's slice)."""
        # why: megatron-core takes seconds to import: loaded on first use
        from megatron.core import parallel_state

        b, s = mb.input_ids.shape
        full = torch.zeros(s, b, dtype=torch.long, device=counts.device)
        if unwrap(model).config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            rank = parallel_state.get_tensor_model_parallel_rank()
            full.chunk(tp, dim=0)[rank].copy_(counts.view(-1, b))
        else:
            full.copy_(counts.view(s, b))
        return full.transpose(0, 1)

    def finish(self) -> None:
        """After the pass: every router back to routing on its own, its targets dropped."""
        for chunk_routers in self.routers.values():
            for _, router in chunk_routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
