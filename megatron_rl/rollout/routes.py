"""Which experts the vLLM engine routed each token to: the input of rollout routing replay
(R3, Ma et al. 2025, arXiv 2510.11370), recorded on vLLM 0.32's V1 model runner.

vLLM's own recorder (`enable_return_routed_experts`) needs its Model Runner V2, which the CPU
build cannot run (no Triton CPU backend; docs/design/moe.md §3), so the engine's MoE routers
are hooked the way vLLM's recorder hooks them: each router's capture callback receives the
step's top-k expert ids [step tokens, k] after routing (before any expert-parallel load
balancer remaps them), once per MoE layer. Which request each row belongs to comes from the
runner's `_prepare_inputs` (its requests in batch order, tokens scheduled, tokens already
computed). Rows are kept per request and position, with the token at that position, so a
finished response is matched to its rows by content, whatever vLLM names its requests.

A token served from the prefix cache is never run and has no route: the engine records with
prefix caching off. A response's routes cover its prompt and response but the last token
(sampled, never run): [prompt + response - 1, layers, k], uint8 (up to 256 experts), as
vLLM's and SGLang's recorders return them.

Functions named `*_worker` run on every vLLM worker through `LLM.collective_rpc`; the state
lives on the worker's model runner.
"""

from __future__ import annotations

import numpy as np

_ATTR = "_megatron_rl_routes"


class _Recorder:
    """Per-request rows of one engine worker."""

    def __init__(self, layers: int, topk: int):
        self.layers, self.topk = layers, topk
        self.layout: list[tuple[str, int, int]] = []
        self.requests: dict[str, dict] = {}

    def request(self, rid: str) -> dict:
        if rid not in self.requests:
            self.requests[rid] = {
                "tokens": np.full(64, -1, dtype=np.int64),
                "routes": np.zeros((64, self.layers, self.topk), dtype=np.uint8),
                "seen": np.zeros((64, self.layers), dtype=bool),
            }
        return self.requests[rid]

    @staticmethod
    def grow(req: dict, length: int) -> None:
        size = len(req["tokens"])
        if length <= size:
            return
        new = max(length, 2 * size)
        for key, fill in (("tokens", -1), ("routes", 0), ("seen", False)):
            grown = np.full((new, *req[key].shape[1:]), fill, dtype=req[key].dtype)
            grown[:size] = req[key]
            req[key] = grown

    def step(self, runner, num_scheduled_tokens) -> None:
        batch = runner.input_batch
        n = batch.num_reqs
        self.layout = []
        for i, rid in enumerate(batch.req_ids[:n]):
            start, count = int(batch.num_computed_tokens_cpu[i]), int(num_scheduled_tokens[i])
            req = self.request(rid)
            self.grow(req, start + count)
            req["tokens"][start : start + count] = batch.token_ids_cpu[i, start : start + count]
            self.layout.append((rid, start, count))

    def capture(self, layer: int, topk_ids) -> None:
        ids = topk_ids.detach().to("cpu").numpy()
        row = 0
        for rid, start, count in self.layout:
            req = self.requests[rid]
            req["routes"][start : start + count, layer] = ids[row : row + count]
            req["seen"][start : start + count, layer] = True
            row += count

    def take(self, sequence: list[int]) -> np.ndarray | None:
        """Rows [len - 1, layers, k] of a request that ran `sequence[:-1]` at every layer,
        removed from the pool; None if no request did."""
        want = np.asarray(sequence[:-1], dtype=np.int64)
        for rid, req in self.requests.items():
            tokens, seen = req["tokens"], req["seen"]
            n = len(want)
            if len(tokens) < n or not np.array_equal(tokens[:n], want):
                continue
            if n < len(tokens) and tokens[n] != -1:
                continue  # a longer request sharing this prefix
            if not seen[:n].all():
                continue
            del self.requests[rid]
            return req["routes"][:n].copy()
        return None


def _moe_runners(model):
    # why: vLLM is optional and slow to import: only the vLLM engine needs it
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    for module in model.modules():
        if isinstance(module, MoERunner):
            if not isinstance(module.router, BaseRouter):
                raise ValueError(
                    f"routed experts cannot be recorded with router {type(module.router).__name__}"
                )
            yield module


def install_worker(worker, topk: int) -> int:
    """Hook this worker's routers and its runner's step; returns the MoE layers hooked."""
    runner = worker.model_runner
    if not hasattr(runner, "_prepare_inputs"):
        raise RuntimeError(
            f"recording routed experts hooks vLLM's V1 model runner, but this engine runs "
            f"{type(runner).__name__} (vLLM's Model Runner V2, chosen where Triton runs): start "
            "it with VLLM_USE_V2_MODEL_RUNNER=0"
        )
    runners = list(_moe_runners(runner.model))
    if not runners:
        raise ValueError("routed experts can only be recorded for a mixture-of-experts model")
    layers = {m.layer_id for m in runners}
    recorder = _Recorder(max(layers) + 1, topk)
    prepare = runner._prepare_inputs

    def prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        recorder.step(runner, num_scheduled_tokens)
        return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner._prepare_inputs = prepare_inputs
    for m in runners:
        m.router.set_capture_fn(lambda ids, layer=m.layer_id: recorder.capture(layer, ids))
    setattr(runner, _ATTR, recorder)
    return len(layers)


def take_worker(worker, sequences: list[list[int]]) -> list[np.ndarray | None]:
    """Each sequence's rows (`_Recorder.take`), then the pool is emptied (rows of requests
    that were aborted or are not asked for go with it)."""
    recorder = getattr(worker.model_runner, _ATTR)
    out = [recorder.take(seq) for seq in sequences]
    recorder.requests.clear()
    return out
