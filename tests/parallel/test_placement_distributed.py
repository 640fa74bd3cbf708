"""The disaggregated placement (`parallel/placement.py`) under torchrun (3 ranks): two
roles with default groups of their own, Megatron on the trainers' world, the weight push over
the bridge and a stop request crossing the roles. The split's arithmetic:
tests/parallel/test_placement_unit.py."""

import pytest
import torch

from megatron_rl.launch import run_torchrun
from megatron_rl.parallel.placement import ENGINE


@pytest.mark.distributed
@pytest.mark.e2e  # 3 processes, Megatron and vLLM (~45 s): kept out of `make test`'s 20 minutes
def test_two_roles_in_one_launch_push_weights_and_share_a_stop(tiny_model_dir, tmp_path):
    run_torchrun(
        "tests.torchrun.placement_push",
        ["--hf-dir", str(tiny_model_dir), "--out-dir", str(tmp_path)],
        nproc=3,
    )
    t0, t1, e = (torch.load(tmp_path / f) for f in ("trainer0.pt", "trainer1.pt", "engine2.pt"))
    # each role's default group is its own world, and RANK / WORLD_SIZE say so
    assert (t0["role_world"], t0["members"], t0["env"]) == (2, 2, (0, 2))
    assert (t1["role_rank"], t1["env"]) == (1, (1, 2))
    assert (e["role"], e["role_rank"], e["role_world"], e["members"], e["env"]) == (
        ENGINE, 0, 1, 1, (0, 1),
    )  # fmt: skip
    # the push: version 1, in several 64 KB buckets; two optimizer steps moved the engine's
    # log-probs, which now equal the trained actor's on the same tokens within the colocated
    # sync's bound (tests/sync/test_sync_distributed.py)
    assert e["version"] == 1 and t0["sent"]["buckets"] > 1
    assert e["change"] > 0.05 and e["gap"] <= 1e-4
    # a signal only trainer rank 1 got reaches the engine rank through the job's store
    assert t1["stop"] == "SIGUSR1" and e["stop"] == "SIGUSR1 on rank 1"
