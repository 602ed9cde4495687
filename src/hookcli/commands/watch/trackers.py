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

import contextlib
import importlib
import os
import socket
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
        records = importlib.import_module("tensorboard.summary.writer.record_writer")
    except ImportError as exc:
        raise UsageError(
            "TensorBoard is not installed.", "pip install 'hookcli[tensorboard]'."
        ) from exc
    return event_pb2, summary_pb2, records


def check_log_dir(raw: Path | str, what: str, *, fresh: str | None = None) -> Path:
    """A tracker's folder, checked before anything is written: not `-` (stdout) or empty, not
    a file, writable (made when missing). `fresh`: a glob of files that must not be there
    already (a second run's event files would show every point twice)."""
    from hookcli.io.output import user_path

    text = str(raw)
    if text in ("", "-"):
        raise UsageError(
            f"{what} writes a folder, not {text or 'an empty name'}.", "give a folder."
        )
    path = user_path(text, "-o")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file; {what} writes a folder.", "give a folder.")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".hookcli-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UsageError(
            f"cannot write {path}: {exc.strerror or exc}.", "choose another folder."
        ) from exc
    if fresh is not None and any(path.glob(fresh)):
        raise UsageError(
            f"{path} already holds {what} files: a second run there shows every point twice.",
            "give a new folder (runs/NAME2).",
        )
    return path


_EVENTS = "events.out.tfevents.*"


class TensorBoardWriter:
    """Scalars into a new event file in `log_dir`, written in the caller's thread (TensorBoard's
    own EventFileWriter writes from a thread of its own, whose failures the caller never
    sees): a record per step, TensorBoard's record format (record_writer)."""

    def __init__(self, log_dir: Path | str) -> None:
        self._event, self._summary, self._record_writer = _tensorboard()
        self.log_dir = check_log_dir(log_dir, "TensorBoard", fresh=_EVENTS)
        self._file: Any = None  # opened by the first scalars: a run with none leaves no file
        self._records: Any = None

    def _put(self, event: Any) -> None:
        if self._file is None:
            name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
            self._file = open(self.log_dir / name, "wb")  # noqa: SIM115 (closed in close())
            self._records = self._record_writer.RecordWriter(self._file)
            header = self._event.Event(wall_time=time.time(), file_version="brain.Event:2")
            self._records.write(header.SerializeToString())
        self._records.write(event.SerializeToString())

    def add(self, scalars: list[Scalar], wall_time: float | None = None) -> None:
        now = time.time() if wall_time is None else wall_time
        by_step: dict[int, list[Any]] = {}
        for name, step, value in scalars:
            by_step.setdefault(step, []).append(
                self._summary.Summary.Value(tag=name, simple_value=value)
            )
        for step, values in by_step.items():
            summary = self._summary.Summary(value=values)
            self._put(self._event.Event(wall_time=now, step=step, summary=summary))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def write_tensorboard(run: RunSeries, log_dir: Path) -> int:
    """A run log's scalars as one new event file in `log_dir`; how many were written."""
    scalars = run_scalars(run)
    w = TensorBoardWriter(log_dir)
    try:
        try:
            w.add(scalars)
        finally:
            w.close()
    except OSError as exc:
        raise UsageError(f"cannot write {w.log_dir}: {exc.strerror}.", "free space.") from exc
    return len(scalars)


# ---------------------------------------------------------------- MLflow and W&B: a run log

EXPERIMENT = "hookcli"  # the MLflow experiment and the W&B project a run log goes to
_MLFLOW_BATCH = 1000  # MLflow takes at most this many metrics in one log_batch


def installed(tracker: str) -> bool:
    """Whether the tracker's library is here (checked before any work)."""
    import importlib.util

    module = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}[tracker]
    return importlib.util.find_spec(module) is not None


