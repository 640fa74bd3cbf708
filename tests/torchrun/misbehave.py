"""torchrun worker for the launcher's own tests: fail on one rank, or hang."""

import argparse
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["fail-rank-1", "hang"], required=True)
    a = p.parse_args()
    torch.distributed.init_process_group("gloo")
    if a.mode == "fail-rank-1" and torch.distributed.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1 (launcher test)")
    if a.mode == "hang":
        time.sleep(3600)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
