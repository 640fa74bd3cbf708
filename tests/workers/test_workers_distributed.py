"""Distributed tier: Actor / Critic / ReferencePolicy under torchrun (gloo, fp32).

The same global batch of variable-length responses must give the same gradients whatever
the split: micro-batches, DP ranks, TP, TP with sequence parallelism, PP, micro-batches
chosen by a token budget (uneven sizes and lengths; "-tok"), and packed micro-batches (rows
back to back, no padding; "-pack").
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatron_rl.launch import run_torchrun
from megatron_rl.models.hf_config import read_hf_config
from tests.tolerances import FP32_MODEL, assert_close

pytestmark = pytest.mark.distributed

LAYOUTS = [
    "dp1-mb4",
    "dp2-mb2",
    "tp2",
    "tp2-sp",
    "pp2",
    "dp1-tok",
    "dp2-tok",
    "tp2-sp-tok",
    "pp2-tok",
    "vpp2-tok",
    "dp1-pack",
    "tp2-pack",
    "tp2-sp-pack-tok",
    "pp2-pack-tok",
]


def merge(out_dir, name):
    """Per-rank results of one layout -> one view of the global batch."""
    merged = {"grads": {}, "critic_grads": {}, "metrics": {}, "host_reads": []}
    logprobs, values = {}, {}
    for f in sorted(out_dir.glob(f"{name}.rank*.pt")):
        r = torch.load(f, map_location="cpu")
        for loss, grads in r["grads"].items():
            merged["grads"].setdefault(loss, {}).update(grads)
        merged["critic_grads"].update(r["critic_grads"])
        merged["host_reads"].append(r["host_reads"])
        for loss, metrics in r["metrics"].items():
            if metrics:  # only the last pipeline stage computes the loss
                merged["metrics"][loss] = metrics
        logprobs[r["rows"]], values[r["rows"]] = r["logprobs"], r["values"]
    merged["logprobs"] = torch.cat([logprobs[k] for k in sorted(logprobs)])
    merged["values"] = torch.cat([values[k] for k in sorted(values)])
    return merged


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("workers")
    args = ["--hf-dir", str(tiny_model_dir), "--out-dir", str(out), "--layouts"]
    run_torchrun(
        "tests.torchrun.actor_critic", [*args, "dp1-mb1,dp1-mb4,dp1-tok,dp1-pack"], nproc=1
    )
    two = (
        "dp2-mb2,tp2,tp2-sp,pp2,dp2-tok,tp2-sp-tok,pp2-tok,vpp2-tok,dp2-bal,tp2-pack,"
        "tp2-sp-pack-tok,pp2-pack-tok"
    )
    run_torchrun("tests.torchrun.actor_critic", [*args, two], nproc=2)
    merged = {name: merge(out, name) for name in ["dp1-mb1", *LAYOUTS, "dp2-bal"]}
    merged["dp2-bal"]["ranks"] = [
        torch.load(f, map_location="cpu") for f in sorted(out.glob("dp2-bal.rank*.pt"))
    ]
    return merged


def relative_max_diff(reference: dict, other: dict) -> float:
    assert reference.keys() == other.keys()
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in reference.values())).item()
    assert norm > 0
    return max((reference[k] - other[k]).abs().max().item() for k in reference) / norm


@pytest.mark.parametrize("layout", [*LAYOUTS, "dp2-bal"])
@pytest.mark.parametrize("loss", ["token-mean+nll", "seq-mean-token-mean", "entropy+kl"])
def test_actor_gradients_do_not_depend_on_the_split(results, layout, loss):
    reference = results["dp1-mb1"]["grads"][loss]
    assert len(reference) == 51  # every HF tensor of the tiny model has a gradient
    assert relative_max_diff(reference, results[layout]["grads"][loss]) <= 1e-5


@pytest.mark.parametrize("layout", [*LAYOUTS, "dp2-bal"])
def test_critic_gradients_do_not_depend_on_the_split(results, layout):
    reference = results["dp1-mb1"]["critic_grads"]
    assert "score.weight" in reference and "lm_head.weight" not in reference
    assert relative_max_diff(reference, results[layout]["critic_grads"]) <= 1e-5


CALLS = 6
"""Role calls a layout's host reads are counted over: three actor updates, its log-probs,
the critic's values and its update (`tests/torchrun/actor_critic.py`)."""
HOST_READS = {
    # the metrics of an update, in one copy (four of the calls are updates)
    "tolist megatron_rl/workers/roles.py:compute_gradients": 4,
    # the rows' lengths, once a split, to cut micro-batches by a token budget or pack them
    "tolist megatron_rl/data/batch.py:split_micro_batches": CALLS,
    # a mask's values: on the CPU only (an accelerator checks them on the device)
    "_local_scalar_dense megatron_rl/algorithms/checks.py:check_mask": None,
    # megatron-core's pipeline stages exchange each activation's shape (variable lengths)
    "tolist megatron/core/pipeline_parallel/p2p_communication.py:_communicate_shapes": None,
}
"""Where an update, its log-probs and values may read tensors back to the host, and how often
at most (None: not counted)."""


