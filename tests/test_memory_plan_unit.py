"""The memory planner: parameter counts, sharding arithmetic, the 32B recipe's layout, the CLI.
Its estimate against a real actor's tensors: test_memory_check_distributed.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from megatron_rl.memory_plan import (
    OFFLOADABLE,
    MemoryPlanConfig,
    PlanError,
    activation_bytes,
    head_workspace_bytes,
    plan_memory,
    stage_params,
)
from megatron_rl.models.presets import (
    lora_layer_param_count,
    param_count,
    preset_arch,
    resolve_arch,
)
from tools.plan_memory import main as plan_main
from tools.plan_memory import offload_keys, recipe_offload, recipe_settings

REPO = Path(__file__).resolve().parents[1]
RECIPE_32B = REPO / "examples/qwen2.5-32b/vapo.yaml"


@pytest.mark.parametrize(
    "preset, published",
    # Parameter counts of the Hugging Face checkpoints (model cards / safetensors index).
    [
        ("qwen2.5-0.5b", 494_032_768),
        ("qwen2.5-7b", 7_615_616_512),
        ("qwen2.5-32b", 32_763_876_352),
        ("llama-3.1-8b", 8_030_261_248),
    ],
)
def test_preset_parameter_counts_match_the_published_models(preset, published):
    assert param_count(preset_arch(preset)) == published


@pytest.mark.parametrize(
    "preset, total_b, non_embedding_b, half_unit",
    # The model cards' counts, rounded to 0.1 (or 0.01) billion.
    [("qwen3-8b", 8.2, 6.95, 0.005), ("qwen3-32b", 32.8, 31.2, 0.05)],
)
def test_qwen3_counts_match_the_model_cards(preset, total_b, non_embedding_b, half_unit):
    arch = preset_arch(preset)
    total = param_count(arch) / 1e9
    embeddings = 2 * arch.vocab_size * arch.hidden_size / 1e9
    assert total == pytest.approx(total_b, abs=0.05)
    assert total - embeddings == pytest.approx(non_embedding_b, abs=half_unit)


def test_one_gpu_holds_the_whole_model_with_its_padded_vocabulary():
    arch = preset_arch("qwen2.5-7b")
    padding = (arch.padded_vocab_size(1) - arch.vocab_size) * arch.hidden_size * 2
    assert stage_params(arch, MemoryPlanConfig(), "actor") == param_count(arch) + padding


def test_tensor_and_pipeline_parallelism_shard_the_parameters():
    arch = preset_arch("qwen2.5-32b")
    one = stage_params(arch, MemoryPlanConfig(), "actor")
    tp8 = stage_params(arch, MemoryPlanConfig(tensor_model_parallel_size=8), "actor")
    tp8pp2 = stage_params(
        arch,
        MemoryPlanConfig(tensor_model_parallel_size=8, pipeline_model_parallel_size=2),
        "actor",
    )
    # Everything but the norms (2 per layer + the final one) is split over TP.
    norms = (2 * arch.num_layers + 1) * arch.hidden_size
    assert tp8 == (one - norms) // 8 + norms
    # Half the layers plus one vocabulary matrix; the last stage also has the final norm.
    vocab = arch.padded_vocab_size(8) * arch.hidden_size // 8
    assert tp8pp2 == (tp8 - 2 * vocab - arch.hidden_size) // 2 + vocab + arch.hidden_size
    critic = stage_params(arch, MemoryPlanConfig(tensor_model_parallel_size=8), "critic")
    assert tp8 - critic == vocab - arch.hidden_size  # value head [1, h] for the vocabulary


def test_distributed_optimizer_shards_only_the_adam_state():
    arch = preset_arch("qwen2.5-7b")
    base = MemoryPlanConfig(tensor_model_parallel_size=4, data_parallel_size=8)
    plain = plan_memory(arch, dataclasses.replace(base, use_distributed_optimizer=False))
    sharded = plan_memory(arch, base)
    assert sharded.states["actor_weights"] == plain.states["actor_weights"]
    assert sharded.states["actor_grads"] == plain.states["actor_grads"]
    assert sharded.states["actor_optimizer"] == pytest.approx(
        plain.states["actor_optimizer"] / 8, abs=1
    )
    # bf16: 2 B weights, 4 B fp32 grads, 12 B fp32 master + Adam m, v.
    n = plain.params_per_gpu["actor"]
    assert plain.states["actor_optimizer"] == 12 * n and plain.states["actor_grads"] == 4 * n


def test_recompute_and_sequence_parallelism_cut_activations():
    arch = preset_arch("qwen2.5-7b")
    base = MemoryPlanConfig(tensor_model_parallel_size=4, seq_length=8192)
    none = activation_bytes(arch, base, "actor")
    sp = activation_bytes(arch, dataclasses.replace(base, sequence_parallel=True), "actor")
    full = activation_bytes(arch, dataclasses.replace(base, recompute_granularity="full"), "actor")
    assert full < sp < none
    # Flash attention keeps no s x s scores, so selective recompute buys nothing on `te`;
    # on `local` (PyTorch's fused attention) it costs a little: its output becomes a copy of
    # its own and one layer's core is saved again while it is recomputed.
    selective = dataclasses.replace(base, recompute_granularity="selective")
    assert activation_bytes(arch, selective, "actor") == none
    local = dataclasses.replace(base, profile="local", params_dtype="fp32")
    local_selective = dataclasses.replace(local, recompute_granularity="selective")
    assert activation_bytes(arch, local_selective, "actor") > activation_bytes(arch, local, "actor")


def test_a_token_budget_bounds_the_activations_of_a_micro_batch():
    """use_dynamic_bsz: activations follow the budget's tokens, not micro_batch_size x the
    longest sequence; a budget of exactly those tokens plans the same bytes."""
    arch = preset_arch("qwen2.5-7b")
    for profile, dtype in (("te", "bf16"), ("local", "fp32")):
        rows = MemoryPlanConfig(
            micro_batch_size=4, seq_length=8192, profile=profile, params_dtype=dtype
        )
        same = dataclasses.replace(rows, micro_batch_size=1, max_tokens_per_micro_batch=4 * 8192)
        half = dataclasses.replace(same, max_tokens_per_micro_batch=2 * 8192)
        for role in ("actor", "critic"):
            assert activation_bytes(arch, same, role) == activation_bytes(arch, rows, role)
            assert activation_bytes(arch, half, role) < activation_bytes(arch, same, role)


def test_pipeline_keeps_pp_microbatches_in_flight_and_interleaving_more():
    arch = preset_arch("qwen2.5-7b")
    pp4 = MemoryPlanConfig(pipeline_model_parallel_size=4, num_microbatches=16, seq_length=1024)
    base = activation_bytes(
        arch, dataclasses.replace(pp4, pipeline_model_parallel_size=1), "critic"
    )
    staged = activation_bytes(arch, pp4, "critic")
    # 4 in flight x 1/4 of the layers: the first stage holds one whole model's worth.
    assert staged == pytest.approx(base, rel=0.01)
    vpp = dataclasses.replace(pp4, virtual_pipeline_model_parallel_size=7)
    # Korthikanti et al.: interleaving multiplies it by 1 + (p - 1) / (p * v).
    assert activation_bytes(arch, vpp, "critic") == pytest.approx(staged * (1 + 3 / 28), rel=0.01)


def test_the_32b_recipe_fits_80gb_and_its_neighbours_do_not():
    settings = recipe_settings(str(RECIPE_32B))
    arch = preset_arch("qwen2.5-32b")
    chosen = plan_memory(arch, MemoryPlanConfig(**settings, data_parallel_size=8))
    assert chosen.fits, chosen.notes
    assert settings["seq_length"] == 2048 + 20480 and settings["critic"]
    assert not settings["reference"]  # VAPO has no KL term
    for change in (
        dict(vllm_gpu_memory_utilization=0.6),  # vLLM would not leave room for the states
        dict(use_distributed_optimizer=False),
        dict(pipeline_model_parallel_size=1),
    ):
        variant = MemoryPlanConfig(**{**settings, **change}, data_parallel_size=8)
        assert not plan_memory(arch, variant).fits, change


def test_offload_takes_exactly_its_states_bytes_off_the_generation_peak():
    """Each offloaded state leaves the generation phase by its own bytes, together by their
    sum; training brings everything back, so its phase does not change."""
    arch = preset_arch("qwen2.5-32b")
    base = MemoryPlanConfig(
        tensor_model_parallel_size=8, pipeline_model_parallel_size=2, data_parallel_size=8,
        sequence_parallel=True, recompute_granularity="full", seq_length=22528,
        reference=True, vllm_gpu_memory_utilization=0.5, teacher=arch,
    )  # fmt: skip
    plain = plan_memory(arch, base)
    keys = [f"{role}_{kind}" for role, kinds in OFFLOADABLE.items() for kind in kinds]
    assert len(keys) == 8 and plain.offloaded_bytes == 0
    for key in keys:
        moved = plan_memory(arch, dataclasses.replace(base, offload=(key,)))
        assert plain.states[key] > 0 and moved.offloaded_bytes == plain.states[key]
        assert plain.rollout_bytes - moved.rollout_bytes == plain.states[key]
        assert moved.train_bytes == plain.train_bytes
    everything = plan_memory(arch, dataclasses.replace(base, offload=tuple(keys)))
    assert everything.rollout_bytes == plain.vllm_bytes  # no state left on the device
    assert plain.rollout_bytes - everything.rollout_bytes == plain.states_bytes
    # bf16 parameters: param_offload moves 2 bytes a parameter
    assert plain.states["actor_weights"] == 2 * plain.params_per_gpu["actor"]


def test_fp8_weight_copies_are_not_parameters_and_stay():
    arch = preset_arch("qwen2.5-7b")
    fp8 = MemoryPlanConfig(tensor_model_parallel_size=4, fp8=True, offload=("actor_weights",))
    plan = plan_memory(arch, fp8)
    n = plan.params_per_gpu["actor"]
    assert plan.states["actor_weights"] == 2 * n and plan.states["actor_fp8_weight_copies"] == 2 * n
    assert plan.offloaded_bytes == 2 * n


def test_the_rewind_copy_is_the_trained_roles_weights_and_optimizer_shards():
    """`trainer.rewindable_update`'s host copy: no gradients, no reference, and the optimizer
    part shrinks with the distributed optimizer's DP sharding."""
    arch = preset_arch("qwen2.5-7b")
    layout = dict(tensor_model_parallel_size=4, data_parallel_size=4, params_dtype="bf16")
    plans = {
        sharded: plan_memory(arch, MemoryPlanConfig(**layout, use_distributed_optimizer=sharded))
        for sharded in (False, True)
    }
    for plan in plans.values():
        s = plan.states
        copied = s["actor_weights"] + s["actor_optimizer"] + s["critic_weights"]
        assert plan.rewind_host_bytes == copied + s["critic_optimizer"]
    n = plans[True].params_per_gpu["actor"]
    assert plans[False].states["actor_optimizer"] == 12 * n  # fp32 masters and two moments
    assert plans[True].states["actor_optimizer"] == 3 * n  # ... over 4 DP ranks


