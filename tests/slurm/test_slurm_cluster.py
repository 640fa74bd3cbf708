"""The shipped sbatch script (`examples/qwen2.5-32b/slurm_vapo.sbatch`, unmodified) on a real
two-node SLURM cluster on this machine (`tools/slurm_local.sh`: munged, slurmctld, slurmd n1
and n2 with one fake GPU each), training the tiny VAPO recipe with one process per node: the
multi-node torchrun rendezvous over gloo, SLURM's pre-emption signal, the requeue and the
resume, and a pre-emption that comes before the workers exist.

Needs SLURM and munge (`tools/slurm_local.sh install`, which `.ci/run` runs where apt-get
works) and root (the daemons, mknod, /etc/hosts); skipped, saying which, otherwise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_rl.launch import free_port
from tests.trainer.runs import SMALL_VAPO, metrics

pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.e2e]

REPO = Path(__file__).resolve().parents[2]
SLURM_LOCAL = REPO / "tools" / "slurm_local.sh"
SCRIPT = "examples/qwen2.5-32b/slurm_vapo.sbatch"
TOTAL_STEPS = 8
PRETRAIN_STEPS = 2
RECIPE = [
    *SMALL_VAPO,
    f"critic.pretrain_steps={PRETRAIN_STEPS}",
    f"trainer.total_steps={TOTAL_STEPS}",
    "trainer.save_interval=0",
]
NOT_COMPARED = ("timing/", "memory/", "perf/tokens_per_s")  # measured, not computed: differ per run


def missing() -> str | None:
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        return (
            "SLURM and munge are not installed: `tools/slurm_local.sh install` (root; "
            ".ci/run does it where apt-get works)"
        )
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (its daemons, mknod, /etc/hosts)"
    return None


class Cluster:
    def __init__(self, state_dir: Path):
        self.dir = state_dir
        venv_bin = str(Path(sys.executable).parent)  # the job's `python` is this one
        self.env = {
            **os.environ,
            "SLURM_CONF": str(state_dir / "slurm.conf"),
            "PATH": venv_bin + os.pathsep + os.environ["PATH"],
        }

    def run(self, *cmd: str, cwd: Path | None = None) -> str:
        done = subprocess.run(
            cmd, env=self.env, capture_output=True, text=True, timeout=60, cwd=cwd
        )
        assert done.returncode == 0, f"{cmd}: {done.stdout}{done.stderr}"
        return done.stdout

    def submit(self, out: Path, *overrides: str, **env: str) -> str:
        exports = {
            "CONFIG": "examples/tiny/vapo.yaml",
            "GPUS_PER_NODE": "1",
            "MASTER_PORT": str(free_port()),
            "OMP_NUM_THREADS": "1",
            **env,
        }
        out.mkdir(parents=True)
        return self.run(
            "sbatch", "--parsable", "--nodes=2", "--gpus-per-node=1", "--cpus-per-task=2",
            "--time=5", "--signal=B:USR1@60", f"--output={out}/job.out", f"--chdir={REPO}",
            "--export=ALL," + ",".join(f"{k}={v}" for k, v in exports.items()),
            str(REPO / SCRIPT), f"trainer.output_dir={out}", *overrides,
            cwd=out,  # the submit directory: the script keeps its stop file under it
        ).strip()  # fmt: skip

    def idle(self) -> bool:
        return set(self.run("sinfo", "-h", "-N", "-o", "%t").split()) == {"idle"}

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", job_id)))

    def wait(self, job_id: str, out: Path, done, what: str, timeout: float = 300) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            job = self.job(job_id)
            if done(job):
                return job
            time.sleep(0.2)
        log = (out / "job.out").read_text() if (out / "job.out").exists() else "(no job.out)"
        raise AssertionError(f"job {job_id}: not {what} after {timeout}s: {job}\n{log[-5000:]}")


def our_processes(state_dir: Path) -> list[psutil.Process]:
    """Processes of this cluster: its daemons and whatever runs with its SLURM_CONF."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            text = " ".join(p.info["cmdline"] or []) + " ".join((p.info["environ"] or {}).values())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if str(state_dir) in text and p.pid != os.getpid():
            found.append(p)
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing()
    if reason:
        pytest.skip(reason)
    state_dir = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        [str(SLURM_LOCAL), "up", str(state_dir)], capture_output=True, text=True, timeout=120
    )
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield Cluster(state_dir)
    finally:
        down = subprocess.run(
            [str(SLURM_LOCAL), "down", str(state_dir)], capture_output=True, text=True, timeout=180
        )
        assert down.returncode == 0, down.stdout + down.stderr
        left = our_processes(state_dir)
        assert not left, f"still running after `slurm_local.sh down`: {[p.cmdline() for p in left]}"


