"""Client of a remote reward service: HTTP POST, JSON in and out, batched, with timeouts and
retries with exponential back-off.

Wire format (OpenRLHF's remote RM, so its servers work unchanged):
    request  {"query": [prompt_text + response], "prompts": [prompt_text],
              "responses": [response], "labels": [label]}
    response {"rewards": [float]}
Connection errors, timeouts, 429 and 5xx are retried; other 4xx are not (a bad request stays
bad). `megatron_rl.rewards.server` is a reference server.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from megatron_rl.rewards.base import RewardFunction, RewardInput


class RemoteRewardError(RuntimeError):
    pass


def post_json(url: str, payload: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def _retryable(error: Exception) -> bool:
    if isinstance(error, urllib.error.HTTPError):
        return error.code == 429 or error.code >= 500
    return isinstance(error, (urllib.error.URLError, TimeoutError, ConnectionError, OSError))


def _describe(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        body = error.read().decode(errors="replace")[:300]
        return f"HTTP {error.code}: {body}"
    return f"{type(error).__name__}: {error}"


class RemoteReward(RewardFunction):
    batched = True

    def __init__(
        self,
        name: str,
        url: str,
        batch_size: int = 32,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ):
        # The HTTP timeout bounds each attempt; the RewardFunction time limit is not used.
        super().__init__(name, timeout_s=None)
        self.url = url
        self.batch_size = batch_size
        self.request_timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.num_retries = 0
        """Retries made so far (all batches), for metrics."""

    def request(self, batch: list[RewardInput]) -> list[float]:
        payload = {
            "query": [s.prompt_text + s.response for s in batch],
            "prompts": [s.prompt_text for s in batch],
            "responses": [s.response for s in batch],
            "labels": [s.label for s in batch],
        }
        for attempt in range(self.max_retries + 1):
            try:
                reply = post_json(self.url, payload, self.request_timeout_s)
                break
            except Exception as e:
                if not _retryable(e) or attempt == self.max_retries:
                    tries = f"after {attempt + 1} attempt(s)"
                    raise RemoteRewardError(f"{self.url}: {_describe(e)} ({tries})") from e
                self.num_retries += 1
                time.sleep(self.backoff_s * 2**attempt)
        rewards = reply.get("rewards") if isinstance(reply, dict) else None
        if not isinstance(rewards, list) or len(rewards) != len(batch):
            raise RemoteRewardError(
                f"{self.url}: expected {{'rewards': [{len(batch)} numbers]}}, got {str(reply)[:200]}"
            )
        return [float(r) for r in rewards]

    def score_batch(self, batch: list[RewardInput]) -> list[float]:
        out = []
        for i in range(0, len(batch), self.batch_size):
            out.extend(self.request(batch[i : i + self.batch_size]))
        return out
