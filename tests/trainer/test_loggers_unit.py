"""trainer.logger backends, each read back from what it wrote: TensorBoard event files, a
W&B offline run file, MLflow's local store; metrics.jsonl and the console summary."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import yaml

from megatron_rl.trainer.loggers import mlflow_name
from megatron_rl.trainer.metrics import LoggerConfig, MetricsLogger

CONFIG = {"algorithm": {"estimator": "gae", "lambda_critic": 1.0}, "trainer": {"seed": 3}}
ROWS = [  # (step, metrics, stage): two value-pretraining steps, the evaluation before
    (1, {"critic/vf_loss": 0.5}, "value_pretrain"),  # training, two PPO steps
    (2, {"critic/vf_loss": 0.25}, "value_pretrain"),
    (0, {"eval/accuracy": 0.1, "eval/test/pass@4": 0.3}, "eval"),
    (
        1,
        {
            "rollout/reward/mean": -0.5,
            "rollout/accuracy": 0.2,
            "critic/vf_explained_var": float("nan"),
        },
        "train",
    ),
    (2, {"rollout/reward/mean": 0.5, "rollout/accuracy": 0.4, "eval/accuracy": 0.6}, "train"),
]
EXPECTED = {  # name on the backends -> [(x, value)]: PPO step s at x = 2 + s
    "value_pretrain/critic/vf_loss": [(1, 0.5), (2, 0.25)],
    "eval/accuracy": [(2, 0.1), (4, 0.6)],
    "eval/test/pass@4": [(2, 0.3)],
    "rollout/reward/mean": [(3, -0.5), (4, 0.5)],
    "rollout/accuracy": [(3, 0.2), (4, 0.4)],
}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    out = tmp_path_factory.mktemp("logs") / "run"
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")  # no network: W&B writes its run file only
    mp.setenv("WANDB_SILENT", "true")
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    settings = LoggerConfig(
        loggers=("console", "jsonl", "tensorboard", "wandb", "mlflow"),
        project="tiny-vapo",
        run_name="seed3",
        config=CONFIG,
        step_offset=2,
    )
    logger = MetricsLogger(output_dir=out, total_steps=2, enabled=True, settings=settings)
    for step, metrics, stage in ROWS:
        logger.log(step, metrics, stage)
    logger.close()
    mp.undo()
    return out


def test_metrics_jsonl_holds_every_row_with_nan_as_null(logged):
    rows = [json.loads(line) for line in (logged / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["stage"]) for r in rows] == [(s, st) for s, _, st in ROWS]
    assert rows[3]["critic/vf_explained_var"] is None


def test_tensorboard_events_hold_every_finite_metric_and_the_config(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logged / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    for name, points in EXPECTED.items():
        got = [(e.step, pytest.approx(e.value)) for e in events.Scalars(name)]
        assert got == points, name
    assert "critic/vf_explained_var" not in events.Tags()["scalars"]  # NaN is not drawn
    (text,) = events.Tensors("config/text_summary")
    assert yaml.safe_load(text.tensor_proto.string_val[0].decode().strip("`\n")) == CONFIG


def wandb_records(path: Path):
    """The protobuf records of a W&B run file (LevelDB log blocks of 32 KiB after a 7-byte
    ':W&B' header); W&B ships no reader of its own any more."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record
            parts = b""


def test_wandb_offline_run_holds_the_history_and_the_config(logged):
    (run_file,) = logged.glob("wandb/offline-run-*/run-*.wandb")
    records = list(wandb_records(run_file))
    history: dict[str, list] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, []).append((items["_step"], pytest.approx(value)))
    assert history == EXPECTED
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "seed3" and run.project == "tiny-vapo"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert {k: v["value"] if isinstance(v, dict) and "value" in v else v
            for k, v in config.items() if not k.startswith("_")} == CONFIG  # fmt: skip


def test_mlflow_local_store_holds_metrics_params_and_the_config(logged, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(logged / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tiny-vapo").experiment_id])
    assert run.info.run_name == "seed3"
    for name, points in EXPECTED.items():
        history = client.get_metric_history(run.info.run_id, mlflow_name(name))
        assert [(m.step, pytest.approx(m.value)) for m in history] == points, name
    assert mlflow_name("eval/test/pass@4") == "eval/test/pass_at_4"
    assert run.data.params["algorithm.estimator"] == "gae"
    saved = client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))
    assert yaml.safe_load(Path(saved).read_text()) == CONFIG


def test_console_prints_a_summary_table_at_the_end(tmp_path, capsys):
    logger = MetricsLogger(output_dir=tmp_path, total_steps=2, enabled=True)
    for step, metrics, stage in ROWS:
        logger.log(step, metrics, stage)
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[-5].split() == ["metric", "first", "last", "min", "max"]
    assert lines[-4].split() == ["rollout/reward/mean", "-0.5", "0.5", "-0.5", "0.5"]
    assert lines[-2].split() == ["eval/accuracy", "0.1", "0.6", "0.1", "0.6"]
    assert lines[-1].startswith(f"logs: {tmp_path / 'metrics.jsonl'}")


def test_a_logger_whose_package_is_missing_is_named(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(RuntimeError, match=r"trainer.logger 'wandb': wandb is not installed"):
        MetricsLogger(
            output_dir=tmp_path,
            total_steps=2,
            enabled=True,
            settings=LoggerConfig(loggers=("console", "wandb")),
        )
