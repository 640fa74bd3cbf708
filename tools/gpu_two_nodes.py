"""Run a torchrun job as one-process "nodes" on this host, one per rank, each rank a host
of its own to NCCL: how two ranks share ONE GPU (`megatron_rl.launch.rank_node_commands`).

    python -m tools.gpu_two_nodes [--nodes 2] [--timeout-s S] -m module [args ...]

Exit code: the first failing node's, 124 at the time limit, else 0; a node failing or the
limit ends the others. The nodes' output is interleaved on stdout. The tests' launcher does
the same when MEGATRON_RL_RANKS_AS_NODES=1 (`megatron_rl.launch.run_torchrun`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from megatron_rl.launch import SHUTDOWN_TIMEOUT_ENV, rank_node_commands, run_nodes
from megatron_rl.procutil import free_port


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=480.0)
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("-m") if "-m" in argv else len(argv)  # the job's options are its own
    a = p.parse_args(argv[:cut])
    if a.nodes < 1 or cut == len(argv):
        p.error("expected --nodes >= 1 and '-m module [args ...]' after the options")
    env = {SHUTDOWN_TIMEOUT_ENV: "60", **os.environ, "PYTHONUNBUFFERED": "1"}
    code = run_nodes(rank_node_commands(a.nodes, free_port(), argv[cut:]), env, a.timeout_s)
    if code is None:
        print(f"gpu_two_nodes: killed after {a.timeout_s:.0f} s", flush=True)
        return 124
    return code


if __name__ == "__main__":
    raise SystemExit(main())
