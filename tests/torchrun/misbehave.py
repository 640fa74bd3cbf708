"""torchrun worker for the launcher's own tests: fail on one rank, hang, wait for a stop
request (`megatron_rl.preemption`) and exit 0, or say who it is (rank, local rank, NCCL host)
after an all_reduce over every rank."""

import argparse
import os
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from megatron_rl.preemption import STOP


@record
def main():
    STOP.install()
    p = argparse.ArgumentParser()
    p.add_argument(
        "--mode", choices=["fail-rank-1", "hang", "wait-for-stop", "whoami"], required=True
    )
    a = p.parse_args()
    torch.distributed.init_process_group("gloo")
    if a.mode == "fail-rank-1" and torch.distributed.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1 (launcher test)")
    if a.mode == "hang":
        time.sleep(3600)
    if a.mode == "wait-for-stop":
        deadline = time.time() + 120
        while not STOP.requested and time.time() < deadline:
            time.sleep(0.1)
        print(f"rank {torch.distributed.get_rank()} stops: {STOP.reason}", flush=True)
        # torchrun's wait before its SIGKILL, as the launcher gave it (the environment)
        print(f"shutdown timeout {os.environ.get('TORCH_ELASTIC_SHUTDOWN_TIMEOUT')}", flush=True)
    if a.mode == "whoami":
        world = torch.tensor([1])
        torch.distributed.all_reduce(world)
        line = (
            f"whoami rank={os.environ['RANK']} local_rank={os.environ['LOCAL_RANK']} "
            f"world={int(world)} hostid={os.environ.get('NCCL_HOSTID')}\n"
        )
        os.write(1, line.encode())  # one write: the nodes share one output file
    torch.distributed.barrier()
    # torn down here, not by the interpreter's exit: left to it, a rank once aborted
    # ("terminate called without an active exception") while its peer's node had gone
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