def _mlflow_keys(tags: list[str]) -> dict[str, str]:
    """Each tag's MLflow key: letters, digits, `_ - . : /` and spaces kept, others `_`; two
    tags that would meet in one key (layers `a+b` and `a_b`) each get their tag's CRC too."""
    import zlib

    plain = {t: "".join(c if c.isalnum() or c in "_-.:/ " else "_" for c in t) for t in tags}
    seen: dict[str, int] = {}
    for key in plain.values():
        seen[key] = seen.get(key, 0) + 1
    return {
        t: key if seen[key] == 1 else f"{key}_{zlib.crc32(t.encode()):08x}"
        for t, key in plain.items()
    }


def _mlflow_store(folder: Path) -> None:
    """MLflow's file store reads every folder in it as an experiment: a folder holding other
    things is refused (an empty one, or one MLflow made, is fine)."""
    for entry in folder.iterdir():
        if entry.name.startswith(".") or (entry / "meta.yaml").exists():
            continue
        if entry.name == "models" and entry.is_dir():  # MLflow's own model registry
            continue
        raise UsageError(
            f"{folder} holds {entry.name}, which is not an MLflow experiment.",
            "give MLflow a folder of its own (e.g. -o mlruns).",
        )


def write_mlflow(run: RunSeries, target: Path, run_name: str) -> tuple[str, str, int]:
    """A run log's scalars as one new MLflow run of the `hookcli` experiment in the folder
    `target`, MLflow's file store (MLflow 3 keeps it in maintenance mode and lets it through
    with MLFLOW_ALLOW_FILE_STORE, set for this call only). The store's URI, the run's id and
    how many metrics were written."""
    try:
        tracking = importlib.import_module("mlflow.tracking")
        entities = importlib.import_module("mlflow.entities")
        errors = importlib.import_module("mlflow.exceptions")
    except ImportError as exc:
        raise UsageError("MLflow is not installed.", "pip install 'hookcli[mlflow]'.") from exc
    folder = check_log_dir(target, "MLflow")
    _mlflow_store(folder)
    uri = folder.resolve().as_uri()
    scalars = run_scalars(run)
    keys = _mlflow_keys(list(dict.fromkeys(name for name, _, _ in scalars)))
    saved = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    run_id = None
    try:
        client = tracking.MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(EXPERIMENT)
        experiment = found.experiment_id if found else client.create_experiment(EXPERIMENT)
        made = client.create_run(experiment, run_name=run_name, tags={"hookcli.log": run_name})
        run_id = made.info.run_id
        now = int(time.time() * 1000)
        metrics = [entities.Metric(keys[name], value, now, step) for name, step, value in scalars]
        for start in range(0, len(metrics), _MLFLOW_BATCH):
            client.log_batch(run_id, metrics=metrics[start : start + _MLFLOW_BATCH])
        client.set_terminated(run_id)
    except (OSError, errors.MlflowException) as exc:
        if run_id is not None:
            with contextlib.suppress(Exception):
                client.set_terminated(run_id, status="FAILED")
        message = str(getattr(exc, "message", "") or exc).splitlines()[0]
        raise UsageError(
            f"MLflow could not write {folder}: {message}", "check the folder."
        ) from exc
    finally:
        if saved is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = saved
    return uri, run_id, len(metrics)


def write_wandb(run: RunSeries, target: Path, run_name: str) -> tuple[str, int]:
    """A run log's scalars as one offline W&B run in the folder `target` (project `hookcli`;
    nothing is sent: `wandb sync` uploads it). The run's folder and how many values were
    written."""
    try:
        wandb = importlib.import_module("wandb")
    except ImportError as exc:
        raise UsageError("W&B is not installed.", "pip install 'hookcli[wandb]'.") from exc
    folder = check_log_dir(target, "W&B")
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True)
    count = 0
    try:
        made = wandb.init(
            mode="offline", dir=str(folder), project=EXPERIMENT, name=run_name, settings=settings
        )
        try:
            by_step: dict[int, dict[str, float]] = {}
            for name, step, value in run_scalars(run):
                by_step.setdefault(step, {})[name] = value
                count += 1
            for step in sorted(by_step):
                made.log(by_step[step], step=step)
        finally:
            made.finish()
    except (OSError, wandb.Error) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"W&B could not write {folder}: {message}", "check the folder.") from exc
    return str(made.dir).removesuffix("/files"), count
