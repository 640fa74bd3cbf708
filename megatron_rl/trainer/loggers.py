"""Where step metrics go besides the console and metrics.jsonl (`trainer.logger`, verl's
names): TensorBoard, Weights & Biases, MLflow. Each backend takes the same rows:

    log(x, metrics, stage)   x: one increasing axis for the whole run (value-pretraining
                             steps first, then PPO steps), as W&B and MLflow need
    close()

Every run logs its resolved config once (TensorBoard: a text summary; W&B: the run config;
MLflow: params and config.yaml as an artifact). Offline use: W&B honours WANDB_MODE=offline
(files under output_dir/wandb, `wandb sync` uploads them later); MLflow writes to
$MLFLOW_TRACKING_URI or, unset, to the local store output_dir/mlruns.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import yaml


def tag(stage: str, key: str) -> str:
    """The name a metric is logged under: train metrics as they are (`rollout/reward/mean`,
    `eval/...`), another stage's under its name (`value_pretrain/critic/vf_loss`)."""
    return key if stage in ("train", "eval") else f"{stage}/{key}"


def finite_numbers(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


class TensorBoardBackend:
    def __init__(self, *, output_dir: Path, config: dict, run_name: str, project: str):
        # optional backends: imported only when trainer.logger names them
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(output_dir / "tensorboard"))
        text = yaml.safe_dump(config, sort_keys=False)
        self.writer.add_text("config", "```\n" + text + "```", 0)

    def log(self, x: int, metrics: dict, stage: str) -> None:
        for k, v in finite_numbers(metrics).items():
            self.writer.add_scalar(tag(stage, k), v, x)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, *, output_dir: Path, config: dict, run_name: str, project: str):
        # optional backends: imported only when trainer.logger names them
        import wandb

        self.run = wandb.init(
            project=project, name=run_name, config=config, dir=str(output_dir), reinit=True
        )

    def log(self, x: int, metrics: dict, stage: str) -> None:
        self.run.log({tag(stage, k): v for k, v in finite_numbers(metrics).items()}, step=x)

    def close(self) -> None:
        self.run.finish()


MLFLOW_NAME = re.compile(r"[^\w./ :-]")


def mlflow_name(key: str) -> str:
    """MLflow allows letters, digits, `_ - . / : ` and space in a metric name: `pass@4` is
    logged as `pass_at_4`."""
    return MLFLOW_NAME.sub(lambda m: "_at_" if m.group() == "@" else "_", key)


class MlflowBackend:
    def __init__(self, *, output_dir: Path, config: dict, run_name: str, project: str):
        # optional backends: imported only when trainer.logger names them
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store only on request (the database store needs
            # SQLAlchemy, which mlflow-skinny leaves out); it needs no server or network.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((output_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(project)
        self.mlflow = mlflow
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_dict(config, "config.yaml")
        flat = flatten(config)
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})  # MLflow's value limit

    def log(self, x: int, metrics: dict, stage: str) -> None:
        named = {mlflow_name(tag(stage, k)): v for k, v in finite_numbers(metrics).items()}
        self.mlflow.log_metrics(named, step=x)

    def close(self) -> None:
        self.mlflow.end_run()


def flatten(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


BACKENDS = {"tensorboard": TensorBoardBackend, "wandb": WandbBackend, "mlflow": MlflowBackend}


def make_backends(names, output_dir: Path, config: dict, run_name: str, project: str) -> list:
    """The backends of `trainer.logger` beyond console and jsonl. A backend whose package is
    missing is an error naming it (nothing is silently not logged)."""
    made = []
    for name in names:
        if name not in BACKENDS:  # console, jsonl: MetricsLogger's own
            continue
        try:
            made.append(
                BACKENDS[name](
                    output_dir=output_dir, config=config, run_name=run_name, project=project
                )
            )
        except ImportError as e:
            raise RuntimeError(
                f"trainer.logger {name!r}: {e.name or e} is not installed "
                "(pip install megatron_rl[logging], or drop it from trainer.logger)"
            ) from e
    return made
