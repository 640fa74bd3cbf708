"""Unit tier: the GPU campaign's parts list and its report, on CPU (no GPU here: the parts
themselves run where one is lent). The campaign runs for real: `env` and the timeout go
through the same subprocess path as on the GPU machine."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tools import gpu_campaign, gpu_nccl_probe, gpu_verdict
from tools.gpu_campaign import MAX_TIMEOUT_S, REPO, STATUSES, Part, run_campaign, skip_reason

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
SLEEP = ("timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)")
"""A part that outlives any test limit (stdlib, so it runs anywhere)."""


def modules_run(argv: tuple[str, ...]) -> list[str]:
    """`python -m argv[0]`, and the launchers' `-m` target (pytest's `-m` is a marker)."""
    if argv[0] not in ("megatron_rl.launch", "tools.gpu_two_nodes"):
        return [argv[0]]
    return [argv[0], argv[argv.index("-m") + 1]]


def files_named(argv: tuple[str, ...]) -> list[str]:
    """Arguments that name a repository file (the work dir's are made at run time)."""
    named = [a for a in argv if a.endswith((".py", ".yaml", ".jsonl")) and "=" not in a]
    return [a for a in named if not a.startswith("$WORK")]


def test_gpu_tests_run_every_file_with_gpu_marked_tests():
    gpu_marked = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = pytest\.mark\.gpu)", re.M)
    marked = sorted(
        str(f.relative_to(REPO))
        for f in (REPO / "tests").rglob("test_*.py")
        if gpu_marked.search(f.read_text())
    )
    assert marked == sorted(gpu_campaign.GPU_TEST_FILES)
    part = next(p for p in gpu_campaign.parts(Path("$WORK")) if p.name == "gpu_tests")
    assert set(gpu_campaign.GPU_TEST_FILES) <= set(part.argv)


def test_parts_have_unique_names_short_limits_and_runnable_commands():
    plan = gpu_campaign.parts(Path("$WORK"))
    names = [p.name for p in plan]
    assert len(names) == len(set(names)) and names[0] == "env"
    assert {"gpu_tests", "train_step_bf16", "trainer_hf_rollout", "worker_tp_pp"} <= set(names)
    for part in plan:
        assert 0 < part.timeout_s <= MAX_TIMEOUT_S <= 540, part.name
        for module in modules_run(part.argv):
            assert importlib.util.find_spec(module) is not None, (part.name, module)
        for name in files_named(part.argv):
            assert (REPO / name).is_file(), (part.name, name)
    assert next(p for p in plan if p.name == "env").gpus == 0  # runs on CPU too


def test_the_trainer_part_runs_two_hf_rollout_steps_in_bf16_and_keeps_its_timelines():
    part = next(p for p in gpu_campaign.parts(Path("/w")) if p.name == "trainer_hf_rollout")
    assert modules_run(part.argv) == ["megatron_rl.launch", "megatron_rl.cli.train"]
    for override in ("rollout.name=hf", "trainer.total_steps=2", "model.path=/w/tiny"):
        assert override in part.argv
    assert "model.precision.params_dtype=bfloat16" in part.argv and "vllm" not in part.needs
    assert part.artifacts == ("run_hf/metrics.jsonl", "run_hf/memory_timeline.jsonl")


def test_the_disaggregated_part_runs_a_trainer_and_an_engine_rank_as_two_nodes():
    part = next(p for p in gpu_campaign.parts(Path("/w")) if p.name == "disaggregated_nccl")
    assert modules_run(part.argv) == ["tools.gpu_two_nodes", "megatron_rl.cli.train"]
    assert part.argv[part.argv.index("-m") + 2] == "--config"
    for override in (
        "rollout.placement=disaggregated",
        "rollout.engine_ranks=1",
        "async.max_staleness=1",
        "trainer.total_steps=3",
        "rollout.name=hf",
    ):
        assert override in part.argv  # fmt: skip
    assert part.artifacts == ("run_apart/metrics.jsonl", "run_apart/memory_timeline.jsonl")


