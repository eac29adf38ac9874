"""Experiment trackers behind one interface: TensorBoard, Weights & Biases, MLflow, Trackio.

A trainer writes each step's record once, to a `MetricsLogger`; `make_loggers` builds the
ones named in `report_to` (a `NullLogger` for none). Each tracker's package is an optional
extra, imported only when that tracker is named:

    pip install 'grpokit[tensorboard]'   # or [wandb], [mlflow], [trackio], [trackers] for all

Only numbers reach a tracker: strings, None and other values are skipped, nested dicts are
flattened with "/", and NaN or infinite values are left out (a tracker's plot would break on
them; the run's metrics.jsonl keeps the full record).
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# tracker name -> (module to import, pip extra that installs it)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"),
}
NO_TRACKER = "none"
DEFAULT_PROJECT = "grpokit"


class TrackerError(ValueError):
    """A report_to entry that grpokit cannot honour: an unknown name, or a package not installed."""


def _normalise_report_to(report_to: str | Iterable[str] | None) -> list[str]:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if NO_TRACKER in names:
        if len(names) > 1:
            raise TrackerError(f"report_to={names!r} mixes 'none' with trackers; use ['none'] or list the trackers")
        return []
    return list(dict.fromkeys(names))  # keep the order, drop repeats


def check_trackers(report_to: str | Iterable[str] | None) -> None:
    """Raise TrackerError naming the fix if a tracker in report_to is unknown or not installed.

    Finds packages with importlib.util.find_spec, so nothing heavy is imported.
    """
    for name in _normalise_report_to(report_to):
        if name not in TRACKERS:
            raise TrackerError(
                f"report_to names {name!r}, which is not a tracker grpokit knows; "
                f"choose from {', '.join(TRACKERS)} (or 'none')"
            )
        module, extra = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise TrackerError(
                f"report_to names {name!r} but {module} is not installed: pip install 'grpokit[{extra}]'"
            )


def numeric_metrics(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of record as floats; nested mappings flattened with '/'.

    bools count as 0/1; one-element tensors and numpy scalars are read with .item().
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(numeric_metrics(value, prefix=f"{name}/"))
            continue
        if getattr(value, "shape", None) == () and hasattr(value, "item"):  # 0-d tensor / numpy
            value = value.item()
        if not isinstance(value, numbers.Real):  # ints, floats, bools, numpy scalars
            continue
        try:
            number = float(value)
        except OverflowError:  # an int beyond float range
            continue
        if math.isfinite(number):
            out[name] = number
    return out


def _flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flatten_config(value, prefix=f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


class MetricsLogger:
    """Where a trainer's per-step records go. A tracker implements _log_metrics (the record's
    finite numbers, when it has any) and _finish (flush and release, called once)."""

    _closed = False

    def log(self, record: Mapping[str, Any], step: int) -> None:
        metrics = numeric_metrics(record)
        if metrics:
            self._log_metrics(metrics, step)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release; safe to call twice."""
        if not self._closed:
            self._closed = True
            self._finish()

    def _finish(self) -> None:
        pass

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullLogger(MetricsLogger):
    """Logs nothing: the logger when report_to is empty, so callers never branch on trackers."""

    def log(self, record: Mapping[str, Any], step: int) -> None:
        pass


