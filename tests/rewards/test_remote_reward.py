"""The remote reward client against the reference server, a real HTTP server on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from megatron_rl.rewards import RemoteRewardConfig, RewardInput, RewardScorer
from megatron_rl.rewards.remote import RemoteReward, RemoteRewardError


@pytest.fixture(scope="module")
def server_url():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "megatron_rl.rewards.server",
            "--reward",
            "tests.reward_fns:by_label",
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line
        yield line.split()[-1]
    finally:
        proc.kill()
        proc.wait()


def batch(*labels):
    return [RewardInput("q", "<q>", "x" * (i + 1), label=lab) for i, lab in enumerate(labels)]


def test_scores_come_back_in_order_across_request_batches(server_url):
    client = RemoteReward("rm", server_url + "/score", batch_size=2)
    assert client.score_batch(batch("a", "b", "c", "d", "e")) == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_a_500_is_retried_then_reported_with_the_url(server_url):
    client = RemoteReward("rm", server_url, max_retries=2, backoff_s=0.01)
    with pytest.raises(
        RemoteRewardError, match=r"HTTP 500: .*the reward function raised.*after 3 attempt"
    ):
        client.score_batch(batch("raise"))
    assert client.num_retries == 2


def test_a_transient_failure_is_retried_and_recovers(server_url):
    client = RemoteReward("rm", server_url, max_retries=2, backoff_s=0.01)
    assert client.score_batch(batch("flaky")) == [1.0]
    assert client.num_retries == 1


def test_a_timeout_is_retried_then_reported(server_url):
    client = RemoteReward("rm", server_url, timeout_s=0.3, max_retries=1, backoff_s=0.01)
    start = time.time()
    with pytest.raises(
        RemoteRewardError, match=r"127.0.0.1:\d+: (TimeoutError|URLError).*after 2 attempt"
    ):
        client.score_batch(batch("sleep"))
    assert time.time() - start < 10


def test_a_404_is_not_retried(server_url):
    client = RemoteReward("rm", server_url + "/nope", max_retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match="HTTP 404.*after 1 attempt"):
        client.score_batch(batch("a"))
    assert client.num_retries == 0


def test_remote_failures_become_failure_rewards_in_the_scorer(server_url):
    scorer = RewardScorer(
        [RemoteRewardConfig(url=server_url, max_retries=0, failure_reward=-1.0, batch_size=8)]
    )
    ok = scorer(batch("a", "b"))
    assert ok.rewards == [1.0, 2.0]
    failed = scorer(batch("a", "raise"))  # one request per batch: the whole batch fails
    assert failed.rewards == [-1.0, -1.0]
    assert "HTTP 500" in failed.errors["remote"][0]


def test_server_refuses_a_bad_function_path():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_rl.rewards.server",
            "--reward",
            "tests.reward_fns:nope",
            "--port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "has no attribute 'nope'" in r.stderr