def test_the_one_gpu_worker_part_starts_a_node_per_rank(tmp_path):
    part = next(p for p in gpu_campaign.parts(Path("/w")) if p.name == "worker_tp_pp_one_gpu")
    two = next(p for p in gpu_campaign.parts(Path("/w")) if p.name == "worker_tp_pp")
    assert part.argv == two.argv and part.gpus == 1 < two.gpus
    assert dict(part.env) == {"MEGATRON_RL_RANKS_AS_NODES": "1"}
    # the part's environment reaches its subprocess
    probe = Part("probe", ("timeit", "-n", "1", "-r", "1", "import os; print(os.environ['X'])"),
                 env=(("X", "seen"),))  # fmt: skip
    record = gpu_campaign.run_part(probe, tmp_path, tmp_path / "probe.log")
    assert record["status"] == "passed", record["output_tail"]


def test_list_prints_name_limit_needs_and_command(capsys):
    assert gpu_campaign.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [p.name for p in gpu_campaign.parts(Path("w"))]
    bf16 = next(ln for ln in lines if ln.startswith("train_step_bf16"))
    assert "540s" in bf16 and "needs=megatron.core" in bf16
    assert "python -m tools.bench train_step --dtype bf16" in bf16


def test_an_unknown_part_or_a_limit_over_540_s_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        gpu_campaign.main(["--only", "mfu"])
    assert "unknown part(s) ['mfu']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="part x: timeout_s=600, expected 1..540"):
        Part("x", ("json.tool",), timeout_s=600)


def test_the_verdict_calls_run_every_part_the_verdict_reads_in_its_order():
    names = [p.name for p in gpu_campaign.parts(Path("w"))]
    calls = [part for call in gpu_campaign.VERDICT_CALLS for part in call]
    assert calls == list(gpu_verdict.PARTS_READ) and set(calls) <= set(names)
    # the compiled head's choice comes from the 16k bar's own part
    (part,) = [p for p in gpu_campaign.parts(Path("w")) if p.name == "train_step_16k"]
    assert "--compiled-head-forward" in part.argv and "--apart" in part.argv


@no_cuda
def test_a_verdict_call_runs_its_parts_alone_and_not_beside_only(tmp_path, capsys):
    assert gpu_campaign.main(["--out-dir", str(tmp_path), "--verdict-call", "2"]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["parts"]) == list(gpu_campaign.VERDICT_CALLS[1])
    assert {p["reason"] for p in report["parts"].values()} == {"no CUDA device"}
    capsys.readouterr()
    for argv in (["--verdict-call", "3"], ["--verdict-call", "1", "--only", "env"]):
        with pytest.raises(SystemExit):
            gpu_campaign.main(argv)
    err = capsys.readouterr().err
    assert "invalid choice: 3" in err and "not allowed with argument" in err


def test_skip_reasons_name_the_missing_devices_and_modules():
    part = Part("x", ("json.tool",), needs=("json", "no_such_module_xyz", "no_pkg_xyz.sub"))
    assert skip_reason(part, devices=0) == (
        "no CUDA device; needs no_such_module_xyz, no_pkg_xyz.sub (not installed)"
    )
    assert skip_reason(Part("y", ("json.tool",), gpus=0), devices=0) is None
    two = Part("z", ("json.tool",), gpus=2, gpus_reason="NCCL refuses it")
    assert (
        skip_reason(two, devices=1) == "needs 2 CUDA devices, this machine has 1: NCCL refuses it"
    )
    assert skip_reason(two, devices=2) is None
    tp_pp = next(p for p in gpu_campaign.parts(Path("w")) if p.name == "worker_tp_pp")
    assert "Duplicate GPU detected" in skip_reason(tp_pp, devices=1)


def check_report_format(report: dict) -> None:
    assert set(report) == {"date", "env", "parts"}
    for name, rec in report["parts"].items():
        assert rec["status"] in STATUSES, name
        if rec["status"] == "skipped":
            assert rec["reason"], name
        else:
            assert {"seconds", "returncode", "results", "log", "command"} <= set(rec), name
            assert isinstance(rec["results"], list) and Path(rec["log"]).is_file(), name