def model_args(tiny_model_dir) -> list[str]:
    return [f"model.path={tiny_model_dir}", *RECIPE]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tiny_model_dir, tmp_path_factory):
    """The recipe run start to end by one job on both nodes (1 process each)."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    job_id = cluster.submit(out, *model_args(tiny_model_dir))
    job = cluster.wait(job_id, out, lambda j: j["JobState"] in ("COMPLETED", "FAILED"), "done")
    return job, out


def train_rows(out: Path) -> list[dict]:
    return metrics(out) if (out / "metrics.jsonl").exists() else []


def numbers(row: dict, keys: list[str]) -> torch.Tensor:
    """A metrics row's values (null, as NaN is written, back to NaN)."""
    return torch.tensor(
        [float("nan") if row[k] is None else row[k] for k in keys], dtype=torch.float64
    )


def final_state(out: Path) -> dict:
    root = out / "checkpoints"
    return json.loads((root / (root / "latest").read_text() / "trainer_state.json").read_text())


def requeue_and_finish(cluster, job_id: str, out: Path) -> None:
    """After a USR1 to the batch script: wait for the requeue, start the job again at once
    and wait for it to complete (its one restart)."""
    cluster.wait(
        job_id, out, lambda j: j["JobState"] == "PENDING" and j["Restarts"] == "1", "requeued"
    )
    # Skip SLURM's ~2 min requeue hold, but not the nodes' clean-up of the last start: a
    # slurmd refuses a start within a second of revoking that job's credential ("Job
    # credential revoked", the job ends FAILED), so wait for idle nodes and a few seconds.
    cluster.wait(job_id, out, lambda j: cluster.idle(), "back to idle nodes")
    time.sleep(3)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    job = cluster.wait(job_id, out, lambda j: j["JobState"] in ("COMPLETED", "FAILED"), "done")
    log = (out / "job.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-5000:]
    assert job["Restarts"] == "1"
    assert not re.search(r"Traceback", log), log[-5000:]


def same_steps_as(out: Path, reference_out: Path) -> None:
    """Each step logged once, with the metrics of the reference run's (rtol 1e-4), and the
    same final data position."""
    rows, reference = train_rows(out), train_rows(reference_out)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))  # each step once
    for got, ref in zip(rows, reference, strict=True):
        keys = sorted(k for k in ref if k != "stage" and not k.startswith(NOT_COMPARED))
        torch.testing.assert_close(
            numbers(got, keys),
            numbers(ref, keys),
            rtol=1e-4, atol=1e-5, equal_nan=True, msg=lambda m, s=ref["step"]: f"step {s}: {m}",
        )  # fmt: skip
    assert final_state(out)["data"] == final_state(reference_out)["data"]


def test_two_nodes_one_process_each_train_through_the_script_rendezvous(uninterrupted):
    job, out = uninterrupted
    log = (out / "job.out").read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-5000:]
    assert job["NodeList"] == "n[1-2]" and job["Restarts"] == "0"
    # one torchrun on each node, one rank each: a world of 2 built by the c10d rendezvous
    assert "node n1 (0 of 2): torchrun" in log and "node n2 (1 of 2): torchrun" in log
    state = final_state(out)
    assert state["world_size"] == 2 and state["step"] == TOTAL_STEPS
    assert [r["step"] for r in train_rows(out)] == list(range(1, TOTAL_STEPS + 1))
    assert f"ends (exit 0), checkpoint: step_{PRETRAIN_STEPS + TOTAL_STEPS:06d} finished" in log


def test_usr1_saves_requeues_and_resumes_where_it_stopped(
    cluster, uninterrupted, tiny_model_dir, tmp_path
):
    """`scancel --signal=USR1 --batch` (what `--signal=B:USR1@60` sends before the time
    limit) after two PPO steps: the workers save, the script requeues, the next start
    resumes from that checkpoint and completes; every step's metrics equal the uninterrupted
    run's, and so does the data position."""
    out = tmp_path / "run"
    job_id = cluster.submit(out, *model_args(tiny_model_dir))
    cluster.wait(job_id, out, lambda j: len(train_rows(out)) >= 2, "past two steps")
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    requeue_and_finish(cluster, job_id, out)
    log = (out / "job.out").read_text()
    assert "USR1: the workers save their last step boundary and stop" in log
    # saved: the pretrained critic, the pre-emption's checkpoint, the last step's
    pretrained, saved, last = re.findall(r"saved checkpoint \S+/(step_\d+)", log)
    assert (
        pretrained == f"step_{PRETRAIN_STEPS:06d}"
        and last == f"step_{PRETRAIN_STEPS + TOTAL_STEPS:06d}"
    )
    stopped_at = int(saved.removeprefix("step_")) - PRETRAIN_STEPS
    assert 2 <= stopped_at < TOTAL_STEPS
    assert f"requeueing job {job_id} (checkpoint {saved})" in log
    assert f"job {job_id} start 1 on n[1-2], from checkpoint: {saved}" in log
    assert re.search(rf"resumed from \S+/{saved} \(step {stopped_at}\)", log)
    same_steps_as(out, uninterrupted[1])


