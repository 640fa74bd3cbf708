"""Reward functions the tests load by import path (`tests.reward_fns:NAME`), in-process, in
Ray workers and in the reference reward server."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path


def length_parity(prompt: str, response: str, label) -> float:
    """1 for an even number of characters, else 0: random responses give mixed groups."""
    return float(len(response) % 2 == 0)


def constant(prompt: str, response: str, label) -> float:
    """Every group all-equal: dynamic filtering can never fill a rollout."""
    return 0.5


def slow_length_parity(prompt: str, response: str, label, delay_s: float = 0.01) -> float:
    time.sleep(delay_s)
    return length_parity(prompt, response, label)


def fails_on_odd(prompt: str, response: str, label) -> float:
    if len(response) % 2:
        raise RuntimeError("odd response")
    return 1.0


def nan_reward(prompt: str, response: str, label) -> float:
    return math.nan


def sleeps_forever(prompt: str, response: str, label) -> float:
    time.sleep(3600)
    return 0.0


def stalls_on_rank_1(prompt: str, response: str, label) -> float:
    """Rank 1 never returns (a reward service that stopped answering, on one rank only); the
    other ranks score by length parity and go on to the next collective."""
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return length_parity(prompt, response, label)


def batched_lengths(prompts: list[str], responses: list[str], labels: list) -> list[float]:
    return [float(len(r)) for r in responses]


_flaky_calls = {"n": 0}


def by_label(prompt: str, response: str, label) -> float:
    """One function, behaviour chosen by the label, so one test server covers every case:
    "raise" -> exception (HTTP 500), "sleep" -> hang, "flaky" -> fails on its first call
    only, anything else -> the response's length."""
    if label == "raise":
        raise RuntimeError("the reward function raised")
    if label == "sleep":
        time.sleep(60)
    if label == "flaky":
        _flaky_calls["n"] += 1
        if _flaky_calls["n"] == 1:
            raise RuntimeError("transient failure")
    return float(len(response))


def swallows_exceptions(prompt: str, response: str, label) -> float:
    """Catches every Exception while it hangs: the time limit must still stop it."""
    while True:
        try:
            time.sleep(0.05)
        except Exception:
            pass


def first_char_parity(prompt: str, response: str, label) -> float:
    """+1 if the response's first character has an even code point, else -1: a reward the
    critic can learn (every token after the first sees it), for value pretraining tests."""
    return 1.0 if response and ord(response[0]) % 2 == 0 else -1.0


def label_sign(prompt: str, response: str, label) -> float:
    """+1 for label "good", -1 otherwise: returns that depend on the prompt only."""
    return 1.0 if label == "good" else -1.0


def rank_dependent(prompt: str, response: str, label, calls_file: str) -> float:
    """Different on every rank and every call (a sampling judge, seen from TP ranks); notes
    each call (the scoring rank) in `calls_file`."""
    import os
    import random

    rank = int(os.environ.get("RANK", 0))
    with open(calls_file, "a") as f:
        f.write(f"{rank}\n")
    return rank + random.random()


def regex_in_c(prompt: str, response: str, label) -> float:
    """A catastrophic regular expression for response "hang": the regex engine runs in C
    holding the GIL for hours (SIGALRM is only handled after it returns)."""
    import re

    if response == "hang":
        re.match(r"(a+)+$", "a" * 64 + "b")
    return float(len(response))


def dies_on_die(prompt: str, response: str, label) -> float:
    """The process exits (as a segfaulting extension would) for response "die"."""
    import os

    if response == "die":
        os._exit(3)
    return float(len(response))


def coin_flip_or_regex_hang(prompt: str, response: str, label, calls_file: str) -> float:
    """A sampling judge seen from each rank (a fresh coin per call and per process), stuck in
    C for hours on responses whose length is a multiple of 5; notes the rank of each call."""
    import os
    import random

    with open(calls_file, "a") as f:
        f.write(f"{os.environ.get('RANK', 0)}\n")
    if len(response) % 5 == 0:
        regex_in_c(prompt, "hang", label)
    return float(random.random() < 0.5)


def slow_once_flagged(prompt: str, response: str, label, flag: str) -> float:
    """`length_parity`, taking 45 s per call once the file `flag` exists (an LLM judge or a
    code run behaves so); writes `flag`.scoring first, so a test knows scoring has begun."""
    if os.path.exists(flag):
        Path(flag + ".scoring").touch()
        time.sleep(45)
    return length_parity(prompt, response, label)