@pytest.fixture(scope="module")
def cpu_campaign(tmp_path_factory):
    """`python -m tools.gpu_campaign --only env train_step_bf16`, run as a session would."""
    out = tmp_path_factory.mktemp("campaign") / "gpu"
    cmd = [sys.executable, "-m", "tools.gpu_campaign", "--out-dir", str(out)]
    done = subprocess.run(
        [*cmd, "--only", "env", "train_step_bf16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out, done


@no_cuda
def test_on_cpu_env_passes_and_the_gpu_part_is_skipped_in_a_valid_report(cpu_campaign):
    out, done = cpu_campaign
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "report.json").read_text())
    check_report_format(report)
    assert list(report["parts"]) == ["env", "train_step_bf16"]
    env, step = report["parts"]["env"], report["parts"]["train_step_bf16"]
    assert env["status"] == "passed" and env["returncode"] == 0
    assert env["log"] == str(out / "env.log") and "tools.gpu_env" in (out / "env.log").read_text()
    assert report["env"] == env["results"][-1]
    assert report["env"]["torch"] == torch.__version__ and report["env"]["devices"] == []
    assert report["env"]["imports"]["megatron.core"] is True
    assert step == {"status": "skipped", "reason": "no CUDA device", "finished": step["finished"]}
    assert not (out / "train_step_bf16.log").exists()


@no_cuda
def test_a_second_only_run_merges_into_the_report(cpu_campaign, capsys):
    out, _ = cpu_campaign
    before = json.loads((out / "report.json").read_text())
    copy = out.parent / "copy"
    argv = ["--out-dir", str(out), "--only", "train_step_fp8", "--copy-to", str(copy)]
    assert gpu_campaign.main(argv) == 0
    assert sorted(p.name for p in copy.iterdir()) == ["report.json"]  # fp8 skipped: no log
    after = json.loads((out / "report.json").read_text())
    check_report_format(after)
    assert list(after["parts"]) == ["env", "train_step_bf16", "train_step_fp8"]
    assert after["env"] == before["env"] and after["parts"]["env"] == before["parts"]["env"]
    assert after["parts"]["train_step_fp8"]["reason"].startswith("no CUDA device; needs")
    assert "transformer_engine" in after["parts"]["train_step_fp8"]["reason"]
    # then what the report says against the bars (tools/gpu_verdict.py): nothing measured here
    printed = capsys.readouterr().out
    assert "GPU campaign report on no CUDA device" in printed
    assert "not measured  qwen2.5-0.5b, 4 x 2,048: PPO update / peer tokens/s" in printed


def test_a_skip_keeps_the_parts_earlier_run_and_says_since_when(tmp_path, capsys):
    """A machine that cannot run a part (here: a module it needs is missing) leaves in the
    report the run a machine that could made; a part never run is recorded as skipped."""
    (tmp_path / "m.json").write_text('{"mfu": 0.4}')
    out, argv = tmp_path / "out", ("json.tool", "--compact", str(tmp_path / "m.json"))
    first = run_campaign([Part("bench", argv, gpus=0)], out, tmp_path)["parts"]["bench"]
    assert first["status"] == "passed" and first["results"] == [{"mfu": 0.4}]
    missing = ("no_such_module_here",)
    plan = [Part("bench", argv, gpus=0, needs=missing), Part("never", argv, gpus=0, needs=missing)]
    report = run_campaign(plan, out, tmp_path)
    check_report_format(report)
    assert json.loads((out / "report.json").read_text()) == report
    kept, never = report["parts"]["bench"], report["parts"]["never"]
    since = kept.pop("skipped_since")
    assert kept == first
    assert since["reason"] == never["reason"] == "needs no_such_module_here (not installed)"
    assert since["finished"] and never["status"] == "skipped"
    assert f"its run of {first['finished']} kept" in capsys.readouterr().out
    # skipped again later: still skipped since the first skip
    first_skip = {"reason": since["reason"], "finished": "2026-01-01T00:00:00"}
    report["parts"]["bench"]["skipped_since"] = first_skip
    (out / "report.json").write_text(json.dumps(report))
    again = run_campaign(plan[:1], out, tmp_path)["parts"]["bench"]
    assert again == {**first, "skipped_since": first_skip}


