"""A disaggregated placement end to end: `megatron_rl.cli.train` under torchrun with
the last rank(s) only generating (real vLLM on its own world) and the others only training
(Megatron), weights pushed over the bridge after every update; evaluations on the engines.

async.max_staleness 0:
- 1 trainer + 1 engine rank logs every metric and eval row the colocated run on 1 rank
  logs, equal, and saves equal weights: the same prompts, request seeds and weights make the
  same samples.
- 2 trainers (DP 2) + 2 engine ranks: each engine generates one DP rank's share; every
  metric and weight equal to 2 colocated ranks'.
- A stop request in the engine's generation (a file, or a signal to the engine rank alone)
  or between the trainer's mini-batches: every rank exits 0, the step's start is saved, and
  the resumed run logs what the uninterrupted one did, with the same final weights.
async.max_staleness 1 (one-step-off): staleness 0 then 1, the first step the synchronous
run's; a stop while the engine runs ahead, then a resume to the end. async.max_staleness 2
with partial rollouts: a stop with responses in flight, a resume, the bound kept; the next
round generated beside a round's tail (interleaved). GRPO, RLOO and REINFORCE++ ahead of
their trainer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from megatron_rl.launch import TorchrunError, run_torchrun
from megatron_rl.preemption import STOP_FILE_ENV
from tests.checkpoints import same_weights
from tests.trainer.runs import VARIED_REWARD, checkpoint, finite, metrics, train

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

EXTENDED = pytest.mark.extended
DISAGGREGATED = ("rollout.placement=disaggregated", "rollout.engine_ranks=1")


@pytest.fixture(scope="module")
def eval_prompts(tmp_path_factory):
    """12 of the sums: 6 per engine rank where there are 2."""
    path = tmp_path_factory.mktemp("eval") / "sums.jsonl"
    lines = Path("examples/tiny/data/arithmetic_test.jsonl").read_text().splitlines()
    path.write_text("\n".join(lines[:12]) + "\n")
    return path


def ppo_overrides(model_dir, eval_path) -> list[str]:
    """The tiny PPO recipe (TP 1, 4 actor updates a step): 1 value-pretraining step and 3
    PPO steps, a checkpoint after each; two eval sets (greedy; 4 samples at T 1) before
    training, at step 2 and at the end."""
    return [
        f"model.path={model_dir}", VARIED_REWARD, "critic.pretrain_steps=1",
        "trainer.total_steps=3", "trainer.save_interval=1", "trainer.keep_last=20",
        f"trainer.eval_sets=[{{path: {eval_path}, name: greedy}}, "
        f"{{path: {eval_path}, name: sampled, n: 4, temperature: 1.0, pass_k: [1, 4]}}]",
        "trainer.eval_interval=2",
    ]  # fmt: skip


def measured(record: dict) -> dict:
    """A metrics row without what a repeat cannot reproduce (times, memory), what only a
    disaggregated run logs (`rollout/staleness`: `staleness` reads it) and what only a
    resumed step logs (`rollout/resumed_tokens`: `kept_and_resumed` reads it)."""
    return {
        k: v
        for k, v in record.items()
        if not k.startswith(("timing/", "memory/"))
        and k not in ("perf/tokens_per_s", "rollout/staleness", "rollout/resumed_tokens")
    }


def kept_and_resumed(first: str, run, step: int) -> tuple[list[int], float | None]:
    """The tokens of PPO step `step`'s rollout the stop's checkpoint kept (each replica's,
    from the first run's log) and the tokens the resumed step took from it."""
    kept = re.findall(rf"kept (\d+) generated tokens of train step {step}'s", first)
    redone = [r for r in metrics(run) if r.get("stage", "train") == "train"][step - 1]
    return [int(n) for n in kept], redone.get("rollout/resumed_tokens")


def staleness(out) -> list[float]:
    return [r["rollout/staleness"] for r in metrics(out)]


def rows(out) -> list[dict]:
    """Every metrics row (value pretraining, the evaluation before training, PPO), then
    every eval.jsonl row."""
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    return [measured(r) for r in logged] + evals


@pytest.fixture(scope="module")
def apart(tiny_model_dir, eval_prompts, tmp_path_factory):
    """1 trainer rank + 1 engine rank."""
    out = tmp_path_factory.mktemp("apart") / "run"
    train("ppo", out, *ppo_overrides(tiny_model_dir, eval_prompts), *DISAGGREGATED)
    return out


def test_one_trainer_and_one_engine_rank_train_exactly_as_one_colocated_rank(
    apart, tiny_model_dir, eval_prompts, tmp_path
):
    """Evaluations included: sampled and scored on the engine rank, summed on the trainer."""
    colocated = tmp_path / "colocated"
    train("ppo", colocated, *ppo_overrides(tiny_model_dir, eval_prompts), nproc=1)
    got, want = rows(apart), rows(colocated)
    assert got == want and staleness(apart) == [0, 0, 0]
    assert [r.get("stage") for r in got] == ["value_pretrain", "eval", *["train"] * 3, *[None] * 6]
    assert all(r["rollout/num_samples"] == 8 for r in got if r.get("stage") == "train")
    # 3 evaluations (before training, steps 2 and 3) of 2 sets of 12 prompts
    assert [(r["step"], r["set"], r["prompts"]) for r in got[5:7]] == [
        (0, "greedy", 12), (0, "sampled", 12),
    ]  # fmt: skip
    assert "eval/sampled/pass@4" in got[3] and "eval/sampled/pass@4" not in got[2]
    for role in ("actor", "critic"):
        assert same_weights(checkpoint(apart, 4)[role], checkpoint(colocated, 4)[role])


@EXTENDED  # the one-trainer case above is the same equality
def test_two_engine_ranks_and_two_data_parallel_trainers_train_as_two_colocated_ranks(
    tiny_model_dir, eval_prompts, tmp_path
):
    """4 ranks: engine e generates what colocated DP rank e would (its slice of the prompts,
    the same request seeds) and trainer DP rank e gets it; 2 steps, every metric equal."""
    runs = {"apart": tmp_path / "apart", "colocated": tmp_path / "colocated"}
    short = [*ppo_overrides(tiny_model_dir, eval_prompts), "trainer.total_steps=2"]
    train("ppo", runs["apart"], *short, "rollout.placement=disaggregated",
          "rollout.engine_ranks=2", nproc=4, timeout=600)  # fmt: skip
    train("ppo", runs["colocated"], *short)
    got, want = rows(runs["apart"]), rows(runs["colocated"])
    assert len(got) == 1 + 1 + 2 + 2 * 2 and got == want  # evaluations at steps 0 and 2
    for role in ("actor", "critic"):
        a, b = checkpoint(runs["apart"], 3)[role], checkpoint(runs["colocated"], 3)[role]
        assert same_weights(a, b)


@pytest.mark.parametrize(
    ("stop_at", "signal_rank", "aborted_in"),
    [
        # the engine rank's generation (a variant: the SIGUSR1 case below stops it there too)
        pytest.param("train:2:rollout/generate", None, "rollout/generate", marks=EXTENDED),
        # a SIGUSR1 to the engine rank alone: the trainer learns of it through the job's store
        ("train:2:rollout/generate", 1, "rollout/generate"),
        # the trainer's second mini-batch of four: one update rewound, the engine idle
        ("train:2:train/mini_batch", None, "train/mini_batch"),
    ],
)
def test_a_stop_request_on_either_role_saves_the_steps_start_and_the_resume_redoes_it(
    stop_at, signal_rank, aborted_in, apart, tiny_model_dir, eval_prompts, tmp_path
):
    run = tmp_path / "run"
    overrides = [*ppo_overrides(tiny_model_dir, eval_prompts), *DISAGGREGATED]
    stop = tmp_path / "stop"
    first = run_torchrun(
        "tests.torchrun.stop_in_phase",
        ["--stop-at", stop_at,
         *(["--signal-rank", str(signal_rank)] if signal_rank is not None else []),
         "--config", "examples/tiny/ppo.yaml", f"trainer.output_dir={run}", *overrides],
        env={STOP_FILE_ENV: str(stop)},
        timeout=400,
    ).output  # fmt: skip
    assert f"train step 2 aborted in {aborted_in}" in first, first[-4000:]
    if signal_rank is not None:
        assert "stop (SIGUSR1 on rank 1): train step 2" in first
    assert ("rewinding the step's 1 optimizer update(s)" in first) == (
        aborted_in == "train/mini_batch"
    )
    root = run / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"  # value pretraining + step 1
    assert json.loads((root / "step_000002" / "trainer_state.json").read_text())["step"] == 1
    stop.unlink(missing_ok=True)
    resumed = train("ppo", run, *overrides).output
    assert f"resumed from {root / 'step_000002'} (step 1)" in resumed
    assert rows(run) == rows(apart)
    for role in ("actor", "critic"):
        assert same_weights(checkpoint(run, 4)[role], checkpoint(apart, 4)[role])
    # the engine's tokens of step 2 went to the trainer, into the checkpoint, and back to
    # the engine, which generated none of them again
    kept, took = kept_and_resumed(first, run, 2)
    assert len(kept) == 1 and kept[0] > 0 and took == kept[0], first[-4000:]


@pytest.fixture(scope="module")
def one_step_off(tiny_model_dir, eval_prompts, tmp_path_factory):
    """async.max_staleness=1: step s's rollout generated with the weights after step s - 2
    while step s - 1 trains (the first one's with the weights it trains)."""
    out = tmp_path_factory.mktemp("one_step_off") / "run"
    train("ppo", out, *ppo_overrides(tiny_model_dir, eval_prompts), *DISAGGREGATED,
          "async.max_staleness=1")  # fmt: skip
    return out


def test_one_step_off_trains_on_rollouts_one_version_behind(one_step_off, apart):
    """Staleness 0 then 1 at every step; value pretraining, the evaluation before training
    and PPO step 1 (the same weights generate its rollout) are the synchronous run's, step 2's
    rollout is not (other weights made it); evaluations use the weights of their step."""
    assert staleness(one_step_off) == [0, 1, 1]
    got, want = rows(one_step_off), rows(apart)
    assert got[:3] == want[:3]  # value pretraining, eval at step 0, PPO step 1
    assert got[3] != want[3]
    assert [r["step"] for r in got[5:]] == [0, 0, 2, 2, 3, 3]  # eval.jsonl: 2 sets each time


@EXTENDED  # partial rollouts' stop and resume below run ahead too
def test_a_stop_while_the_engine_runs_ahead_saves_and_the_resume_finishes(
    one_step_off, tiny_model_dir, eval_prompts, tmp_path
):
    """At max_staleness 1 a stop between step 2's mini-batches lands while the engine
    generates step 3's rollout: the trainer rewinds and saves step 1 with step 2's rollout
    (made by the weights before step 1), the engine's round in flight is dropped (aborted or
    received and discarded: a round ahead is generated again), every rank exits 0. The
    resume trains step 2 on the kept rollout, one version behind as it was, and finishes."""
    run = tmp_path / "run"
    overrides = [
        *ppo_overrides(tiny_model_dir, eval_prompts),
        *DISAGGREGATED,
        "async.max_staleness=1",
    ]
    stop = tmp_path / "stop"
    first = run_torchrun(
        "tests.torchrun.stop_in_phase",
        ["--stop-at", "train:2:train/mini_batch", "--config", "examples/tiny/ppo.yaml",
         f"trainer.output_dir={run}", *overrides],
        env={STOP_FILE_ENV: str(stop)},
        timeout=400,
    ).output  # fmt: skip
    assert "train step 2 aborted in train/mini_batch" in first, first[-4000:]
    root = run / "checkpoints"
    assert (root / "latest").read_text() == "step_000002"
    stop.unlink()
    resumed = train("ppo", run, *overrides).output
    assert f"resumed from {root / 'step_000002'} (step 1)" in resumed
    assert staleness(run) == [0, 1, 1]
    kept, took = kept_and_resumed(first, run, 2)
    assert len(kept) == 1 and kept[0] > 0 and took == kept[0], first[-4000:]
    got, want = rows(run), rows(one_step_off)
    assert got[:4] == want[:4] and len(got) == len(want)  # step 2 trains as it did


def test_partial_rollouts_take_pushes_inside_rounds_stop_and_resume(
    tiny_model_dir, eval_prompts, tmp_path
):
    """async.max_staleness 2 with partial rollouts, each round after a launch's first held
    at its second engine check until the next push comes (`--push-inside-rounds`: a
    generation longer than an update, made deterministic). A stop between step 2's
    mini-batches, step 3's round waiting inside its generation: Shutdown is read there,
    every rank exits 0, step 1 is saved with step 2's round. The resume trains step 2 on that
    round (staleness 1, mixed versions, as it was made) and step 3 starts under step 2's
    weights and ends under step 3's: staleness 1 and mixed-version responses, logged by
    share; evaluations at their steps."""
    run = tmp_path / "run"
    overrides = [
        "--config", "examples/tiny/ppo.yaml", f"trainer.output_dir={run}",
        *ppo_overrides(tiny_model_dir, eval_prompts), *DISAGGREGATED,
        "async.max_staleness=2", "async.partial_rollout=true",
    ]  # fmt: skip
    stop = tmp_path / "stop"
    first = run_torchrun(
        "tests.torchrun.stop_in_phase",
        ["--stop-at", "train:2:train/mini_batch", "--push-inside-rounds", *overrides],
        env={STOP_FILE_ENV: str(stop)},
        timeout=400,
    ).output
    assert "train step 2 aborted in train/mini_batch" in first, first[-4000:]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    stop.unlink()
    run_torchrun("tests.torchrun.stop_in_phase", ["--push-inside-rounds", *overrides], timeout=400)
    # step 2 trains on the round the stop kept, as it was made: started under version 0,
    # a push read inside it (its responses keep their versions)
    assert staleness(run) == [0, 1, 1]
    kept, took = kept_and_resumed(first, run, 2)
    assert len(kept) == 1 and kept[0] > 0 and took == kept[0], first[-4000:]
    shares = [r["rollout/mixed_version_share"] for r in metrics(run)]
    assert shares[0] == 0.0 and 0.0 < shares[1] <= 1.0 and 0.0 < shares[2] <= 1.0, shares
    evals = [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals[-4:] == [2, 2, 3, 3], evals


def test_fully_async_generates_the_next_round_beside_this_ones_tail(
    tiny_model_dir, eval_prompts, tmp_path
):
    """async.max_staleness 2 with partial rollouts, nothing held: round 2 may start under
    version 0, so the engine admits it at round 1's first check and generates both in one
    vLLM batch; round 2's own engine call adopts it (it refuses other prompts or seeds: the
    run would fail). Later rounds are admitted as the pushes allow; every round within the
    bound, by the version it started under; the evaluations (on the engine, which pauses a
    round admitted ahead) at their steps."""
    run = tmp_path / "run"
    train("ppo", run, *ppo_overrides(tiny_model_dir, eval_prompts), *DISAGGREGATED,
          "async.max_staleness=2", "async.partial_rollout=true", timeout=400)  # fmt: skip
    steps = metrics(run)
    assert [r["rollout/interleaved"] for r in steps][:2] == [0.0, 1.0]
    assert all(0 <= s <= 2 for s in staleness(run)) and staleness(run)[:2] == [0, 1]
    assert all(r["rollout/num_samples"] == 8 for r in steps)
    evals = [json.loads(line)["step"] for line in (run / "eval.jsonl").read_text().splitlines()]
    assert evals == [0, 0, 2, 2, 3, 3], evals


@pytest.mark.parametrize(
    "recipe,ahead",
    [
        ("grpo", ("async.max_staleness=2", "async.partial_rollout=true")),
        # the other estimators one step ahead: variants of the loss, not of the placement
        pytest.param("rloo", ("async.max_staleness=1",), marks=EXTENDED),
        pytest.param("reinforce_pp", ("async.max_staleness=1",), marks=EXTENDED),
    ],
)
def test_every_estimator_trains_apart_and_ahead(recipe, ahead, tiny_model_dir, tmp_path):
    """The critic-free recipes apart and ahead of their trainer (PPO: the tests above; VAPO:
    the async demo recipes): GRPO with dynamic filtering and KL to the reference at k = 2
    with partial rollouts (a filtering round draws more prompts after its scores: not
    interleaved), RLOO and REINFORCE++ (advantages whitened over the batch) one step off.
    Three steps each, within the bound, each round's kept groups whole, the actor moving."""
    out = tmp_path / recipe
    train(recipe, out, f"model.path={tiny_model_dir}", VARIED_REWARD, "trainer.total_steps=3",
          "trainer.save_interval=1", "parallel.tensor_model_parallel_size=1", *DISAGGREGATED,
          *ahead)  # fmt: skip
    records, k = metrics(out), 2 if recipe == "grpo" else 1
    assert [r["step"] for r in records] == [1, 2, 3] and all(finite(r) for r in records)
    assert staleness(out)[:2] == [0, 1] and all(s <= k for s in staleness(out))
    n = 1 if recipe == "reinforce_pp" else 4
    assert all(r["rollout/num_samples"] == n * r["rollout/groups_kept"] > 0 for r in records)
    if recipe == "grpo":
        assert "rollout/interleaved" not in records[0] and "rollout/groups_dropped" in records[0]
    assert not same_weights(checkpoint(out, 2)["actor"], checkpoint(out, 3)["actor"])


def test_two_engine_ranks_form_one_tensor_parallel_engine(tiny_model_dir, eval_prompts, tmp_path):
    """3 ranks: a trainer and one vLLM engine of TP 2 over the two engine ranks (they draw,
    generate and score in step; the first answers). vLLM at TP 2 sums in another order than
    at TP 1, so a near-tie token can differ from 1 + 1's samples: the check is the rollout's
    shape, its log-probs against the trainer's, and that the run trains and evaluates."""
    run = tmp_path / "tp2"
    train("ppo", run, *ppo_overrides(tiny_model_dir, eval_prompts), "trainer.total_steps=2",
          "rollout.placement=disaggregated", "rollout.engine_ranks=2",
          "rollout.vllm_tensor_parallel_size=2", nproc=3, timeout=600)  # fmt: skip
    steps = metrics(run)
    assert staleness(run) == [0, 0] and all(r["rollout/num_samples"] == 8 for r in steps)
    assert all(r["rollout/logprob_gap/max"] < 1e-4 for r in steps)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompts"]) for r in evals] == [(0, 12), (0, 12), (2, 12), (2, 12)]


@EXTENDED  # the TP engine forms in the test above; a stop reaches both roles' ranks in others
def test_a_stop_reaches_both_ranks_of_a_tensor_parallel_engine(
    tiny_model_dir, eval_prompts, tmp_path
):
    """The stop file appears while the TP 2 engine generates step 2: both of its ranks abort
    at the same engine step (they agree over vLLM's TP group, and between chunks over the
    replica's), the first answers, every rank exits 0; the resume trains to the end."""
    run = tmp_path / "run"
    overrides = [
        *ppo_overrides(tiny_model_dir, eval_prompts), "rollout.placement=disaggregated",
        "rollout.engine_ranks=2", "rollout.vllm_tensor_parallel_size=2",
    ]  # fmt: skip
    stop = tmp_path / "stop"
    first = run_torchrun(
        "tests.torchrun.stop_in_phase",
        ["--stop-at", "train:2:rollout/generate", "--config", "examples/tiny/ppo.yaml",
         f"trainer.output_dir={run}", *overrides],
        env={STOP_FILE_ENV: str(stop)}, nproc=3, timeout=400,
    ).output  # fmt: skip
    assert "train step 2 aborted in rollout/generate" in first, first[-4000:]
    assert (run / "checkpoints" / "latest").read_text() == "step_000002"
    stop.unlink()
    train("ppo", run, *overrides, nproc=3, timeout=600)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3] and staleness(run) == [0, 0, 0]


def test_an_engine_rank_that_fails_ends_the_job_with_its_error(tiny_model_dir, tmp_path):
    """A reward that fails on half the samples stops the run on the engine rank that scores
    them (`rollout.rating.max_failure_ratio`): the job ends with that error, no rank waits
    on the other for its timeout."""
    with pytest.raises(TorchrunError) as failed:
        train("ppo", tmp_path / "run", f"model.path={tiny_model_dir}",
              'rewards.reward_fns=[{type: python, path: "tests.reward_fns:fails_on_odd"}]',
              "trainer.total_steps=1", *DISAGGREGATED, timeout=300)  # fmt: skip
    assert "RewardFailureError" in str(failed.value) and "timed out" not in str(failed.value)