def test_the_32b_recipe_with_offload_generates_on_the_vllm_share_alone(capsys):
    argv = ["--model", "qwen2.5-32b", "--recipe", str(RECIPE_32B), "--dp", "8", "--json"]
    assert plan_main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plan_main(argv + ["--offload", "params,grads,optimizer"]) == 0
    moved = json.loads(capsys.readouterr().out)
    states = plain["actor_states_gib"] + plain["critic_states_gib"]
    assert plain["offloaded_gib"] == 0 and moved["offloaded_gib"] == pytest.approx(states)
    assert moved["rollout_gib"] == moved["vllm_gib"] and moved["train_gib"] == plain["train_gib"]
    assert moved["margin_gib"] == pytest.approx(plain["margin_gib"] + states, abs=0.1)
    # the recipe's own settings, and the kinds expanded over the roles a plan has
    assert recipe_settings(str(RECIPE_32B))["offload"] == ()
    from megatron_rl.config import load_config

    c = load_config(RECIPE_32B, ["actor.param_offload=true", "critic.grad_offload=true"])
    assert recipe_offload(c) == ("actor_weights", "critic_grads")
    assert offload_keys("params,critic_optimizer", critic=True, reference=False) == (
        "actor_weights", "critic_weights", "critic_optimizer",
    )  # fmt: skip
    assert offload_keys("none", critic=True, reference=True) == ()


