"""A watched run's numbers in an experiment tracker: TensorBoard event files.

The scalars are the series `hookcli report run.jsonl` shows (commands.watch.runseries): the
loss, and per layer call its first output's std, mean and zero fraction, NaN+Inf over its
outputs and its first output gradient's norm, and per parameter its gradient's norm and its
update ratio. They come from one place for both doors, so a log exported afterwards
(`hookcli report run.jsonl -f tensorboard -o DIR`) and a sink written while training
(`hookcli.watch(..., tensorboard=DIR)`) hold the same scalars at the same steps. A value that
is absent or not finite at a step is left out (the log's JSON has null there). Logs carry no
element values, so there are no histograms.

TensorBoard's own writer (`tensorboard.summary.writer`), with no torch and no TensorFlow: an
optional extra, `pip install 'hookcli[tensorboard]'`.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

from hookcli.commands.watch.runseries import RunSeries, Track, layer_metrics, param_metrics
from hookcli.errors import UsageError
from hookcli.records import StepLine

Scalar = tuple[str, int, float]  # tag, step, value


def _slug(metric: str) -> str:
    return metric.replace("/", "_").replace(" ", "_")


def tag(kind: str, name: str, call: int | None, metric: str) -> str:
    """`loss`, `layers/NAME:CALL/METRIC` or `params/NAME/METRIC` (TensorBoard groups by the
    first part)."""
    if kind == "loss":
        return "loss"
    if kind == "layer":
        return f"layers/{name}:{call}/{_slug(metric)}"
    return f"params/{name}/{_slug(metric)}"


def step_scalars(line: StepLine) -> list[Scalar]:
    """One watched step's scalars, as the sink writes them."""
    out: list[Scalar] = []
    if line.loss is not None:
        out.append(("loss", line.step, float(line.loss)))
    for c in line.layers:
        for metric, (value, _) in layer_metrics(c).items():
            if value is not None:
                out.append((tag("layer", c.name, c.call, metric), line.step, float(value)))
    for p in line.params:
        for metric, (value, _) in param_metrics(p).items():
            if value is not None:
                out.append((tag("param", p.name, None, metric), line.step, float(value)))
    return out


def run_scalars(run: RunSeries) -> list[Scalar]:
    """A run log's scalars, step by step, as the export writes them."""
    tracks: list[Track] = [run.loss, *run.layers, *run.params]
    by_step: dict[int, list[Scalar]] = {}
    for t in tracks:
        for s in t.series:
            for i, value in enumerate(s.values):
                if value is not None:
                    step = run.steps[i]
                    by_step.setdefault(step, []).append(
                        (tag(t.kind, t.name, t.call, s.metric), step, float(value))
                    )
    return [x for step in sorted(by_step) for x in by_step[step]]


def _tensorboard() -> tuple[Any, Any, Any]:
    try:
        event_pb2 = importlib.import_module("tensorboard.compat.proto.event_pb2")
        summary_pb2 = importlib.import_module("tensorboard.compat.proto.summary_pb2")
        writer = importlib.import_module("tensorboard.summary.writer.event_file_writer")
    except ImportError as exc:
        raise UsageError(
            "TensorBoard is not installed.", "pip install 'hookcli[tensorboard]'."
        ) from exc
    return event_pb2, summary_pb2, writer


def check_log_dir(path: Path) -> Path:
    """A TensorBoard log folder: made when missing; a file there is refused (exit 2). Event
    files are new files in it: nothing already there is replaced."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file; TensorBoard writes a folder.", "give a folder.")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make {path}: {exc.strerror}.", "choose another folder.") from exc
    return path


class TensorBoardWriter:
    """Scalars into a new event file in `log_dir`."""

    def __init__(self, log_dir: Path | str) -> None:
        self._event, self._summary, writer = _tensorboard()
        self.log_dir = check_log_dir(Path(log_dir))
        self._writer = writer.EventFileWriter(str(self.log_dir))

    def add(self, scalars: list[Scalar], wall_time: float | None = None) -> None:
        now = time.time() if wall_time is None else wall_time
        by_step: dict[int, list[Any]] = {}
        for name, step, value in scalars:
            by_step.setdefault(step, []).append(
                self._summary.Summary.Value(tag=name, simple_value=value)
            )
        for step, values in by_step.items():
            summary = self._summary.Summary(value=values)
            self._writer.add_event(self._event.Event(wall_time=now, step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def write_tensorboard(run: RunSeries, log_dir: Path) -> int:
    """A run log's scalars as one new event file in `log_dir`; how many were written."""
    scalars = run_scalars(run)
    w = TensorBoardWriter(log_dir)
    try:
        w.add(scalars)
    finally:
        w.close()
    return len(scalars)