@pytest.mark.extended
def test_usr1_mid_generation_aborts_the_step_and_the_requeued_job_redoes_it(
    cluster, uninterrupted, tiny_model_dir, tmp_path
):
    """A stop request inside a step: the signal lands inside vLLM's generation of PPO step 3 (held there until the
    signal comes: tests/slurm/hold_generation), through the batch script's trap and stop
    file as in production: the workers abort the generation, save step 2 (the step's start)
    with what step 3's rollout had generated, the job requeues and the next start redoes step
    3, continuing that rollout (no token generated twice); every step's metrics and the data
    position equal the uninterrupted run's."""
    out = tmp_path / "run"
    marker = tmp_path / "held"
    job_id = cluster.submit(
        out,
        *model_args(tiny_model_dir),
        PYTHONPATH=f"{REPO / 'tests' / 'slurm' / 'hold_generation'}:{REPO}",
        MEGATRON_RL_HOLD_AT="train:3:rollout/generate",
        MEGATRON_RL_HOLD_MARKER=str(marker),
    )
    cluster.wait(job_id, out, lambda j: marker.exists(), "inside step 3's generation")
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    requeue_and_finish(cluster, job_id, out)
    log = (out / "job.out").read_text()
    assert "train step 3 aborted in rollout/generate" in log, log[-5000:]
    boundary = f"step_{PRETRAIN_STEPS + 2:06d}"
    assert f"requeueing job {job_id} (checkpoint {boundary})" in log
    assert re.search(rf"resumed from \S+/{boundary} \(step 2\)", log)
    kept = re.findall(rf"kept (\d+) generated tokens of train step 3's rollout .* {boundary}", log)
    assert len(kept) == 1 and int(kept[0]) > 0, log[-5000:]
    assert train_rows(out)[2]["rollout/resumed_tokens"] == int(kept[0])
    same_steps_as(out, uninterrupted[1])


@pytest.mark.extended
def test_an_engine_node_and_a_trainer_node_run_one_step_off_through_a_requeue(
    cluster, tiny_model_dir, tmp_path
):
    """Through the shipped script: the disaggregated placement over the two nodes (n1's
    rank trains, n2's only generates: the last `engine_ranks` ranks), one step off. USR1
    after two PPO steps, while the engine runs ahead: every rank saves or exits, the job
    requeues, and the next start resumes. Its first round is the one the stop's checkpoint
    kept where the stop came after the trainer took it (one version behind, as it was), else
    generated with the checkpoint's weights (staleness 0: a round ahead is not kept); the
    others one version behind; each step logged once."""
    out = tmp_path / "run"
    job_id = cluster.submit(
        out, *model_args(tiny_model_dir), "rollout.placement=disaggregated",
        "rollout.engine_ranks=1", "parallel.tensor_model_parallel_size=1",
        "async.max_staleness=1",
    )  # fmt: skip
    cluster.wait(job_id, out, lambda j: len(train_rows(out)) >= 2, "past two steps")
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    requeue_and_finish(cluster, job_id, out)
    log = (out / "job.out").read_text()
    saved = re.findall(r"saved checkpoint \S+/(step_\d+)", log)[1]
    stopped_at = int(saved.removeprefix("step_")) - PRETRAIN_STEPS
    assert 2 <= stopped_at < TOTAL_STEPS, log[-5000:]
    rows = train_rows(out)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    staleness = [r["rollout/staleness"] for r in rows]
    kept = f"generated tokens of train step {stopped_at + 1}'s rollout" in log
    first = 1.0 if kept else 0.0
    want = [0.0, *[1.0] * (stopped_at - 1), first, *[1.0] * (TOTAL_STEPS - stopped_at - 1)]
    assert staleness == want, (staleness, stopped_at, kept)


@pytest.mark.extended
def test_a_signal_before_the_workers_start_is_honoured_and_a_start_without_progress_ends(
    cluster, tiny_model_dir, tmp_path
):
    """USR1 as soon as the script has started (no worker exists yet): the workers find the
    stop file when they start and exit 0 before a step (no one dies of the signal); the
    start saved nothing new, and with MAX_REQUEUES_WITHOUT_PROGRESS=0 the job stops, FAILED,
    instead of requeueing itself forever."""
    out = tmp_path / "run"
    job_id = cluster.submit(out, *model_args(tiny_model_dir), MAX_REQUEUES_WITHOUT_PROGRESS="0")
    started = f"job {job_id} start 0"
    cluster.wait(
        job_id,
        out,
        lambda j: (out / "job.out").exists() and started in (out / "job.out").read_text(),
        "started",
    )
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    job = cluster.wait(job_id, out, lambda j: j["JobState"] in ("COMPLETED", "FAILED"), "done")
    log = (out / "job.out").read_text()
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "1:0", log[-5000:]
    assert job["Restarts"] == "0"
    assert "stop requested before the first step (stop file" in log, log[-5000:]
    assert "made no progress in 1 start(s) in a row (checkpoint still none)" in log
    assert not re.search(r"Traceback|Signals.SIGUSR1", log), log[-5000:]
    assert train_rows(out) == [] and not (out / "checkpoints").exists()
    stop_file = out / ".megatron_rl" / f"slurm-{job_id}" / "stop"  # under the submit directory
    assert stop_file.read_text() == "SIGUSR1 to the batch script\n"
