"""Unit tier: the GPU campaign's plan, its refusals and its per-part records (no GPU here:
the parts themselves run where one is lent)."""

from __future__ import annotations

import pytest
import torch

from tools import gpu_campaign
from tools.gpu_campaign import Part, run_part


def test_list_names_every_part_with_its_command(capsys):
    assert gpu_campaign.main(["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [
        "gpu_tests", "train_step_bf16", "train_step_fp8", "weight_sync", "logprob_gap_bf16",
        "sleep_wake",
    ]  # fmt: skip
    assert "python -m tools.bench train_step --dtype bf16" in lines[1]


def test_an_unknown_part_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        gpu_campaign.main(["--only", "mfu"])
    assert "unknown part(s) ['mfu']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_refuses_and_writes_no_report(tmp_path, capsys):
    assert gpu_campaign.main(["--out", str(tmp_path / "r.json")]) == 2
    assert "no CUDA device" in capsys.readouterr().err and not (tmp_path / "r.json").exists()


def test_a_part_whose_package_is_missing_is_skipped_with_the_reason(tmp_path):
    part = Part("x", ("json.tool", "--help"), needs=("no_such_module_xyz",))
    assert run_part(part, tmp_path) == {
        "status": "skipped",
        "reason": "needs no_such_module_xyz (not installed)",
    }


def test_a_part_records_its_json_lines_status_and_artifacts(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"phase": "train", "peak_gib": 1.5}\n')
    (tmp_path / "m.json").write_text('{"mfu": 0.4}')
    part = Part("x", ("json.tool", "--compact", str(tmp_path / "m.json")), artifacts=("a.jsonl",))
    ok = run_part(part, tmp_path)
    assert ok["status"] == "passed" and ok["results"] == [{"mfu": 0.4}]
    assert ok["a.jsonl"] == [{"phase": "train", "peak_gib": 1.5}]
    failed = run_part(Part("y", ("json.tool", str(tmp_path / "missing.json"))), tmp_path)
    assert failed["status"] == "failed" and "missing.json" in failed["output_tail"]