def test_vllm_memory_that_cannot_hold_its_weights_is_reported():
    arch = preset_arch("qwen2.5-32b")
    c = MemoryPlanConfig(
        tensor_model_parallel_size=8, vllm_gpu_memory_utilization=0.1, vllm_tensor_parallel_size=1
    )
    plan = plan_memory(arch, c)
    assert not plan.fits and "gpu_memory_utilization" in plan.notes[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(recompute_granularity="partial"), "recompute_granularity='partial'"),
        (dict(profile="gpu"), "profile='gpu'"),
        (dict(vllm_gpu_memory_utilization=1.5), "vllm_gpu_memory_utilization=1.5"),
        (dict(seq_length=0), "seq_length=0"),
        (dict(offload=("actor_params",)), "offload 'actor_params': expected some of"),
        (dict(offload=("reference_weights",)), "offload 'reference_weights': the plan has no"),
        (dict(critic=False, offload=("critic_grads",)), "the plan has no critic"),
        (
            dict(params_dtype="fp32", offload=("actor_optimizer",)),
            "offload 'actor_optimizer' needs params_dtype=bf16",
        ),
        (dict(fp8=True, params_dtype="fp32"), "fp8 needs params_dtype=bf16"),
        (
            dict(seq_length=4096, max_tokens_per_micro_batch=4000),
            "max_tokens_per_micro_batch=4000 is below seq_length=4096",
        ),
        (  # the 32B layout with one vLLM engine over both pipeline stages: two replicas
            dict(
                tensor_model_parallel_size=8,
                pipeline_model_parallel_size=2,
                data_parallel_size=8,
                vllm_tensor_parallel_size=16,
            ),
            "vllm_tensor_parallel_size=16 puts ranks 0..15 in one vLLM engine",
        ),
    ],
)
def test_bad_settings_name_the_parameter(kwargs, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(")):
        MemoryPlanConfig(**kwargs)


def test_layout_that_cannot_split_the_model_is_refused():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=16 does not divide"):
        plan_memory(preset_arch("qwen2.5-32b"), MemoryPlanConfig(tensor_model_parallel_size=16))


def test_resolve_arch_reads_a_config_file_and_names_an_unknown_model(tiny_model_dir):
    assert resolve_arch(str(tiny_model_dir)).hidden_size == preset_arch("tiny").hidden_size
    with pytest.raises(ValueError, match="'qwen9' is neither a preset"):
        resolve_arch("qwen9")


def test_cli_sweeps_layouts_and_exits_by_fit(capsys):
    argv = ["--model", "qwen2.5-32b", "--seq-length", "22528", "--sequence-parallel",
            "--distributed-optimizer", "--vllm-gpu-memory-utilization", "0.5", "--vllm-tp", "8",
            "--tp", "8", "--pp", "2", "--dp", "8", "--json"]  # fmt: skip
    assert plan_main(argv + ["--recompute", "full"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["layout"] == "TP8PP2DP8SP" and row["gpus"] == 128 and row["fits"]
    assert plan_main(argv[:-1] + ["--pp", "1,2", "--dp", "1"]) == 1  # some do not fit
    table = capsys.readouterr().out.splitlines()
    assert table[1].startswith("| layout |") and len(table) == 5
    assert plan_main(["--model", "qwen9"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert plan_main(["--recipe", "examples/none.yaml"]) == 2
    assert "examples/none.yaml" in capsys.readouterr().err


RECIPE_30B_A3B = REPO / "examples/qwen3-30b-a3b/grpo.yaml"


def test_qwen3_30b_a3b_counts_match_the_model_card():
    """ "30.5B in total and 3.3B activated, 29.9B non-embedding" (the model card)."""
    from megatron_rl.models.presets import active_param_count

    arch = preset_arch("qwen3-30b-a3b")
    embeddings = 2 * arch.vocab_size * arch.hidden_size
    assert param_count(arch) / 1e9 == pytest.approx(30.5, abs=0.05)
    assert (param_count(arch) - embeddings) / 1e9 == pytest.approx(29.9, abs=0.05)
    assert active_param_count(arch) / 1e9 == pytest.approx(3.35, abs=0.005)


def test_experts_split_over_ep_and_their_adam_state_over_expert_data_parallel():
    """TP2+SP, EP8, ETP1 on 16 GPUs: each GPU 16 of every layer's 128 experts (3.62B) and the
    dense part split over TP (0.78B); Adam's 12 B per parameter over DP 8 for the dense part,
    over expert-DP 16 / (1 x 8) = 2 for the experts."""
    arch = preset_arch("qwen3-30b-a3b")
    c = MemoryPlanConfig(
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        expert_model_parallel_size=8,
        expert_tensor_parallel_size=1,
        data_parallel_size=8,
        critic=False,
    )
    assert c.expert_data_parallel_size == 2
    plan = plan_memory(arch, c)
    dense, experts = stage_params(arch, c, "actor"), 48 * 16 * 3 * 2048 * 768
    assert dense / 1e9 == pytest.approx(0.78, abs=0.005) and experts / 1e9 == pytest.approx(
        3.62, abs=0.005
    )
    assert plan.params_per_gpu["actor"] == dense + experts
    assert plan.states["actor_weights"] == 2 * (dense + experts)
    assert plan.states["actor_optimizer"] == -(-12 * dense // 8) + 12 * experts // 2
    with pytest.raises(PlanError, match="not divisible by ETP x EP x PP = 1 x 8 x 1"):
        plan_memory(arch, dataclasses.replace(c, data_parallel_size=2))  # 4 GPUs
    with pytest.raises(PlanError, match="need a MoE model"):
        plan_memory(preset_arch("qwen3-8b"), dataclasses.replace(c, data_parallel_size=4))


def test_the_30b_a3b_recipe_fits_16_h100_and_8_only_thinly():
    settings = recipe_settings(str(RECIPE_30B_A3B))
    arch = preset_arch("qwen3-30b-a3b")
    on16 = plan_memory(arch, MemoryPlanConfig(**settings, data_parallel_size=8))
    on8 = plan_memory(arch, MemoryPlanConfig(**settings, data_parallel_size=4))
    assert on16.fits and on16.margin_bytes > 20 * 2**30
    # the numbers in the recipe's header
    assert (
        round(on16.train_bytes / 2**30, 1) == 54.9 and round(on16.rollout_bytes / 2**30, 1) == 48.0
    )
    assert round(on8.train_bytes / 2**30, 1) == 76.2 and not on8.fits
    lean = dataclasses.replace(on8.config, logits_checkpointing=True)
    lean8 = plan_memory(arch, lean)
    assert round(lean8.train_bytes / 2**30, 1) == 73.0 and lean8.margin_bytes < 4 * 2**30
    # the plan that does not fit names the least costly setting that makes it fit
    assert on8.notes == [
        "with actor.logits_checkpointing: true the plan fits: training 73.0 GiB (3.2 GiB less)"
    ]
    assert not on16.notes and not lean8.notes


def test_a_plan_that_does_not_fit_names_the_least_costly_recompute_that_would():
    settings = recipe_settings(str(RECIPE_32B))
    arch = preset_arch("qwen2.5-32b")
    c = MemoryPlanConfig(
        **{**settings, "recompute_granularity": None},
        data_parallel_size=4,
        gpu_memory_gib=78.0,
    )
    plan = plan_memory(arch, c)
    assert not plan.fits
    # the critic's activations set the training peak: the head's logits alone cannot help
    full = plan_memory(arch, dataclasses.replace(c, recompute_granularity="full"))
    assert (
        full.fits and not plan_memory(arch, dataclasses.replace(c, logits_checkpointing=True)).fits
    )
    assert plan.notes == [
        f"with model.recompute.granularity: full the plan fits: training "
        f"{full.train_bytes / 2**30:.1f} GiB ({(plan.train_bytes - full.train_bytes) / 2**30:.1f} "
        "GiB less)"
    ]
    # nothing the run could add fits it (the rollout phase, or a GPU too small): no note
    tiny_gpu = plan_memory(arch, dataclasses.replace(c, gpu_memory_gib=30.0))
    assert not tiny_gpu.fits and not tiny_gpu.notes


def test_no_term_grows_with_the_square_of_the_sequence_or_holds_whole_logits():
    """Fused attention (both profiles) and tiled log-probs: a sequence twice as long costs
    twice the activations (up to the bounded logit workspace), and the workspace of a 152k
    vocabulary stops growing once a micro-batch is longer than one tile: a square tile of
    fp32 logits and three tensors its size, in bf16 the fp32 sum of its tokens' hidden
    gradient, and the projection's fp32 gradient (in bf16 rounded once the tiles are done)."""
    arch = preset_arch("qwen2.5-0.5b")
    vocab, h = arch.padded_vocab_size(1), arch.hidden_size
    for profile, dtype in (("te", "bf16"), ("local", "fp32"), ("local", "bf16")):
        c = MemoryPlanConfig(
            micro_batch_size=1, seq_length=16384, profile=profile, params_dtype=dtype, critic=False
        )
        double = dataclasses.replace(c, seq_length=32768)
        assert activation_bytes(arch, double, "actor") == pytest.approx(
            2 * activation_bytes(arch, c, "actor"), rel=0.01
        )
        tile = 16 * 8192 * 8192 + (4 * 8192 * h if dtype == "bf16" else 0)
        rounded = 2 * vocab * h if dtype == "bf16" else 0
        assert (
            head_workspace_bytes(arch, double, "actor")
            == head_workspace_bytes(arch, c, "actor")
            == 4 * vocab * h + max(tile, rounded)
        )
        assert head_workspace_bytes(arch, c, "critic") == 0
        lora = dataclasses.replace(c, lora_rank=16)  # the projection is frozen: no gradient
        assert head_workspace_bytes(arch, lora, "actor") == tile


def test_the_kept_probabilities_are_priced_by_the_rows_of_a_rank():
    """Without `logits_checkpointing` the policy's last stage keeps each token's
    probabilities over its rank's real vocabulary rows in the weight's dtype, and each block
    of rows' fp32 max; the critic has no such head."""
    arch = preset_arch("qwen2.5-0.5b")
    for tp, dtype, width, rows in (
        (1, "bf16", 2, 151936),
        (8, "bf16", 2, 152576 // 8),  # the first rank's slice of the padded vocabulary
        (1, "fp32", 4, 151936),
    ):
        lean = MemoryPlanConfig(
            tensor_model_parallel_size=tp,
            micro_batch_size=1,
            seq_length=16384,
            params_dtype=dtype,
            logits_checkpointing=True,
        )
        kept = dataclasses.replace(lean, logits_checkpointing=False)
        blocks = -(-rows // 8192)  # square tiles of 8,192 x 8,192
        extra = activation_bytes(arch, kept, "actor") - activation_bytes(arch, lean, "actor")
        assert extra == 16384 * (rows * width + 4 * blocks), (tp, dtype)
        assert activation_bytes(arch, kept, "critic") == activation_bytes(arch, lean, "critic")


def test_lora_prices_a_frozen_base_trained_adapters_and_no_reference_copy():
    """LoRA (`lora_rank`): the base as weights alone, the adapters as weights + fp32 grads +
    Adam, the critic's value head trained too, the reference none (the actor's base), the
    rewind copy the adapters and their optimizer alone."""
    arch = preset_arch("qwen2.5-7b")
    layout = dict(tensor_model_parallel_size=4, params_dtype="bf16", reference=True)
    full = plan_memory(arch, MemoryPlanConfig(**layout))
    lora = plan_memory(arch, MemoryPlanConfig(**layout, lora_rank=16))
    adapters = arch.num_layers * lora_layer_param_count(arch, 16, 4)
    assert lora.states["actor_grads"] == 4 * adapters
    assert lora.states["critic_grads"] == 4 * (adapters + arch.hidden_size)
    assert lora.states["actor_optimizer"] == 12 * adapters  # not sharded: no distributed opt.
    assert lora.states["actor_weights"] == full.states["actor_weights"] + 2 * adapters
    assert "reference_weights" in full.states and "reference_weights" not in lora.states
    assert lora.rewind_host_bytes == 14 * adapters + 14 * (adapters + arch.hidden_size)
    assert lora.states_bytes < full.states_bytes / 2
    # on a mixture of experts only the attention is adapted: experts stay frozen
    moe = preset_arch("qwen3-30b-a3b")
    h, q = moe.hidden_size, moe.num_attention_heads * moe.head_dim
    kv = moe.num_query_groups * moe.head_dim
    assert lora_layer_param_count(moe, 8) == 8 * (h + q + 2 * kv) + 8 * (q + h)


def test_the_32b_lora_recipe_fits_4_gpus_with_offload_and_not_without():
    settings = recipe_settings("examples/qwen2.5-32b/vapo_lora.yaml")
    arch = preset_arch("qwen2.5-32b")
    assert settings["lora_rank"] == 32
    plan = plan_memory(arch, MemoryPlanConfig(**settings))
    assert plan.fits and plan.config.num_gpus == 4
    assert not plan_memory(arch, MemoryPlanConfig(**{**settings, "offload": ()})).fits
    assert not plan_memory(arch, MemoryPlanConfig(**{**settings, "lora_rank": 0})).fits


def test_a_teachers_weights_are_priced_on_its_layout_and_offloadable():
    """On-policy distillation: the teacher (its own architecture) adds its bf16 weights on
    the busiest stage, no gradient or optimizer state, sharded by the job's layout or its
    own; the 7B-from-32B recipe fits one node of 8 GPUs with them in host memory while vLLM
    generates, and on the student's TP 4 not without."""
    from megatron_rl.memory_plan import stage_params

    settings = recipe_settings("examples/qwen2.5-7b/distill_from_32b.yaml")
    assert settings["teacher"] is None  # its path is not here: the tool asks for --teacher
    student, teacher = preset_arch("qwen2.5-7b"), preset_arch("qwen2.5-32b")
    on_tp4 = {"teacher_tensor_model_parallel_size": None}
    config = MemoryPlanConfig(**{**settings, "teacher": teacher, "data_parallel_size": 2, **on_tp4})
    plan = plan_memory(student, config)
    assert plan.states["teacher_weights"] == 2 * stage_params(teacher, config, "reference")
    assert not any(k.startswith("teacher_") and k != "teacher_weights" for k in plan.states)
    assert settings["offload"] == ("teacher_weights",)
    assert plan.fits and plan.config.num_gpus == 8
    # the recipe's teacher on a layout of its own, TP 8 over the 8 GPUs: half the weights
    assert settings["teacher_tensor_model_parallel_size"] == 8
    own = plan_memory(
        student, MemoryPlanConfig(**{**settings, "teacher": teacher, "data_parallel_size": 2})
    )
    eight = dataclasses.replace(config, tensor_model_parallel_size=8, data_parallel_size=1)
    assert own.states["teacher_weights"] == 2 * stage_params(teacher, eight, "reference")
    assert own.states["teacher_weights"] < plan.states["teacher_weights"] * 0.51
    assert own.states["actor_weights"] == plan.states["actor_weights"]
    with pytest.raises(
        PlanError, match=r"the teacher: 8 GPUs are not divisible by its TP x PP = 3 x 1"
    ):
        plan_memory(student, dataclasses.replace(config, teacher_tensor_model_parallel_size=3))
    assert not plan_memory(student, dataclasses.replace(config, offload=())).fits
    # a layout the student takes (Qwen3-8B: 32 heads) but the teacher does not (28)
    with pytest.raises(PlanError, match="the teacher: .* does not divide num_attention_heads=28"):
        plan_memory(
            preset_arch("qwen3-8b"),
            MemoryPlanConfig(tensor_model_parallel_size=8, teacher=student),
        )
