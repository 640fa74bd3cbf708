"""Can two ranks share ONE GPU under NCCL? The collectives Megatron's TP and PP use, tried.

    python -m tools.gpu_nccl_probe

Why: the worker-level TP=2 / PP=2 tests need two ranks. NCCL refuses two ranks of one host
on one device at communicator set-up ("Duplicate GPU detected", ncclInvalidUsage); gloo
takes CUDA tensors only for broadcast and all_reduce (torch's backend table), not for the
all_gather / reduce_scatter of sequence parallelism nor the send/recv of pipeline stages.
A route reported to work elsewhere: give each rank its own `NCCL_HOSTID`, so NCCL takes
them for two hosts and connects them through its socket transport on loopback (slow, but
every collective is NCCL's own kernel on the device).

This driver starts two plain processes (RANK 0/1, LOCAL_RANK 0 for both: each "host" has
one device, cuda:0) twice: once as they would start under torchrun (expected: the refusal),
once with a NCCL_HOSTID each. In each, rank 0 and 1 run all_reduce, all_gather_into_tensor,
reduce_scatter_tensor and a send/recv pair (batch_isend_irecv, Megatron's p2p) on bf16 CUDA
tensors and check the values. One JSON line per variant on stdout:
{"probe": "nccl_two_ranks_one_gpu", "variant", "ok", "ops": {op: true|error}, "seconds"}.
What it leaves out: Megatron itself (the TP/PP tests do that once the route is known).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VARIANTS = {
    "same_host": {},
    "hostid_per_rank": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
}
"""Variant -> extra environment (hostid_per_rank also sets NCCL_HOSTID per rank)."""

RANK_TIMEOUT_S = 90


def _ops(rank: int) -> dict:
    """Run each collective on cuda:0; op -> True or the error's first line."""
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0)
    results: dict = {}

    def check(name, fn):
        try:
            fn()
            torch.cuda.synchronize(dev)
            results[name] = True
        except Exception as e:  # each op's failure is a finding, not the end of the probe
            results[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    def all_reduce():
        x = torch.full((1024,), float(rank + 1), dtype=torch.bfloat16, device=dev)
        dist.all_reduce(x)
        torch.testing.assert_close(x, torch.full_like(x, 3.0))

    def all_gather():
        x = torch.full((4,), float(rank), dtype=torch.bfloat16, device=dev)
        out = torch.empty((8,), dtype=torch.bfloat16, device=dev)
        dist.all_gather_into_tensor(out, x)
        want = torch.tensor([0.0] * 4 + [1.0] * 4, dtype=torch.bfloat16, device=dev)
        torch.testing.assert_close(out, want)

    def reduce_scatter():
        x = torch.arange(8, dtype=torch.bfloat16, device=dev)
        out = torch.empty((4,), dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(out, x)
        torch.testing.assert_close(out, 2 * x[4 * rank : 4 * rank + 4])

    def send_recv():
        peer = 1 - rank
        send = torch.full((16,), float(rank + 10), dtype=torch.bfloat16, device=dev)
        recv = torch.empty((16,), dtype=torch.bfloat16, device=dev)
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        torch.testing.assert_close(recv, torch.full_like(recv, float(peer + 10)))

    check("all_reduce", all_reduce)
    check("all_gather_into_tensor", all_gather)
    check("reduce_scatter_tensor", reduce_scatter)
    check("send_recv", send_recv)
    return results


def worker() -> int:
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    try:
        dist.init_process_group(
            "nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
        )
        ops = _ops(rank)
        dist.destroy_process_group()
    except Exception as e:
        ops = {"init": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    print(json.dumps({"rank": rank, "ops": ops}), flush=True)
    return 0


def run_variant(name: str) -> dict:
    from megatron_rl.launch import free_port, kill_tree

    port = str(free_port())
    procs = []
    start = time.perf_counter()
    for rank in (0, 1):
        env = {
            **os.environ,
            **VARIANTS[name],
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
        }
        if name == "hostid_per_rank":
            env["NCCL_HOSTID"] = f"gpu-campaign-rank{rank}"
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tools.gpu_nccl_probe", "--worker"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
        )
    ranks, tails = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            out, _ = proc.communicate()
            out += f"\n(killed after {RANK_TIMEOUT_S} s)"
        tails.append(out[-2000:])
        ranks += [json.loads(ln) for ln in out.splitlines() if ln.startswith('{"rank"')]
    ops = {k: v for r in ranks for k, v in r["ops"].items() if v is not True}
    ops.update({k: True for r in ranks for k, v in r["ops"].items() if k not in ops})
    ok = len(ranks) == 2 and all(v is True for v in ops.values()) and "init" not in ops
    for tail in tails:  # the NCCL warnings say why; they stay in the part's log
        print(tail, file=sys.stderr)
    return {
        "probe": "nccl_two_ranks_one_gpu",
        "variant": name,
        "env": VARIANTS[name] | ({"NCCL_HOSTID": "per rank"} if name != "same_host" else {}),
        "ok": ok,
        "ops": ops,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--worker"]:
        return worker()
    import torch

    if not torch.cuda.is_available():
        print("gpu_nccl_probe: no CUDA device", file=sys.stderr)
        return 2
    found = [run_variant(name) for name in VARIANTS]
    for line in found:
        print(json.dumps(line), flush=True)
    # The probe succeeded if it could tell: a route works or every variant said why not.
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
