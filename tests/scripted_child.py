"""A child for `tests/test_child_process_unit.py`, run as `python -m tests.scripted_child`: its
config says how its build fails (if it does), its requests what it does."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from megatron_rl.child_process import serve


def build(config: dict) -> dict:
    if "refuse" in config:
        raise ValueError(config["refuse"])
    if "crash" in config:
        raise RuntimeError(config["crash"])
    if "exit" in config:
        os._exit(config["exit"])
    if config.get("hang"):
        time.sleep(3600)
    return config


def handle(config: dict, request: tuple):
    """("echo", *items): each item, as its own reply; ("exit", code): the process exits;
    ("spawn_and_hang",): a grandchild's pid, then no reply ever (the grandchild sleeps too)."""
    kind, *args = request
    if kind == "echo":
        yield from args
    elif kind == "exit":
        os._exit(args[0])
    else:
        # A plain grandchild: no parent-death signal, so only the group kill can end it.
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        yield grandchild.pid
        time.sleep(3600)


if __name__ == "__main__":
    serve(build, handle)
