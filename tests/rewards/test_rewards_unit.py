"""Reward functions in-process: failure containment, time limits, weighted sums, configs, and a
reward model of another family that reads text templated its own way."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from megatron_rl.preemption import STOP, StepAborted
from megatron_rl.rewards import (
    MathRewardConfig,
    PythonRewardConfig,
    RewardFailureError,
    RewardInput,
    RewardModelConfig,
    RewardScorer,
    reward_fn_config,
)
from megatron_rl.rewards.base import RewardTimeout, call_with_time_limit
from megatron_rl.rewards.pool import (
    ScoringAborted,
    ScoringPoolConfig,
    make_scoring_pool,
    result_or_abort,
    shared_or_raise,
    submit_or_abort,
)
from megatron_rl.rewards.scorer import check_failure_ratio


def inputs(responses, labels=None):
    labels = labels or [None] * len(responses)
    return [
        RewardInput(prompt="q", prompt_text="<q>", response=r, label=lab)
        for r, lab in zip(responses, labels, strict=True)
    ]


def python_fn(function, **kw):
    return PythonRewardConfig(path=f"tests.reward_fns:{function}", **kw)


def test_weighted_sum_of_functions():
    scorer = RewardScorer(
        [
            MathRewardConfig(weight=2.0),
            python_fn("length_parity", name="parity", weight=0.5),
        ]
    )
    out = scorer(inputs([r"\boxed{4}", r"\boxed{5}x"], ["4", "4"]))
    assert out.scores == {"math": [1.0, -1.0], "parity": [0.0, 1.0]}
    assert out.rewards == [2.0, -2.0 + 0.5]
    assert out.num_failures() == {"math": 0, "parity": 0}


def test_raising_and_nan_functions_get_the_failure_reward_and_are_counted():
    scorer = RewardScorer(
        [
            python_fn("fails_on_odd", failure_reward=-3.0),
            python_fn("nan_reward", name="nan", failure_reward=0.25),
        ]
    )
    out = scorer(inputs(["ab", "abc"]))
    assert out.rewards == [1.0 + 0.25, -3.0 + 0.25]
    assert math.isnan(out.scores["python"][1])
    assert out.errors["python"] == [None, "reward 'python': RuntimeError: odd response"]
    assert out.errors["nan"] == ["reward 'nan': returned nan"] * 2
    metrics = check_failure_ratio([out], max_failure_ratio=1.0)
    assert metrics["rollout/reward/python/failures"] == 1.0
    assert metrics["rollout/reward/nan/failure_ratio"] == 1.0
    with pytest.raises(RewardFailureError, match=r"'nan' failed on 2/2 samples .* returned nan"):
        check_failure_ratio([out], max_failure_ratio=0.5)


TIMED_OUT = "reward 'python': RewardTimeout: took longer than 0.2 s (its worker process was killed)"


def test_time_limit_stops_a_hanging_function():
    scorer = RewardScorer([python_fn("sleeps_forever", timeout_s=0.2, failure_reward=-1.0)])
    start = time.time()
    out = scorer(inputs(["a", "b"]))
    assert time.time() - start < 10
    assert out.rewards == [-1.0, -1.0]
    assert out.errors["python"] == [TIMED_OUT] * 2
    scorer.close()


def test_a_stop_request_cancels_a_slow_call_at_once(monkeypatch):
    """A reward slower than any grace time (a judge, a code run: here it never ends, its
    limit 120 s): a stop request kills its worker within a poll and aborts the step's
    scoring."""
    scorer = RewardScorer([python_fn("sleeps_forever", timeout_s=120.0)])
    [fn] = scorer.functions
    monkeypatch.setattr(STOP, "signal", None)  # put back at teardown, whatever the timer did
    threading.Timer(0.5, lambda: setattr(STOP, "signal", "SIGTERM")).start()
    start = time.time()
    with pytest.raises(StepAborted, match="rollout/score"):
        scorer(inputs(["a", "b"]))
    assert time.time() - start < 30.0  # at the stop, not at the 120 s limit
    assert fn.child is None  # killed, not waited for
    scorer.close()


def test_a_stop_request_ends_the_ray_workers_calls_at_once(monkeypatch):
    """With the Ray pool the calls in flight end with their workers (their isolated children
    die with them); later batches would be scored in this process."""
    pool = make_scoring_pool(
        [python_fn("sleeps_forever", timeout_s=120.0)], ScoringPoolConfig(num_workers=1)
    )
    try:
        handle = pool.submit(inputs(["a"]))
        monkeypatch.setattr(STOP, "signal", None)
        threading.Timer(1.0, lambda: setattr(STOP, "signal", "SIGTERM")).start()
        start = time.time()
        with pytest.raises(StepAborted, match="rollout/score"):
            pool.result(handle)
        assert time.time() - start < 30.0  # at the stop, not at the 120 s limit
        assert pool.workers == [] and pool.fallback is not None
    finally:
        pool.close()


def test_scores_cancelled_on_the_scoring_rank_abort_every_rank_of_its_group():
    """What a group shares in place of scores: each rank raises, none waits for scores."""

    class Pool:
        def submit(self, batch):
            raise StepAborted("rollout/score")

    handle = submit_or_abort(Pool(), ["sample"])
    assert handle == ScoringAborted("rollout/score")
    assert result_or_abort(Pool(), handle) is handle
    with pytest.raises(StepAborted, match="rollout/score"):
        shared_or_raise(handle)
    assert shared_or_raise("scores") == "scores"


def test_time_limit_is_not_swallowed_by_except_exception():
    scorer = RewardScorer([python_fn("swallows_exceptions", timeout_s=0.2)])
    assert scorer(inputs(["a"])).errors["python"] == [TIMED_OUT]
    scorer.close()


def test_time_limit_stops_c_code_that_holds_the_gil():
    """A regex stuck in C for hours: the worker is killed, the next samples go to a new one."""
    scorer = RewardScorer([python_fn("regex_in_c", timeout_s=0.2)])
    start = time.time()
    out = scorer(inputs(["ab", "hang", "abc"]))
    assert time.time() - start < 20
    assert out.scores["python"][0] == 2.0 and out.scores["python"][2] == 3.0
    assert out.errors["python"] == [None, TIMED_OUT, None]
    assert scorer.functions[0].restarts == 1
    scorer.close()


def test_a_symbolic_answer_that_never_ends_costs_its_sample_only():
    """math-verify (sympy) on a power tower computes a bignum in C for hours: the default
    `math` reward's time limit kills its worker; the samples around it are judged."""
    scorer = RewardScorer([MathRewardConfig(timeout_s=1.0, failure_reward=-2.0)])
    out = scorer(
        inputs([r"\boxed{\sqrt{4}}", r"\boxed{9^{9^{9^{9}}}}", r"\boxed{3}"], ["2", "1", "4"])
    )
    assert out.scores["math"][0] == 1.0 and out.scores["math"][2] == -1.0
    assert out.rewards[1] == -2.0
    assert "took longer than 1 s (its worker process was killed)" in out.errors["math"][1]
    assert scorer.functions[0].restarts == 1
    scorer.close()