class TensorBoardLogger(MetricsLogger):
    """Scalars to TensorBoard event files under log_dir (`tensorboard --logdir <log_dir>`)."""

    def __init__(self, log_dir: str | os.PathLike, config: Mapping[str, Any] | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        if config:
            # Markdown code block, so the TEXT tab shows the config as written.
            text = json.dumps(dict(config), indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", "    " + text.replace("\n", "\n    "), global_step=0)

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def _finish(self) -> None:
        self._writer.close()


class WandbLogger(MetricsLogger):
    """A Weights & Biases run. WANDB_MODE=offline logs without an account or network, into
    <run_dir>/wandb/offline-run-*; `wandb sync` uploads it later. WANDB_PROJECT overrides project."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        project: str | None = None,
    ) -> None:
        import wandb

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=run_name,
            dir=str(run_dir),
            config=dict(config or {}),
            mode=os.environ.get("WANDB_MODE") or None,
            reinit="create_new",  # its own run object, even when another run is active
        )

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def _finish(self) -> None:
        self._run.finish()


class MLflowLogger(MetricsLogger):
    """An MLflow run, through MlflowClient (no global active-run state).

    tracking_uri: a server, `sqlite:///path.db`, or `file:/path` (MLflow 3 keeps file stores
    in maintenance mode: they need MLFLOW_ALLOW_FILE_STORE=true). Default: MLFLOW_TRACKING_URI,
    else sqlite:///<run_dir>/mlflow.db with artifacts in <run_dir>/mlartifacts
    (`mlflow ui --backend-store-uri sqlite:///<run_dir>/mlflow.db`).
    The config is logged as flattened params and as the artifact config.json.
    """

    _PARAM_VALUE_CHARS = 500  # MLflow's limit for a param value in older servers
    _PARAMS_PER_BATCH = 100  # MLflow's limit for params in one log_batch call

    def __init__(
        self,
        run_dir: str | os.PathLike,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        run_dir = Path(run_dir).resolve()
        artifact_location = None
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            run_dir.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{run_dir / 'mlflow.db'}"
            artifact_location = (run_dir / "mlartifacts").as_uri()
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(name, artifact_location=artifact_location)
        )
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        if config:
            params = [
                Param(key, str(value)[: self._PARAM_VALUE_CHARS]) for key, value in _flatten_config(config).items()
            ]
            for i in range(0, len(params), self._PARAMS_PER_BATCH):
                self._client.log_batch(self.run_id, params=params[i : i + self._PARAMS_PER_BATCH])
            self._client.log_dict(self.run_id, json.loads(json.dumps(dict(config), default=str)), "config.json")

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(name, value, now_ms, step)
                                                     for name, value in metrics.items()])

    def _finish(self) -> None:
        self._client.set_terminated(self.run_id)


class TrackioLogger(MetricsLogger):
    """A Trackio run (local by default, under TRACKIO_DIR or ~/.cache/huggingface/trackio;
    `trackio show --project <project>` opens the dashboard)."""

    def __init__(
        self,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        project: str | None = None,
    ) -> None:
        import trackio

        self._trackio = trackio
        self.project = project or DEFAULT_PROJECT
        trackio.init(project=self.project, name=run_name, config=dict(config or {}))

    def _log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._trackio.log(metrics, step=step)

    def _finish(self) -> None:
        self._trackio.finish()


class CompositeLogger(MetricsLogger):
    """Fans each record out to several loggers; close() closes them all, even if one fails."""

    def __init__(self, loggers: Iterable[MetricsLogger]) -> None:
        self.loggers = list(loggers)

    def log(self, record: Mapping[str, Any], step: int) -> None:
        for logger in self.loggers:
            logger.log(record, step)

    def close(self) -> None:
        errors = []
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as exc:  # noqa: BLE001 - the others must still be closed
                errors.append(exc)
        if errors:
            raise errors[0]


def make_loggers(
    report_to: str | Iterable[str] | None,
    run_dir: str | os.PathLike,
    run_name: str | None = None,
    config_dict: Mapping[str, Any] | None = None,
) -> MetricsLogger:
    """The loggers report_to names ("tensorboard", "wandb", "mlflow", "trackio"; [] or "none":
    a NullLogger), one CompositeLogger when several. Checks every name before starting any."""
    check_trackers(report_to)
    run_dir = Path(run_dir)
    builders = {
        "tensorboard": lambda: TensorBoardLogger(run_dir / "tensorboard", config=config_dict),
        "wandb": lambda: WandbLogger(run_dir, run_name=run_name, config=config_dict),
        "mlflow": lambda: MLflowLogger(run_dir, run_name=run_name, config=config_dict),
        "trackio": lambda: TrackioLogger(run_name=run_name, config=config_dict),
    }
    loggers: list[MetricsLogger] = []
    try:
        for name in _normalise_report_to(report_to):
            loggers.append(builders[name]())
    except BaseException:
        CompositeLogger(loggers).close()  # don't leave runs of the trackers already started open
        raise
    if not loggers:
        return NullLogger()
    return loggers[0] if len(loggers) == 1 else CompositeLogger(loggers)