@pytest.mark.parametrize("layout", [*LAYOUTS, "dp2-bal"])
def test_models_and_losses_read_nothing_back_to_the_host(results, layout):
    """On a GPU each read makes the host wait for the device's queue: packed or not, at any
    layout, no forward, loss or backward of a micro-batch reads (attention takes packed
    segments' bounds from the host, not from `cu_seqlens`); the few reads there are happen
    at the split and once for an update's metrics."""
    for rank, reads in enumerate(results[layout]["host_reads"]):
        unexpected = {site: n for site, n in reads.items() if site not in HOST_READS}
        assert not unexpected, f"{layout} rank {rank}: {unexpected}"
        for site, most in HOST_READS.items():
            assert most is None or reads.get(site, 0) <= most, (layout, rank, site, reads)


def test_balancing_re_deals_whole_rows_and_evens_the_ranks_tokens(results, tiny_model_dir):
    from tests.torchrun.actor_critic import global_batch

    batch = global_batch(read_hf_config(tiny_model_dir).vocab_size)
    ranks = results["dp2-bal"]["ranks"]
    assert [len(r["input_ids"]) for r in ranks] == [4, 4]  # each rank keeps its row count
    got = sorted(map(tuple, torch.cat([r["input_ids"] for r in ranks]).tolist()))
    assert got == sorted(map(tuple, batch.input_ids.tolist()))  # every row once, intact
    metrics = ranks[0]["balance"]
    assert metrics == ranks[1]["balance"]
    assert (
        1
        <= metrics["perf/dp_tokens_max_over_mean"]
        < metrics["perf/dp_tokens_max_over_mean_before"]
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logged_losses_are_the_global_batchs_whatever_the_split(results, layout):
    """The losses and the token means (entropy, ppo_kl, clip fractions) of the whole global
    batch (summed micro-batch shares), so they read the same for every split, as verl's do;
    a mean of micro-batch means would not."""
    reference, other = results["dp1-mb1"]["metrics"], results[layout]["metrics"]
    for loss, keys in {
        "token-mean+nll": ["pg_loss", "nll_loss", "entropy", "ppo_kl"],
        "entropy+kl": ["pg_loss", "kl_loss", "entropy"],
        "critic": ["vf_loss"],
    }.items():
        for key in keys:
            assert abs(reference[loss][key]) > 1e-3, (loss, key)  # not a trivial zero
            assert_close(other[loss][key], reference[loss][key], FP32_MODEL, f"{loss} {key}")
    for loss, key in [("token-mean+nll", "pg_clipfrac"), ("critic", "vf_clipfrac")]:
        assert_close(other[loss][key], reference[loss][key], FP32_MODEL, f"{loss} {key}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logprobs_and_values_do_not_depend_on_the_layout(results, layout, tiny_model_dir):
    from tests.torchrun.actor_critic import global_batch

    reference = {k: results["dp1-mb1"][k] for k in ("logprobs", "values")}
    if layout.endswith("-tok") or "-pack" in layout:
        # each micro-batch (packed: each row) stops at its rows' last response token
        batch = global_batch(read_hf_config(tiny_model_dir).vocab_size)
        seen = torch.arange(batch.seq_length) < batch.sequence_lengths()[:, None]
        assert not seen.all()  # some rows were cut, so the comparison below means something
        reference = {k: torch.where(seen, v, 0.0) for k, v in reference.items()}
    assert_close(results[layout]["logprobs"], reference["logprobs"], FP32_MODEL)
    assert_close(results[layout]["values"], reference["values"], FP32_MODEL)


def test_logprobs_equal_hugging_face(results, tiny_model_dir):
    from tests.torchrun.actor_critic import global_batch

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = global_batch(hf.config.vocab_size).input_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits, dim=-1)
    expected = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    for name in ("dp1-mb1", "tp2"):
        got = results[name]["logprobs"]
        assert (got[:, 0] == 0).all()  # the first token has no prefix
        assert_close(got[:, 1:], expected, FP32_MODEL, name)


def test_one_step_moves_every_trained_parameter_and_never_the_reference(tiny_model_dir, tmp_path):
    out = tmp_path / "step.pt"
    run_torchrun("tests.torchrun.actor_step", ["--hf-dir", str(tiny_model_dir), "--out", str(out)])
    s = torch.load(out, map_location="cpu")
    assert s["initial_logprob_gap"] == 0.0  # actor and reference start from the same weights
    # a reference whose head compiles its tile sums (model.use_fused_kernels) at TP=2
    assert s["fused_reference"] == {"asked_on_its_device": True, "compiled": True, "close": True}
    assert s["actor_params"] == s["critic_params"] == 51
    assert s["actor_unchanged"] == [] and s["critic_unchanged"] == []
    assert s["reference_changed"] == [] and not s["reference_has_grads"]
    assert s["reference_logprob_drift"] == 0.0 and s["actor_logprob_change"] > 1e-3
    assert s["actor_metrics"]["update_ok"] and s["critic_metrics"]["update_ok"]
    # the gradient norm taken once, clipped to it inside the fused AdamW, with no pass of its
    # own: megatron's own step (its norm to the bit, the weights to the clipped gradients'
    # one rounding)
    twins = s["twins"]
    assert twins["ours"]["update_ok"] and twins["megatron"][0]
    assert twins["ours"]["grad_norm"] == twins["megatron"][1] > 1e-3  # so every step clipped
    assert twins["weights_close"] and twins["separate_clips"] == 0 and twins["unchanged"] == 0
    (loss, norm), (weighted_loss, weighted_norm) = s["tis"]
    # every module evaluates in eval mode and trains in train mode, however they alternate
    assert s["mode_sequence"] == [[False], [True], [False], [True]]
    assert abs(loss) > 1e-4 and norm > 1e-4
    assert weighted_loss == pytest.approx(3 * loss, rel=1e-5)  # TIS weights scale the pg term
    assert weighted_norm == pytest.approx(3 * norm, rel=1e-4)  # ... and its gradient
    assert s["offloaded_bytes"] == 0 and s["after_offload"] == (loss, norm)  # grad_offload
    # param_offload: every parameter's storage emptied (actor and reference; one each without
    # the distributed optimizer), its bytes in host memory; brought back bit-equal by the
    # next use: the same loss, gradient and reference log-probs
    p = s["param_offload"]
    assert p["storages"] == p["params"] > 1 and p["bytes_while_away"] == 0
    assert p["host_bytes"] == p["param_bytes"] > 0
    assert p["weights_equal"] and p["reference_logprobs_equal"]
    assert p["loss_and_norm"] == (loss, norm)
    assert s["actor_metrics"]["skipped_nonfinite"] == 0.0
    # NaN advantages: the update is skipped and counted, every weight stays as it was.
    assert s["nan_metrics"]["skipped_nonfinite"] == 1.0 and not s["nan_metrics"]["update_ok"]
    assert s["nan_unchanged"] == 51
    # Entropy of a near-uniform random model over the 500 real tokens (padding masked).
    assert abs(s["actor_metrics"]["entropy"] - torch.log(torch.tensor(500.0)).item()) < 0.1


@pytest.fixture(scope="module", params=["qwen3", "llama-biases"])
def family_results(request, family_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("workers_family")
    args = ["--hf-dir", str(family_dir(request.param)), "--out-dir", str(out)]
    run_torchrun("tests.torchrun.actor_critic", [*args, "--layouts", "dp2-mb2,tp2,tp2-sp"])
    return {name: merge(out, name) for name in ["dp2-mb2", "tp2", "tp2-sp"]}


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_replicated_parameters_gradients_are_summed_over_tensor_parallel_ranks(
    family_results, layout
):
    """Qwen3's q/k norms are shared by every head, and TP splits the heads; Llama's o_proj
    and down_proj biases are added whole on every rank (on its sequence shard under SP): each
    rank's gradient is partial until megatron sums it over the TP group."""
    reference = family_results["dp2-mb2"]["grads"]["token-mean+nll"]
    shared = {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.o_proj.bias"}
    assert shared & reference.keys()
    assert relative_max_diff(reference, family_results[layout]["grads"]["token-mean+nll"]) <= 1e-5
    critic = family_results["dp2-mb2"]["critic_grads"]
    assert relative_max_diff(critic, family_results[layout]["critic_grads"]) <= 1e-5


def test_a_rewind_undoes_the_updates_since_the_snapshot_bit_for_bit(tiny_model_dir, tmp_path):
    """A stop between mini-batches: `snapshot_updates` then `rewind_updates` puts back the
    weights, Adam state and learning-rate schedule of the snapshot (an unstepped optimizer
    loses the state its updates made; the state's tensor objects may have been replaced, as
    megatron's optimizer offload does), and redoing the updates gives the same bits."""
    out = tmp_path / "rewind.pt"
    run_torchrun(
        "tests.torchrun.update_rewind", ["--hf-dir", str(tiny_model_dir), "--out", str(out)]
    )
    s = torch.load(out, map_location="cpu")
    assert s["start_has_no_adam_state"] and s["after_two_has_adam_state"]
    assert s["weights_moved"] and s["lr_moved"]  # the rewinds below had something to undo
    assert s["rewound_unstepped"] and s["rewound_stepped"]
    assert s["redone_metrics"] and s["redone_state"]
    assert s["lr_rewound"] == s["lr_after_two"]
    assert s["host_buffers_reused"] and s["host_bytes"] > 0


@pytest.fixture(scope="module")
def moe_results(family_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("workers_moe")
    args = ["--hf-dir", str(family_dir("qwen3-moe")), "--out-dir", str(out), "--layouts"]
    run_torchrun("tests.torchrun.actor_critic", [*args, "dp1-mb1"], nproc=1)
    run_torchrun(
        "tests.torchrun.actor_critic",
        [*args, "dp2-mb2,ep2,ep2-tok,tp2-sp-etp1,tp2-sp-ep2"],
        nproc=2,
    )
    names = ["dp1-mb1", "dp2-mb2", "ep2", "ep2-tok", "tp2-sp-etp1", "tp2-sp-ep2"]
    merged = {name: merge(out, name) for name in names}
    ranks = [torch.load(f, map_location="cpu") for f in sorted(out.glob("ep2-tok.rank*.pt"))]
    merged["ep2-tok"]["micro_batches"] = [r["metrics"]["critic"]["micro_batches"] for r in ranks]
    return merged


@pytest.mark.parametrize("layout", ["dp2-mb2", "ep2", "ep2-tok", "tp2-sp-etp1", "tp2-sp-ep2"])
def test_moe_gradients_at_ep2_equal_those_at_ep1(moe_results, layout):
    """Experts whole on two data-parallel ranks (EP1: reduced over the expert-data-parallel
    group, as megatron_rl marks them at every EP), whole on both TP ranks under TP=2+SP
    (expert-TP 1), split over two ranks (alltoall), with token budgets, and with TP=2+SP:
    the gradient of every expert, router and dense tensor is the
    one-process gradient."""
    for loss in ("token-mean+nll", "entropy+kl"):
        reference = moe_results["dp1-mb1"]["grads"][loss]
        assert len(reference) == 2 * (8 + 1 + 3 * 8) + 3  # every expert's too
        assert relative_max_diff(reference, moe_results[layout]["grads"][loss]) <= 1e-5
    reference = moe_results["dp1-mb1"]["critic_grads"]
    assert relative_max_diff(reference, moe_results[layout]["critic_grads"]) <= 1e-5
    reference = moe_results["dp1-mb1"]["logprobs"]
    if layout.endswith("-tok") or "-pack" in layout:
        # each micro-batch (packed: each row) stops at its rows' last response token
        reference = torch.where(moe_results[layout]["logprobs"] == 0, 0.0, reference)
    assert_close(moe_results[layout]["logprobs"], reference, FP32_MODEL)


def test_token_budgets_at_ep2_run_as_many_micro_batches_on_every_rank(moe_results, family_dir):
    """The two data-parallel ranks' rows need different numbers of micro-batches under the
    budget (so `ep2-tok` above would wait forever in an all-to-all without the agreement):
    both run the larger number."""
    from megatron_rl.data.batch import token_budget_partition
    from tests.torchrun.actor_critic import TOKEN_BUDGET, global_batch

    lengths = global_batch(read_hf_config(family_dir("qwen3-moe")).vocab_size).sequence_lengths()
    counts = [len(token_budget_partition(h.tolist(), TOKEN_BUDGET)) for h in lengths.chunk(2)]
    assert counts[0] != counts[1]
    assert moe_results["ep2-tok"]["micro_batches"] == [max(counts)] * 2


def test_router_losses_train_the_router_apart_from_the_policy_loss(family_dir, tmp_path):
    """Balancing and z-losses (megatron-core's) reach the router's gradient and the logs
    (`moe/*`), never `pg_loss`; the z-loss ignores padding; a frozen router stays as it was
    while everything else trains."""
    out = tmp_path / "router.pt"
    run_torchrun(
        "tests.torchrun.moe_router", ["--hf-dir", str(family_dir("qwen3-moe")), "--out", str(out)]
    )
    r = torch.load(out, map_location="cpu")
    plain, aux, z = r["plain"], r["aux"], r["z"]
    assert not any(k.startswith("moe/") for k in plain["metrics"])
    # Switch's balance loss is ~1 for a near-uniform router (E * sum f_i P_i, f_i ~ P_i ~ 1/E)
    assert 0.9 < aux["metrics"]["moe/load_balancing_loss"] < 1.5
    assert z["metrics"]["moe/z_loss"] > 0 and "moe/load_balancing_loss" not in z["metrics"]
    for case in (aux, z):
        assert case["metrics"]["pg_loss"] == pytest.approx(plain["metrics"]["pg_loss"], rel=1e-6)
        assert (case["router_grad"] - plain["router_grad"]).abs().max() > 1e-6
        # the experts' own gradients: the routes and weights are the same
        assert_close(case["expert_grad"], plain["expert_grad"], FP32_MODEL)
    assert r["z-padded"]["metrics"]["moe/z_loss"] == pytest.approx(
        z["metrics"]["moe/z_loss"], rel=1e-5
    )
    assert_close(r["z-padded"]["router_grad"], z["router_grad"], FP32_MODEL)
    frozen = r["frozen"]
    routers = {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}
    assert frozen["changed"] and not routers & set(frozen["changed"])
    assert len(frozen["changed"]) == 69 - 2  # every other tensor trained


def test_a_larger_teacher_gives_one_process_log_probs_on_the_jobs_layout_and_its_own(
    tiny_teacher_dir, tmp_path
):
    """On-policy distillation's teacher (6 layers, hidden 192, 6 heads: not the student's
    shape) through the role the trainer builds for it, on 2 ranks: at TP2 and PP2 as the
    job's layout, and on a layout of its own (TP2 or PP2 beside a job at DP2 whose ranks
    hold 5 and 3 rows of different lengths; DP2 beside a job at TP2). Every rank gets, for
    the rows it holds, the log-probs Hugging Face gives the teacher's checkpoint in one
    process."""
    from tests.torchrun.actor_critic import global_batch
    from tests.torchrun.teacher_logprobs import CASES

    run_torchrun(
        "tests.torchrun.teacher_logprobs",
        ["--teacher-dir", str(tiny_teacher_dir), "--out-dir", str(tmp_path)],
        nproc=2,
    )
    hf = AutoModelForCausalLM.from_pretrained(tiny_teacher_dir, dtype=torch.float32)
    assert hf.config.num_hidden_layers == 6 and hf.config.hidden_size == 192
    ids = global_batch(hf.config.vocab_size).input_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits, dim=-1)
    expected = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    for name in CASES:
        held = set()
        for rank in (0, 1):
            rows, got = torch.load(tmp_path / f"{name}_{rank}.pt")
            columns = got.shape[1]
            assert columns == (20 if name.startswith("dp2") and rank == 1 else 23)
            assert_close(
                got[:, 1:], expected[rows, : columns - 1], FP32_MODEL, f"{name} rank {rank}"
            )
            held |= set(rows)
        assert held == set(range(8)), name