def test_a_worker_that_dies_fails_its_sample_only():
    scorer = RewardScorer([python_fn("dies_on_die", timeout_s=5.0)])
    out = scorer(inputs(["ab", "die", "abc"]))
    assert out.scores["python"][0::2] == [2.0, 3.0]
    assert out.errors["python"][1] == "reward 'python': its worker process died (exit code 3)"
    scorer.close()


def test_without_a_time_limit_the_function_runs_in_process():
    scorer = RewardScorer([python_fn("length_parity", timeout_s=None)])
    assert type(scorer.functions[0]).__name__ == "PythonReward"
    assert scorer(inputs(["ab"])).rewards == [1.0]


def test_time_limit_outside_the_main_thread():
    box = {}

    def run():
        try:
            call_with_time_limit(lambda: time.sleep(30), 0.2)
        except RewardTimeout as e:
            box["error"] = str(e)

    t = threading.Thread(target=run)
    t.start()
    t.join(5)
    assert box == {"error": "took longer than 0.2 s"}
    assert call_with_time_limit(lambda: 3, 1.0) == 3


def test_batched_user_function_and_wrong_length():
    scorer = RewardScorer([python_fn("batched_lengths", batched=True)])
    assert scorer(inputs(["a", "abc"])).rewards == [1.0, 3.0]
    scorer = RewardScorer([python_fn("length_parity", batched=True)])  # wrong shape of function
    out = scorer(inputs(["a"]))
    assert out.errors["python"][0].startswith("reward 'python': TypeError")


def test_configs_from_dicts_and_their_errors():
    cfg = reward_fn_config({"type": "math", "correct_reward": 2.0, "name": "acc"})
    assert (
        isinstance(cfg, MathRewardConfig)
        and cfg.correct_reward == 2.0
        and cfg.display_name == "acc"
    )
    with pytest.raises(ValueError, match=r"unknown type 'rm'; expected one of \['math', 'python'"):
        reward_fn_config({"type": "rm"})
    with pytest.raises(ValueError, match=r"type 'math' has no option\(s\) \['corect_reward'\]"):
        reward_fn_config({"type": "math", "corect_reward": 1})
    with pytest.raises(ValueError, match="needs a 'type'"):
        reward_fn_config({"path": "x:y"})
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        RewardScorer([PythonRewardConfig(path="no_such_module:f")])
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        RewardScorer([python_fn("missing")])
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        RewardScorer([PythonRewardConfig(path="tests.reward_fns.constant")])
    with pytest.raises(ValueError, match="names must be unique"):
        RewardScorer([MathRewardConfig(), MathRewardConfig()])


def test_reward_model_reads_its_own_template(tiny_model_dir, llama_rm_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from megatron_rl.data import render_prompt

    actor_tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    # The actor generated token ids under ChatML; the response is decoded without specials.
    response_ids = actor_tok("The answer is \\boxed{4}.", add_special_tokens=False)["input_ids"]
    response_ids.append(actor_tok.eos_token_id)
    response = actor_tok.decode(response_ids, skip_special_tokens=True)
    sample = RewardInput(prompt, render_prompt(actor_tok, prompt), response, label="4")
    assert "<|im_start|>" in sample.prompt_text

    rm = RewardModelConfig(model_dir=str(llama_rm_dir), batch_size=2).build()
    [text] = rm.render([sample])
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nThe answer is \\boxed{4}.<|eot_id|>"
    )
    # Its score is the HF model's output at the last token of exactly that text, and padding
    # inside a batch does not change it.
    rm_tok = AutoTokenizer.from_pretrained(llama_rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(llama_rm_dir, dtype=torch.float32)
    with torch.no_grad():
        ids = rm_tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        expected = model(ids).logits[0, 0].item()
    short = RewardInput("hi", "", "ok")
    values, errors = rm([sample, short, sample])
    assert errors == [None, None, None]
    assert values[0] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert values[2] == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert values[1] != pytest.approx(expected, abs=1e-3)


def test_reward_model_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="needs model_dir"):
        RewardModelConfig().build()