@no_cuda
def test_a_kept_failure_does_not_fail_the_run_that_skipped_it(tmp_path):
    log = tmp_path / "train_step_fp8.log"
    log.write_text("Traceback ...\n")
    failed = {"command": "python -m tools.bench", "log": str(log), "status": "failed",
              "returncode": 1, "seconds": 3.0, "results": [], "finished": "2026-11-28T06:00:00"}  # fmt: skip
    (tmp_path / "report.json").write_text(
        json.dumps({"date": None, "env": None, "parts": {"train_step_fp8": failed}})
    )
    assert gpu_campaign.main(["--out-dir", str(tmp_path), "--only", "train_step_fp8"]) == 0
    kept = json.loads((tmp_path / "report.json").read_text())["parts"]["train_step_fp8"]
    assert kept.pop("skipped_since")["reason"].startswith("no CUDA device")
    assert kept == failed


def test_a_part_over_its_limit_is_killed_and_recorded_as_timeout(tmp_path):
    (tmp_path / "m.json").write_text('{"mfu": 0.4}')
    plan = [
        Part("fast", ("json.tool", "--compact", str(tmp_path / "m.json")), gpus=0, timeout_s=60),
        Part("slow", SLEEP, gpus=0, timeout_s=2),
    ]
    report = run_campaign(plan, tmp_path / "out", tmp_path)
    check_report_format(report)
    fast, slow = report["parts"]["fast"], report["parts"]["slow"]
    assert fast["status"] == "passed" and fast["results"] == [{"mfu": 0.4}]
    assert slow["status"] == "timeout" and slow["reason"] == "killed after its limit of 2 s"
    assert 2 <= slow["seconds"] < 30 and slow["returncode"] != 0
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report


def test_a_budget_cuts_each_part_to_what_is_left_and_skips_a_part_it_cannot_fit(
    tmp_path, monkeypatch
):
    """--budget-s: the first part's limit is cut to the budget less RESERVE_S, and the part
    after it, with under MIN_PART_S left, is not started; each part is copied out as it ends."""
    monkeypatch.setattr(gpu_campaign, "RESERVE_S", 1)
    monkeypatch.setattr(gpu_campaign, "MIN_PART_S", 2)
    copied = []
    budget = gpu_campaign.RESERVE_S + gpu_campaign.MIN_PART_S + 3
    plan = [Part("slow", SLEEP, gpus=0, timeout_s=60), Part("next", SLEEP, gpus=0)]
    report = run_campaign(
        plan,
        tmp_path / "out",
        tmp_path,
        deadline=time.monotonic() + budget,
        after_part=lambda: copied.append(sorted(p.name for p in (tmp_path / "out").iterdir())),
    )
    check_report_format(report)
    slow, later = report["parts"]["slow"], report["parts"]["next"]
    limit = gpu_campaign.MIN_PART_S + 3
    assert slow["status"] == "timeout" and limit - 2 <= slow["seconds"] < limit + 5
    assert re.fullmatch(
        r"killed after its limit of \d+ s \(cut to fit --budget-s\)", slow["reason"]
    )
    assert later["status"] == "skipped" and later["reason"].startswith("not reached: ")
    assert copied == [["report.json", "slow.log"], ["report.json", "slow.log"]]