# ---------------------------------------------------------------- MLflow and W&B: a run log

EXPERIMENT = "hookcli"  # the MLflow experiment and the W&B project a run log goes to
_MLFLOW_BATCH = 1000  # MLflow takes at most this many metrics in one log_batch


def installed(tracker: str) -> bool:
    """Whether the tracker's library is here (checked before any work)."""
    import importlib.util

    module = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}[tracker]
    return importlib.util.find_spec(module) is not None


def _mlflow_key(name: str) -> str:
    """A metric key MLflow accepts: letters, digits, `_ - . : /` and spaces; others `_`."""
    return "".join(c if c.isalnum() or c in "_-.:/ " else "_" for c in name)


def write_mlflow(run: RunSeries, target: str, run_name: str) -> tuple[str, str, int]:
    """A run log's scalars as one new MLflow run of the `hookcli` experiment: `target` is a
    folder (MLflow's file store, which MLflow 3 keeps in maintenance mode and lets through
    with MLFLOW_ALLOW_FILE_STORE, set for this call) or a tracking URI (`sqlite:///m.db`,
    `http://…`). The tracking URI, the run's id and how many metrics were written."""
    import os

    try:
        tracking = importlib.import_module("mlflow.tracking")
        entities = importlib.import_module("mlflow.entities")
    except ImportError as exc:
        raise UsageError("MLflow is not installed.", "pip install 'hookcli[mlflow]'.") from exc
    uri = target if "://" in target or target.startswith("sqlite:") else None
    if uri is None:
        uri = check_log_dir(Path(target)).resolve().as_uri()
    saved = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    if uri.startswith("file:"):
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        client = tracking.MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(EXPERIMENT)
        experiment = found.experiment_id if found else client.create_experiment(EXPERIMENT)
        made = client.create_run(experiment, run_name=run_name, tags={"hookcli.log": run_name})
        run_id = made.info.run_id
        now = int(time.time() * 1000)
        metrics = [
            entities.Metric(_mlflow_key(name), value, now, step)
            for name, step, value in run_scalars(run)
        ]
        for start in range(0, len(metrics), _MLFLOW_BATCH):
            client.log_batch(run_id, metrics=metrics[start : start + _MLFLOW_BATCH])
        client.set_terminated(run_id)
    finally:
        if uri.startswith("file:"):
            if saved is None:
                os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
            else:
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = saved
    return uri, run_id, len(metrics)


def write_wandb(run: RunSeries, folder: Path, run_name: str) -> tuple[str, int]:
    """A run log's scalars as one offline W&B run in `folder` (project `hookcli`; nothing is
    sent: `wandb sync` uploads it). The run's folder and how many values were written."""
    try:
        wandb = importlib.import_module("wandb")
    except ImportError as exc:
        raise UsageError("W&B is not installed.", "pip install 'hookcli[wandb]'.") from exc
    check_log_dir(folder)
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
    made = wandb.init(
        mode="offline", dir=str(folder), project=EXPERIMENT, name=run_name, settings=settings
    )
    count = 0
    try:
        by_step: dict[int, dict[str, float]] = {}
        for name, step, value in run_scalars(run):
            by_step.setdefault(step, {})[name] = value
            count += 1
        for step in sorted(by_step):
            made.log(by_step[step], step=step)
    finally:
        made.finish()
    return str(made.dir).removesuffix("/files"), count
