"""The trainer end to end under torchrun (2 CPU ranks, gloo, real vLLM): every tiny recipe,
value pretraining, exact resume, a corrupt checkpoint. SIGTERM and a resume at another layout:
tests/trainer/test_journey_distributed.py."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
import yaml

from megatron_rl.launch import run_torchrun
from megatron_rl.preemption import STOP_FILE_ENV
from tests.checkpoints import same_weights
from tests.trainer.runs import (
    LABEL_REWARD,
    SMALL_VAPO,
    VARIED_REWARD,
    checkpoint,
    finite,
    metrics,
    train,
    value_pretrain,
    write_labelled_prompts,
)

pytestmark = pytest.mark.distributed
EXTENDED = pytest.mark.extended  # e2e variants left out of CI's e2e tier


@pytest.fixture(scope="module")
def labelled_prompts(tmp_path_factory):
    return write_labelled_prompts(tmp_path_factory.mktemp("data") / "good_bad.jsonl")


ACTOR_SCHEDULE = [
    "actor.optim.lr_warmup_steps=6",
    "actor.optim.lr_warmup_init=2e-5",
    "actor.optim.lr_decay_style=cosine",
    "actor.optim.min_lr=1e-5",
]


def vapo_overrides(model_dir, data_path) -> list[str]:
    """4 value-pretraining + 4 PPO steps, a checkpoint after each, on prompt-labelled rewards,
    sampled at temperature 0.7 (the trainer's log-probs must be of the tempered policy);
    two eval sets on the same prompts (greedy; 4 samples at temperature 1) before training,
    at step 2 and at the end."""
    return [
        *SMALL_VAPO,
        f"trainer.eval_sets=[{{path: {data_path}, name: greedy}}, "
        f"{{path: {data_path}, name: sampled, n: 4, temperature: 1.0, pass_k: [1, 2, 4]}}]",
        "trainer.eval_data_path=null",
        "trainer.eval_interval=2",
        "trainer.logger=[console, jsonl, tensorboard]",
        "rollout.temperature=0.7",
        f"model.path={model_dir}",
        f"data.path={data_path}",
        LABEL_REWARD,
        "critic.pretrain_steps=4",
        "critic.optim.lr=1e-3",
        # 2 actor updates a step, 8 in all: warm-up over 6 (still on at the step-2 checkpoint
        # a resume starts from), then cosine down to min_lr by the last
        *ACTOR_SCHEDULE,
        "trainer.total_steps=4",
        "trainer.save_interval=1",
        "trainer.keep_last=20",
    ]


@pytest.fixture(scope="module")
def vapo_run(tiny_model_dir, labelled_prompts, tmp_path_factory):
    out = tmp_path_factory.mktemp("vapo") / "run"
    train("vapo", out, *vapo_overrides(tiny_model_dir, labelled_prompts))
    return out


def test_value_pretraining_raises_explained_variance_with_the_policy_frozen(vapo_run):
    records = metrics(vapo_run, "value_pretrain")
    ev = [r["critic/vf_explained_var"] for r in records]
    assert len(ev) == 4 and ev[-1] > ev[0] + 0.3 and ev[-1] > 0.5, ev
    first, last = checkpoint(vapo_run, 1), checkpoint(vapo_run, 4)
    assert same_weights(first["actor"], last["actor"])  # the policy is frozen
    assert not same_weights(first["critic"], last["critic"])


def test_vapo_recipe_trains_actor_and_critic(vapo_run):
    records = metrics(vapo_run)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(finite(r) for r in records), records
    # ACTOR_SCHEDULE, update k = 0..7: linear from 2e-5 to 1e-4 over 6, then cosine to 1e-5
    # at 8 (halfway at 7); a step logs the mean of its two updates' lr.
    lr = [2e-5 + (1e-4 - 2e-5) * k / 6 for k in range(7)] + [(1e-4 + 1e-5) / 2]
    expected = [(lr[2 * s] + lr[2 * s + 1]) / 2 for s in range(4)]
    torch.testing.assert_close([r["actor/lr"] for r in records], expected, rtol=1e-9, atol=0)
    assert all(r["critic/lr"] == 1e-3 for r in records)  # constant: the default schedule
    # engine = actor after each sync, at T = 0.7: both are softmax(logits / T)
    assert all(r["rollout/logprob_gap/max"] < 1e-4 for r in records)
    assert all(r["rollout_corr/rollout_is_mean"] == pytest.approx(1, abs=1e-4) for r in records)
    # vLLM sleeps while Megatron trains, wakes its weights for the sync, then its KV cache.
    timeline = [
        json.loads(ln) for ln in (vapo_run / "memory_timeline.jsonl").read_text().splitlines()
    ]
    awake = "kv_cache+weights"
    assert [(r["phase"], r["engine"]) for r in timeline if r["stage"] == "value_pretrain"] == [
        ("rollout", awake),
        ("train", "asleep"),
    ] * 4
    assert [(r["phase"], r["engine"]) for r in timeline if r["stage"] == "train"] == [
        ("rollout", awake),
        ("experience", "asleep"),
        ("train", "asleep"),
        ("sync", "weights"),
    ] * 4
    assert all(r["peak_gib"] > 0 for r in timeline)
    assert all(r["memory/train_peak_gib"] > 0 for r in records)
    before, after = checkpoint(vapo_run, 4), checkpoint(vapo_run, 8)
    assert not same_weights(before["actor"], after["actor"])
    assert not same_weights(before["critic"], after["critic"])
    assert (vapo_run / "checkpoints" / "latest").read_text() == "step_000008"
    # The phase timers tools/bench_step_breakdown.py reads, and its arithmetic on them.
    from tools.bench_step_breakdown import breakdown

    shares = breakdown(records)
    assert shares["step_s"] > 0 and shares["generate_share"] > 0 and shares["train_share"] > 0
    total = sum(v for k, v in shares.items() if k.endswith("_share"))
    assert total == pytest.approx(1.0, abs=0.01)


def test_eval_sets_report_avg_at_n_and_pass_at_k_over_every_prompt(vapo_run, labelled_prompts):
    """The reward is the prompt's label (+1 good, -1 bad), whatever the response: every
    sample of a prompt is equally right, so avg@n is the share of good prompts in the whole
    file (both DP ranks' slices summed), and pass@k equals it for every k only if the
    samples are grouped by their own prompt."""
    rows = [json.loads(ln) for ln in (vapo_run / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["set"]) for r in rows] == [
        (step, name) for step in (0, 2, 4) for name in ("greedy", "sampled")
    ]
    labels = [json.loads(ln)["answer"] for ln in labelled_prompts.read_text().splitlines()]
    good = labels.count("good") / len(labels)
    for r in rows:
        assert r["prompts"] == len(labels)
        assert r["reward_mean"] == pytest.approx(2 * good - 1)
        if r["set"] == "greedy":
            assert (r["n"], r["temperature"], r["avg@1"], r["pass@1"]) == (1, 0.0, good, good)
        else:
            assert r["n"] == 4 and r["temperature"] == 1.0
            assert r["avg@4"] == r["pass@1"] == r["pass@2"] == r["pass@4"] == pytest.approx(good)
        assert 0 < r["response_length/mean"] <= 16
    step2 = next(r for r in metrics(vapo_run) if r["step"] == 2)
    assert step2["eval/sampled/pass@4"] == pytest.approx(good)
    assert step2["eval/accuracy"] == step2["eval/greedy/avg@1"]  # the first set: the headline
    assert "eval/greedy/avg@1" in metrics(vapo_run, "eval")[0]  # before training, step 0


def test_tensorboard_gets_both_stages_on_one_axis_and_the_resolved_config(vapo_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(vapo_run / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    pretrain = [e.step for e in events.Scalars("value_pretrain/critic/vf_explained_var")]
    assert pretrain == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("rollout/reward/mean")] == [
        5,
        6,
        7,
        8,
    ]  # after pretraining
    assert [e.step for e in events.Scalars("eval/sampled/pass@4")] == [4, 6, 8]
    reward = [e.value for e in events.Scalars("rollout/reward/mean")]
    assert reward == pytest.approx([r["rollout/reward/mean"] for r in metrics(vapo_run)])
    (text,) = events.Tensors("config/text_summary")
    config = yaml.safe_load(text.tensor_proto.string_val[0].decode().strip("`\n"))
    assert (
        config["trainer"]["output_dir"] == str(vapo_run) and config["critic"]["pretrain_steps"] == 4
    )


def as_value_pretraining_ended(run, copy):
    """A copy of the shared run whose newest checkpoint ends value pretraining (progress 4),
    as `megatron_rl.cli.value_pretrain` would leave it: the PPO steps' checkpoints removed."""
    shutil.copytree(run, copy)
    root = copy / "checkpoints"
    for progress in range(5, 9):
        shutil.rmtree(root / f"step_{progress:06d}")
    (root / "latest").write_text("step_000004")
    return copy


def measured(record: dict) -> dict:
    """A metrics row without what a repeat cannot reproduce (times, memory) and what only a
    resumed step logs (`rollout/resumed_tokens`: the tokens a stop's checkpoint kept)."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(("timing/", "memory/"))
        and k not in ("perf/tokens_per_s", "rollout/resumed_tokens")
    }


@pytest.mark.e2e  # a CLI after the shared run: ~1 min, the journeys' tier
def test_a_resume_past_a_truncated_rank_file_reproduces_the_steps_it_redoes(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    """The newest checkpoint has a truncated shard and the one before it is gone: the run
    names the file, falls back to step 2's checkpoint (mid-way through the actor's lr warm-up),
    and redoes steps 3 and 4 exactly: the schedule continues where it was."""
    resumed = tmp_path / "resumed"
    shutil.copytree(vapo_run, resumed)
    root = resumed / "checkpoints"
    shutil.rmtree(root / "step_000007")
    shard = root / "step_000008" / "actor" / "model" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])  # a save cut short by a full disk
    saved = json.loads((root / "step_000006" / "trainer_state.json").read_text())
    assert saved["step"] == 2 and saved["value_pretrain_step"] == 4
    cfg = yaml.safe_load((root / "step_000006" / "config.yaml").read_text())
    assert cfg["trainer"]["total_steps"] == 4  # the resolved config travels with the checkpoint
    result = train("vapo", resumed, *vapo_overrides(tiny_model_dir, labelled_prompts))
    assert "step_000008: actor/model cannot be read" in result.output
    assert f"resuming from {root / 'step_000006'}" in result.output
    corrupt = root / ".step_000008.corrupt" / "actor" / "model" / "__1_0.distcp"
    assert corrupt.stat().st_size == 1000
    assert (root / "latest").read_text() == "step_000008"
    # The rows of steps 3 and 4 the copy holds are dropped and logged again: one per step.
    expected = [measured(r) for r in metrics(vapo_run)]
    got = [measured(r) for r in metrics(resumed)]
    assert [r["step"] for r in got] == [1, 2, 3, 4] and got == expected  # evals included
    # eval.jsonl: the step-4 rows dropped and evaluated again, with the same seeds
    assert (resumed / "eval.jsonl").read_text() == (vapo_run / "eval.jsonl").read_text()
    assert len(metrics(resumed, "value_pretrain")) == 4
    assert same_weights(checkpoint(resumed, 8)["actor"], checkpoint(vapo_run, 8)["actor"])


@EXTENDED  # the resume past a truncated file takes the same path
@pytest.mark.e2e  # two CLIs after the shared run: ~3.5 min, the journeys' tier
def test_a_run_stopped_as_value_pretraining_ends_resumes_as_if_uninterrupted(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    """The newest checkpoint is the one that ends value pretraining, as
    `megatron_rl.cli.value_pretrain` leaves it: the actor, frozen until then, has an optimizer
    that never stepped. It loads back unstepped (it was once called unreadable and set aside,
    and the Adam moments made to load into failed the actor's first step with KeyError
    'step'): `cli.value_pretrain` again finds its work done, and `cli.train` resumes from it
    with the four PPO steps of the uninterrupted run."""
    resumed = as_value_pretraining_ended(vapo_run, tmp_path / "resumed")
    root = resumed / "checkpoints"
    overrides = vapo_overrides(tiny_model_dir, labelled_prompts)
    again = value_pretrain("vapo", resumed, *overrides)
    assert "value pretraining already done in this output_dir" in again.output
    result = train("vapo", resumed, *overrides)
    for output in (again.output, result.output):
        assert "unreadable" not in output and "cannot be read" not in output
    assert f"resumed from {root / 'step_000004'} (step 0)" in result.output
    assert len(metrics(resumed, "value_pretrain")) == 4
    expected = [measured(r) for r in metrics(vapo_run)]
    assert [measured(r) for r in metrics(resumed)] == expected
    for role in ("actor", "critic"):
        assert same_weights(checkpoint(resumed, 8)[role], checkpoint(vapo_run, 8)[role])


def test_a_new_run_refuses_an_output_dir_with_an_earlier_run(vapo_run, tiny_model_dir, tmp_path):
    reused = tmp_path / "reused"
    shutil.copytree(vapo_run, reused)
    overrides = [f"model.path={tiny_model_dir}", *SMALL_VAPO, "trainer.resume=false"]
    with pytest.raises(RuntimeError, match=r"holds an earlier run .*trainer.overwrite=true"):
        train("vapo", reused, *overrides, timeout=120)
    assert (reused / "checkpoints" / "step_000008").is_dir()  # nothing touched


# A rollout in bfloat16 against an fp32 trainer: a real mismatch (~1e-3 nats per token) that
# the diagnostics must see, with token TIS and a token rejection band tight enough to bite.
BF16_ROLLOUT_CORRECTED = [
    "rollout.dtype=bfloat16",
    "algorithm.rollout_correction.rollout_is=token",
    "algorithm.rollout_correction.rollout_is_threshold=1.001",
    "algorithm.rollout_correction.rollout_rs=token",
    "algorithm.rollout_correction.rollout_rs_threshold=1.002",
]


# Token-budget micro-batches: prompts of ~20 tokens + responses of <= 16 in 40 tokens, so
# one row per training micro-batch (the PPO mini-batch has 2 rows per rank).
DYNAMIC_BSZ = (
    "data.max_prompt_length=24",
    "actor.use_dynamic_bsz=true",
    "actor.ppo_max_token_len_per_gpu=40",
    "actor.log_prob_max_token_len_per_gpu=80",
    "critic.use_dynamic_bsz=true",
    "critic.ppo_max_token_len_per_gpu=40",
)

PACKED = "model.use_remove_padding=true"


@pytest.mark.parametrize(
    "recipe,has_critic,extra",
    [
        ("ppo", True, ("actor.grad_offload=true", "critic.grad_offload=true", *DYNAMIC_BSZ)),
        # packed micro-batches for the actor and the reference (KL in the loss)
        ("grpo", False, ("algorithm.rollout_correction.bypass_mode=true", PACKED)),
        ("rloo", False, BF16_ROLLOUT_CORRECTED),
        # the journeys' tier (~30 s), to keep `make test` under 20 minutes
        pytest.param("reinforce_pp", False, (), marks=pytest.mark.e2e),
    ],
)
def test_recipe_runs_two_steps(
    recipe, has_critic, extra, tiny_model_dir, tiny_teacher_dir, tmp_path
):
    """Each tiny recipe (GRPO: dynamic filtering, KL in the loss, the engine's log-probs as
    pi_old, packed micro-batches) trains for two steps; PPO with its gradient buffers freed
    between updates and token-budget micro-batches; RLOO with a bf16 rollout corrected by TIS
    and rejection, and a larger teacher's per-token reverse KL added to its advantages
    (on-policy distillation), the teacher on a layout of its own (DP2 beside the job's TP2)
    and offloaded between experiences."""
    out = tmp_path / recipe
    # PPO trains with full activation recompute (its exactness: test_memory_check_distributed).
    overrides = ["model.recompute.granularity=full"] if recipe == "ppo" else []
    if recipe == "rloo":
        overrides += [
            f"teacher.path={tiny_teacher_dir}",
            "teacher.kl_coef=0.5",
            "teacher.param_offload=true",
            "teacher.tensor_model_parallel_size=1",  # a layout of its own: DP2 beside TP2
        ]
    train(
        recipe,
        out,
        f"model.path={tiny_model_dir}",
        VARIED_REWARD,
        "trainer.total_steps=2",
        "trainer.save_interval=1",
        *overrides,
        *extra,
    )
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2] and all(finite(r) for r in records), records
    if extra is BF16_ROLLOUT_CORRECTED:
        for r in records:
            assert r["rollout/logprob_gap/mean"] > 1e-4  # bf16 rollout: the mismatch is seen ...
            assert 0 < r["rollout_corr/rollout_rs_masked_fraction"] < 1  # ... tokens dropped
            assert 0 < r["rollout_corr/rollout_is_clipped_fraction"] < 1  # ... weights capped
            assert r["rollout_corr/rollout_is_eff_sample_size"] < 1
            assert r["rollout_corr/kl"] != 0
            # another model's log-probs of the student's tokens
            assert r["actor/teacher_kl"] != 0 and r["actor/teacher_kl_max"] > r["actor/teacher_kl"]
    else:
        assert not any(k.startswith("actor/teacher_kl") for k in records[-1])
    gap_logged = [
        any(k.startswith(("rollout_corr/", "rollout/logprob_gap/")) for k in r) for r in records
    ]
    # bypass_mode: no trainer forward of pi_old, so no engine-trainer gap to measure
    assert gap_logged == [recipe != "grpo"] * 2
    if "actor.use_dynamic_bsz=true" in extra:  # the budget, not micro_batch_size (1), split
        assert all(r["actor/micro_batches"] == r["critic/micro_batches"] == 2 for r in records)
        # trainer.balance_batch follows use_dynamic_bsz: the ranks' token counts were evened
        assert all(
            1 <= r["perf/dp_tokens_max_over_mean"] <= r["perf/dp_tokens_max_over_mean_before"]
            for r in records
        )
    first, last = checkpoint(out, 1), checkpoint(out, 2)
    assert not same_weights(first["actor"], last["actor"])
    if has_critic:
        assert not same_weights(first["critic"], last["critic"])
    else:
        assert last["critic"] is None and not any(k.startswith("critic/") for k in records[-1])


def test_a_resume_applies_the_configs_optimizer_settings(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    resumed = tmp_path / "resumed"
    shutil.copytree(vapo_run, resumed)
    overrides = [*vapo_overrides(tiny_model_dir, labelled_prompts), "actor.optim.lr=2e-4"]
    result = train("vapo", resumed, *overrides)  # step 4 of 4 is saved: nothing left to run
    assert "resume: actor optimizer settings from the config, not " in result.output
    assert "max_lr: 0.0001 -> 0.0002" in result.output
    assert "resume: critic optimizer" not in result.output  # unchanged: nothing to say


PARAM_OFFLOAD = (
    "actor.param_offload=true",
    "critic.param_offload=true",
    "actor.ref_param_offload=true",
    "actor.grad_offload=true",
)


@pytest.mark.e2e  # two runs: ~1.3 min, the journeys' tier
def test_parameter_offload_trains_exactly_as_without(tiny_model_dir, tmp_path):
    """Each role's parameters in host memory from their last use before a rollout (reference:
    the experience, critic: its update, actor: the weight sync) until their next use, and
    back for the saves: one value-pretraining step and two PPO steps (actor, critic,
    reference) log the same metrics and save bit-equal checkpoints and HF exports."""
    runs = {"plain": tmp_path / "plain", "offload": tmp_path / "offload"}
    for name, extra in (("plain", ()), ("offload", PARAM_OFFLOAD)):
        train(
            "ppo", runs[name], f"model.path={tiny_model_dir}", VARIED_REWARD,
            "critic.pretrain_steps=1", "trainer.total_steps=2", "trainer.save_interval=2",
            "trainer.save_hf_interval=2", *extra,
        )  # fmt: skip
    for stage in ("value_pretrain", "train"):
        plain, offload = metrics(runs["plain"], stage), metrics(runs["offload"], stage)
        assert len(plain) == (1 if stage == "value_pretrain" else 2)
        assert [measured(r) for r in offload] == [measured(r) for r in plain]
        # what stayed in host memory through each rollout: all three roles' weights
        assert all(r["memory/params_offloaded_gib"] > 0 for r in offload)
        assert all(r["memory/params_offloaded_gib"] == 0 for r in plain)
    for progress in (1, 3):  # the pretrained critic; the end of PPO
        a, b = checkpoint(runs["plain"], progress), checkpoint(runs["offload"], progress)
        for role in ("actor", "critic"):
            assert sorted(a[role]) == sorted(b[role])
            assert all(torch.equal(a[role][k], b[role][k]) for k in a[role]), role
    exports = {
        name: {f.name: f.read_bytes() for f in (out / "hf" / "step_000002").glob("*.safetensors")}
        for name, out in runs.items()
    }
    assert exports["plain"] and exports["offload"] == exports["plain"]


@pytest.mark.e2e  # two CLIs per case after the shared run: the journeys' tier
@pytest.mark.parametrize(
    ("stop_at", "save_interval", "aborted_in", "signal_rank"),
    [
        # inside vLLM's generation (a variant of the signal case below)
        pytest.param("train:3:rollout/generate", 0, "rollout/generate", None, marks=EXTENDED),
        # a SIGUSR1 to rank 1 alone, while rank 0 is still generating: it reaches rank 0
        # through the job's store, whose generation aborts too
        ("train:3:rollout/generate", 0, "rollout/generate", 1),
        # generated, prompts drawn
        pytest.param("train:3:rollout/score", 0, "rollout/score", None, marks=EXTENDED),
        # old and ref log-probs made
        pytest.param("train:3:experience/critic", 0, "experience/critic", None, marks=EXTENDED),
        # both roles' gradients made, no weight changed; the step's start is saved already
        pytest.param(
            "train:2:train/optimizer_step", 1, "train/optimizer_step", None, marks=EXTENDED
        ),  # fmt: skip
        # after the first of the step's two mini-batches: its updates rewound, then saved
        ("train:3:train/mini_batch", 0, "train/mini_batch", None),
        # during step 2's periodic save: it completes; step 3 aborts at its first check
        pytest.param("train:2:save", 1, "rollout/generate", None, marks=EXTENDED),
    ],
)
def test_a_stop_request_mid_step_saves_the_steps_start_and_the_resume_redoes_it_exactly(
    stop_at, save_interval, aborted_in, signal_rank, vapo_run, tiny_model_dir, labelled_prompts,
    tmp_path,
):  # fmt: skip
    """A stop request inside a step aborts it (after an optimizer update: rewound to
    the copy taken before the step's first, `trainer.rewindable_update`): every rank exits 0
    at once, the checkpoint is the step's start (data position rewound, RNG put back), and
    the resumed run logs the same steps, metrics and final weights as the uninterrupted one.
    Resumed from the end of value pretraining of the shared run."""
    run = as_value_pretraining_ended(vapo_run, tmp_path / "run")
    root = run / "checkpoints"
    overrides = vapo_overrides(tiny_model_dir, labelled_prompts)
    # a grace time no save fits in, on any machine: each save says so
    overrides += [f"trainer.save_interval={save_interval}", "trainer.stop_grace_s=0.01"]
    stop = tmp_path / "stop"
    first = run_torchrun(
        "tests.torchrun.stop_in_phase",
        ["--stop-at", stop_at,
         *(["--signal-rank", str(signal_rank)] if signal_rank is not None else []),
         "--config", "examples/tiny/vapo.yaml",
         f"trainer.output_dir={run}", *overrides],
        env={STOP_FILE_ENV: str(stop)},
        timeout=400,
    ).output  # fmt: skip
    step = int(stop_at.split(":")[1]) + stop_at.endswith(":save")  # the step aborted
    boundary = root / f"step_{4 + step - 1:06d}"
    # the abort and save times, for docs/reliability.md (`pytest -s` shows them)
    print(
        *[
            line
            for line in first.splitlines()
            if "aborted in" in line or "saved checkpoint" in line
        ],
        sep="\n",
    )
    assert f"train step {step} aborted in {aborted_in}" in first, first[-4000:]
    # what the step had generated is kept with the checkpoint (none before its first chunk)
    kept = [
        int(n) for n in re.findall(rf"kept (\d+) generated tokens of train step {step}'s", first)
    ]
    assert len(kept) == (0 if stop_at.endswith(":save") else 1), first[-4000:]
    if signal_rank is not None:  # rank 0 learnt of it from the store, with its time
        assert f"stop (SIGUSR1 on rank {signal_rank}): train step {step}" in first
    rewound = "rewinding the step's 1 optimizer update(s)" in first
    assert rewound == (aborted_in == "train/mini_batch")
    if save_interval:
        assert f"step {step - 1} is the newest checkpoint already: nothing to save" in first
    else:
        assert f"saved checkpoint {boundary}" in first, first[-4000:]
        assert "more than half of trainer.stop_grace_s=0.01:" in first
    assert (root / "latest").read_text() == boundary.name
    state = json.loads((boundary / "trainer_state.json").read_text())
    assert state["step"] == step - 1
    assert [r["step"] for r in metrics(run)] == list(range(1, step))  # none for the aborted one
    stop.unlink(missing_ok=True)
    resumed = train("vapo", run, *overrides).output
    assert f"resumed from {boundary} (step {step - 1})" in resumed
    expected = [measured(r) for r in metrics(vapo_run)]
    assert [measured(r) for r in metrics(run)] == expected
    # no token generated twice: the resumed step took every token kept
    redone = metrics(run)[step - 1]
    assert redone.get("rollout/resumed_tokens") == (kept[0] if kept else None)
    assert (
        state["data"]
        == json.loads(
            (vapo_run / "checkpoints" / boundary.name / "trainer_state.json").read_text()
        )["data"]
    )
    for role in ("actor", "critic"):
        assert same_weights(checkpoint(run, 8)[role], checkpoint(vapo_run, 8)[role])


@pytest.mark.parametrize(
    "replay",
    [
        # the journeys' tier (~30 s), to keep `make test` under 20 minutes
        pytest.param("actor.router_replay.log_mismatch=true", marks=pytest.mark.e2e),
        "actor.router_replay.mode=R3",
    ],
)
def test_a_mixture_of_experts_trains_with_its_experts_split_over_two_ranks(
    family_dir, tmp_path, replay
):
    """GRPO on the tiny Qwen3-MoE at EP=2 (each rank 4 of the 8 experts, DP 2, an engine per
    rank): token-budget micro-batches, a balancing loss logged apart from pg_loss, and the
    experts pushed to vLLM after each step: the engine's log-probs are the trainer's (the gap
    stays at the fp32 level). The engine records its routes: the trainer either measures where
    its own differ (none here: fp32, same weights) or replays them (R3)."""
    out = tmp_path / "moe"
    train(
        "grpo",
        out,
        f"model.path={family_dir('qwen3-moe')}",
        VARIED_REWARD,
        "parallel.tensor_model_parallel_size=1",
        "parallel.expert_model_parallel_size=2",
        "model.moe.moe_router_load_balancing_type=aux_loss",
        "model.moe.moe_aux_loss_coeff=0.001",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=160",
        "trainer.total_steps=2",
        "trainer.save_interval=2",
        replay,
    )
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2] and all(finite(r) for r in records), records
    for r in records:
        assert 0.5 < r["actor/moe/load_balancing_loss"] < 2.0
        if "log_mismatch" in replay:
            assert r["routing/mismatch/layer_frac"] <= 0.02  # fp32: near-ties only
        else:
            assert not any(k.startswith("routing/") for k in r)
        assert r["rollout/logprob_gap/max"] < 1e-3  # step 2's rollout: after the first push
    # saved from two EP ranks: every layer's 8 experts at their global indices, with the
    # experts' own (chained) optimizer state
    saved = checkpoint(out, 2)["actor"]
    fc1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"
    assert saved[fc1].shape == (2, 8, 2 * 64, 128)
    assert saved[f"chained_1.optimizer.state.exp_avg.{fc1}"].abs().sum() > 0


# Every turn answered (`Counter` steps on turns that end without a call too): the random
# model rarely writes `</tool_call>`, and what is tested here is the trainer on trajectories
# with environment tokens. The code tool itself: tests/envs, tests/rollout/test_agent_vllm.py.
MULTI_TURN = (
    "rollout.multi_turn.enable=true",
    "rollout.multi_turn.format=code",
    "rollout.multi_turn.max_turns=3",
    "rollout.multi_turn.max_response_length=64",
    "rollout.multi_turn.max_tool_response_length=12",
    "rollout.multi_turn.env={type: python, path: tests.envs.scripted_envs:Counter, "
    "kwargs: {turns: 2, reward: 0.25}, num_workers: 2}",
)


@pytest.mark.parametrize("recipe", ["grpo", pytest.param("ppo", marks=pytest.mark.e2e)])
def test_multi_turn_rollouts_train_with_environment_tokens_out_of_the_loss(
    recipe, tiny_tools_model_dir, tmp_path
):
    """Two steps on trajectories of up to three turns (vLLM TP 2: the engine's first rank
    runs the environment and broadcasts its answers): the turns, the answers' tokens and the
    engine-trainer gap of every turn are logged; the later turns' gap is as small as the
    first's (fp32: each policy token was sampled from the context the trainer reads)."""
    out = tmp_path / recipe
    train(
        recipe, out, f"model.path={tiny_tools_model_dir}", VARIED_REWARD,
        "trainer.total_steps=2", "trainer.save_interval=1", *MULTI_TURN,
    )  # fmt: skip
    records = metrics(out)
    assert [r["step"] for r in records] == [1, 2] and all(finite(r) for r in records), records
    for r in records:
        assert r["rollout/multi_turn/turns/mean"] > 1.5
        assert r["rollout/multi_turn/env_tokens/mean"] > 0
        for k in (0, 1):
            assert r[f"rollout/logprob_gap/turn_{k}/max"] < 1e-4, r
    first, last = checkpoint(out, 1), checkpoint(out, 2)
    assert not same_weights(first["actor"], last["actor"])


@pytest.mark.e2e  # a distillation run and its resume after the shared run: the journeys' tier
def test_a_distillation_run_evaluates_its_teacher_and_resumes_exactly(
    vapo_run, tiny_model_dir, labelled_prompts, tmp_path
):
    """The shared run's last actor teaches the warm start (`on_policy_distill`, offloaded
    teacher, on a layout of its own: DP 2 beside the job's TP 2). At each evaluation (before
    training and at step 2) the run evaluates the student and then the teacher
    (`teacher.evaluate`): the student's rows at step 0 are the shared run's, the teacher's
    greedy row is the shared run's at its last step (the same weights in the engine, pushed
    from the teacher's layout). Then a resume from step 1 redoes step 2 exactly, the
    teacher's evaluation with it."""
    teacher = vapo_run / "checkpoints" / "step_000008" / "actor"
    overrides = [
        *vapo_overrides(tiny_model_dir, labelled_prompts),
        "algorithm.estimator=on_policy_distill",
        "critic.enable=false",
        "critic.pretrain_steps=0",
        f"teacher.path={teacher}",
        "teacher.evaluate=true",
        "teacher.param_offload=true",
        "teacher.tensor_model_parallel_size=1",
        "trainer.total_steps=2",
        "actor.optim.lr_warmup_steps=2",
    ]
    run = tmp_path / "distill"
    train("vapo", run, *overrides)

    def rows(out):
        return [json.loads(ln) for ln in (out / "eval.jsonl").read_text().splitlines()]

    shared = rows(vapo_run)
    got = rows(run)
    student = [r for r in got if r["step"] == 0 and "policy" not in r]
    taught = [r for r in got if r.get("policy") == "teacher"]
    assert student == [r for r in shared if r["step"] == 0]
    assert [(r["step"], r["set"]) for r in taught] == [
        (step, name) for step in (0, 2) for name in ("greedy", "sampled")
    ]
    greedy = [{k: v for k, v in r.items() if k not in ("step", "policy")} for r in taught[::2]]
    by_step = {r["step"]: {k: v for k, v in r.items() if k != "step"}
               for r in shared if r["set"] == "greedy"}  # fmt: skip
    end = by_step[4]
    assert greedy == [end, end] and end != by_step[0]  # the trained policy answers otherwise
    (evaluated,) = [r for r in metrics(run, "eval")]
    assert evaluated["eval/teacher/greedy/response_length/mean"] == end["response_length/mean"]
    assert evaluated["eval/teacher/accuracy"] == taught[1]["avg@4"]
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["actor/teacher_kl"] > 0 for r in records)
    assert records[1]["eval/teacher/accuracy"] == taught[3]["avg@4"]

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    (resumed / "checkpoints" / "latest").write_text("step_000001")
    output = train("vapo", resumed, *overrides).output
    assert f"resumed from {resumed / 'checkpoints' / 'step_000001'} (step 1)" in output
    assert [measured(r) for r in metrics(resumed)] == [measured(r) for r in records]
    assert rows(resumed) == got  # the teacher's step-2 rows made again, the same
    assert same_weights(checkpoint(resumed, 2)["actor"], checkpoint(run, 2)["actor"])