def test_a_sigterm_kills_the_running_part_and_copies_what_was_measured(tmp_path):
    """`timeout` ending a device call: the campaign's SIGTERM kills the part's process tree,
    records it as stopped, runs no later part, and the report and logs reach --copy-to."""
    out, dest, pid_file = tmp_path / "out", tmp_path / "copy", tmp_path / "part.pid"
    sleep = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    script = (
        "import sys; from tools import gpu_campaign as g\n"
        "g.parts = lambda work: [g.Part('env', ('json.tool', '--help'), gpus=0),\n"
        f"    g.Part('train_step_bf16', ('timeit', '-n', '1', '-r', '1', {sleep!r}), gpus=0),\n"
        "    g.Part('train_step_16k', ('json.tool', '--help'), gpus=0)]\n"
        "sys.exit(g.main(['--out-dir', sys.argv[1], '--copy-to', sys.argv[2],\n"
        "                 '--only', 'env', 'train_step_bf16', 'train_step_16k']))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(out), str(dest)], cwd=REPO, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    part_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    with pytest.raises(ProcessLookupError):
        os.kill(part_pid, 0)  # the part's tree went with the campaign
    report = json.loads((dest / "report.json").read_text())
    check_report_format(report)
    stopped = report["parts"]["train_step_bf16"]
    assert stopped["status"] == "timeout" and stopped["stopped"] is True
    assert stopped["reason"].startswith("stopped with the campaign (SIGTERM) after ")
    assert list(report["parts"]) == ["env", "train_step_bf16"]
    assert sorted(p.name for p in dest.iterdir()) == [
        "env.log",
        "report.json",
        "train_step_bf16.log",
    ]
    assert "train_step_16k: not run" in stdout  # the verdict still printed


def test_a_failing_part_keeps_its_output_and_artifacts_are_read_as_json_lines(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "memory_timeline.jsonl").write_text('{"phase": "train", "gib": 1.5}\n')
    plan = [
        Part("bad", ("json.tool", str(tmp_path / "missing.json")), gpus=0, timeout_s=60,
             artifacts=("run/memory_timeline.jsonl", "run/absent.jsonl")),
    ]  # fmt: skip
    rec = run_campaign(plan, tmp_path / "out", tmp_path)["parts"]["bad"]
    assert rec["status"] == "failed" and rec["returncode"] != 0
    assert "missing.json" in rec["output_tail"] and "missing.json" in Path(rec["log"]).read_text()
    assert rec["artifacts"] == {"memory_timeline.jsonl": [{"phase": "train", "gib": 1.5}]}


def test_a_window_that_ends_mid_part_leaves_the_earlier_parts_results(tmp_path):
    """The campaign process itself is killed (SIGKILL, as when the device call ends) while
    its second part runs: the report holds the first part, and is valid JSON."""
    out = tmp_path / "out"
    script = (
        "import sys; from pathlib import Path; from tools.gpu_campaign import Part, run_campaign\n"
        "kill = 'import os, signal, time; os.kill(os.getppid(), signal.SIGKILL); time.sleep(60)'\n"
        "run_campaign([Part('first', ('json.tool', '--help'), gpus=0, timeout_s=60),\n"
        "              Part('window_ends', ('timeit', '-n', '1', '-r', '1', kill), gpus=0,\n"
        "                   timeout_s=60)], Path(sys.argv[1]), Path(sys.argv[2]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(out), str(tmp_path)], cwd=REPO, timeout=120
    )
    assert done.returncode == -9
    report = json.loads((out / "report.json").read_text())
    assert list(report["parts"]) == ["first"] and report["parts"]["first"]["status"] == "passed"
    assert (out / "window_ends.log").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_the_report_is_written_atomically_and_a_bad_one_is_refused(tmp_path):
    path = tmp_path / "report.json"
    gpu_campaign.write_report(path, {"date": "d", "env": None, "parts": {}})
    old = path.read_text()
    with pytest.raises(TypeError):  # fails half-way through serialising
        gpu_campaign.write_report(path, {"date": "d", "env": None, "parts": {"x": object()}})
    assert path.read_text() == old and sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    path.write_text('{"date": "d", "parts": [')
    with pytest.raises(ValueError, match="report.json: not valid JSON"):
        gpu_campaign.load_report(path)
    path.write_text('{"date": "d"}')
    with pytest.raises(ValueError, match="expected a campaign report, an object with a 'parts'"):
        gpu_campaign.load_report(path)


@no_cuda
def test_the_nccl_probe_says_it_needs_cuda(capsys):
    assert gpu_nccl_probe.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_two_nodes_runs_a_job_a_node_per_rank_and_refuses_a_missing_job():
    """Its exit code is the job's (what each rank sees: tests/test_launch_distributed.py)."""
    from tools import gpu_two_nodes

    job = ["-m", "tests.torchrun.misbehave", "--mode"]
    assert gpu_two_nodes.main(["--timeout-s", "120", *job, "whoami"]) == 0
    assert gpu_two_nodes.main(["--timeout-s", "120", *job, "fail-rank-1"]) == 1
    with pytest.raises(SystemExit):
        gpu_two_nodes.main(["--nodes", "2"])
