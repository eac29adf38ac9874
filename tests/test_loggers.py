"""Experiment trackers: every logger writes real files that its tracker's own reader reads back.

Each tracker test skips when its package is not installed (pip install 'grpokit[trackers]').
No network: W&B runs offline, MLflow and Trackio use local stores.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import grpokit
from grpokit.run.loggers import (
    TRACKERS,
    CompositeLogger,
    MetricsLogger,
    MLflowLogger,
    NullLogger,
    TensorBoardLogger,
    TrackerError,
    WandbLogger,
    check_trackers,
    make_loggers,
    numeric_metrics,
)

SRC = str(Path(grpokit.__file__).resolve().parents[1])
CONFIG = {"learning_rate": 1e-6, "num_generations": 8, "loss": {"aggregation": "token", "beta": 0.04}}
# Three steps; strings, None and NaN must be skipped, tensors read as numbers.
RECORDS = [
    {"loss": 0.5, "reward/mean": 0.25, "kl": torch.tensor(0.01), "note": "warmup", "eval": None},
    {"loss": 0.25, "reward/mean": 0.5, "kl": torch.tensor(0.02), "grad_norm": float("nan")},
    {"loss": 0.125, "reward/mean": 0.75, "kl": torch.tensor(0.04), "grad_norm": 1.5},
]
STEPS = [1, 2, 3]


def requires(module):
    return pytest.mark.skipif(
        importlib.util.find_spec(module) is None,
        reason=f"{module} is not installed (pip install 'grpokit[{TRACKERS[module][1]}]')",
    )


def log_records(logger: MetricsLogger) -> None:
    with logger:
        for record, step in zip(RECORDS, STEPS):
            logger.log(record, step)


def expected_series() -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record, step in zip(RECORDS, STEPS):
        for key, value in numeric_metrics(record).items():
            series.setdefault(key, []).append((step, value))
    return series


# ---------------------------------------------------------------------------
# Pure parts: the numeric filter, check_trackers, the factory's null case
# ---------------------------------------------------------------------------


def test_numeric_metrics_keeps_finite_numbers_only():
    record = {
        "a": 1, "b": 2.5, "flag": True, "s": "text", "none": None, "nan": float("nan"), "inf": float("inf"),
        "t": torch.tensor(3.0), "t_nan": torch.tensor(float("nan")), "vec": torch.ones(2),
        "np": np.float32(0.5), "np_int": np.int64(7), "huge": 10**400, "nested": {"c": 4, "d": "x", "deeper": {"e": -1.0}},
    }
    assert numeric_metrics(record) == {
        "a": 1.0, "b": 2.5, "flag": 1.0, "t": 3.0, "np": 0.5, "np_int": 7.0, "nested/c": 4.0, "nested/deeper/e": -1.0,
    }
    assert expected_series()["grad_norm"] == [(3, 1.5)]  # the NaN of step 2 is left out


def test_check_trackers_accepts_none_and_empty():
    check_trackers([])
    check_trackers(None)
    check_trackers("none")
    check_trackers(["none"])
    assert isinstance(make_loggers([], "unused"), NullLogger)
    assert isinstance(make_loggers("none", "unused"), NullLogger)


def test_check_trackers_unknown_name():
    with pytest.raises(TrackerError, match=r"report_to names 'neptune', which is not a tracker grpokit knows; "
                                           r"choose from tensorboard, wandb, mlflow, trackio \(or 'none'\)"):
        check_trackers(["tensorboard", "neptune"])
    with pytest.raises(ValueError, match=r"mixes 'none' with trackers"):
        check_trackers(["none", "wandb"])
    assert issubclass(TrackerError, ValueError)


@pytest.mark.parametrize("name", list(TRACKERS))
def test_check_trackers_names_the_extra_of_an_absent_package(monkeypatch, name):
    module, extra = TRACKERS[name]
    monkeypatch.setitem(sys.modules, module, None)  # the import system's marker for "not importable"
    with pytest.raises(TrackerError, match=rf"report_to names '{name}' but {module} is not installed: "
                                           rf"pip install 'grpokit\[{extra}\]'"):
        check_trackers([name])
    with pytest.raises(TrackerError, match=rf"'{name}'"):
        make_loggers([name], "unused")


def test_check_trackers_imports_no_tracker():
    # find_spec only: a run that names trackers pays for their imports when the loggers start.
    code = (
        "import sys\n"
        "from grpokit.run.loggers import TRACKERS, check_trackers\n"
        "import importlib.util\n"
        "names = [n for n, (m, _) in TRACKERS.items() if importlib.util.find_spec(m) is not None]\n"
        "check_trackers(names)\n"
        "heavy = [m for m in ('tensorboard', 'wandb', 'mlflow', 'trackio', 'torch.utils.tensorboard') if m in sys.modules]\n"
        "print(len(names), heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": SRC},
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().endswith("[]"), out.stdout


def test_composite_logger_fans_out_and_closes_all():
    class Recorder(MetricsLogger):
        def __init__(self, fail_on_close=False):
            self.seen, self.closed, self.fail_on_close = [], False, fail_on_close

        def log(self, record, step):
            self.seen.append((step, numeric_metrics(record)))

        def close(self):
            self.closed = True
            if self.fail_on_close:
                raise RuntimeError("tracker went away")

    a, b = Recorder(fail_on_close=True), Recorder()
    composite = CompositeLogger([a, b])
    composite.log({"loss": 1.0, "tag": "x"}, 7)
    assert a.seen == b.seen == [(7, {"loss": 1.0})]
    with pytest.raises(RuntimeError, match="tracker went away"):
        composite.close()
    assert a.closed and b.closed


# ---------------------------------------------------------------------------
# TensorBoard
# ---------------------------------------------------------------------------


def read_tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@requires("tensorboard")
def test_tensorboard_event_files_read_back(tmp_path):
    logger = make_loggers(["tensorboard"], tmp_path, run_name="tb", config_dict=CONFIG)
    assert isinstance(logger, TensorBoardLogger)
    log_records(logger)
    logger.close()  # a second close is harmless
    got = read_tensorboard(tmp_path / "tensorboard")
    expected = expected_series()
    assert set(got) == set(expected) == {"loss", "reward/mean", "kl", "grad_norm"}
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points]
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=1e-6)  # stored as float32


# ---------------------------------------------------------------------------
# Weights & Biases (offline)
# ---------------------------------------------------------------------------


def read_wandb_records(path: Path):
    """The records of a .wandb file: W&B's transaction log uses LevelDB's log format
    (a 7-byte file header, 32 KiB blocks, records split in FULL/FIRST/MIDDLE/LAST fragments
    behind a 7-byte checksum/length/type header), each record a wandb_internal Record."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        fragment = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 2):  # FULL, FIRST
            pending = fragment
        else:  # MIDDLE, LAST
            pending += fragment
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


@requires("wandb")
def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    run_dir = tmp_path / "run"
    logger = make_loggers(["wandb"], run_dir, run_name="wb-offline", config_dict=CONFIG)
    assert isinstance(logger, WandbLogger)
    log_records(logger)

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # finish() hands the run to W&B's service process, which writes the file out after it returns.
    deadline = time.monotonic() + 60
    while True:
        records = read_wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert runs and runs[0].display_name == "wb-offline" and runs[0].project == "grpokit"
    config = {u.key: json.loads(u.value_json) for u in runs[0].config.update}
    assert config["num_generations"] == 8 and config["loss"] == {"aggregation": "token", "beta": 0.04}
    got: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for key, value in items.items():
            if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                got.setdefault(key, []).append((r.history.step.num, value))
    assert got == {k: [(s, pytest.approx(v)) for s, v in pts] for k, pts in expected_series().items()}


# ---------------------------------------------------------------------------
# MLflow
# ---------------------------------------------------------------------------


def read_mlflow(tracking_uri: str, run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    series = {
        key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]
        for key in run.data.metrics
    }
    config_path = client.download_artifacts(run_id, "config.json")
    return run, series, json.loads(Path(config_path).read_text())


@requires("mlflow")
def test_mlflow_file_store_reads_back(tmp_path, monkeypatch):
    # MLflow 3 keeps file stores in maintenance mode behind this switch.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    logger = make_loggers(["mlflow"], tmp_path / "run", run_name="ml-file", config_dict=CONFIG)
    assert isinstance(logger, MLflowLogger) and logger.tracking_uri == uri
    log_records(logger)
    run, series, config = read_mlflow(uri, logger.run_id)
    assert run.info.run_name == "ml-file" and run.info.status == "FINISHED"
    assert run.data.params["num_generations"] == "8" and run.data.params["loss.aggregation"] == "token"
    assert config == CONFIG
    assert series == {k: [(s, pytest.approx(v)) for s, v in pts] for k, pts in expected_series().items()}


@requires("mlflow")
def test_mlflow_default_store_is_sqlite_in_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    run_dir = tmp_path / "run"
    logger = MLflowLogger(run_dir, run_name="ml-default", config=CONFIG)
    assert logger.tracking_uri == f"sqlite:///{run_dir.resolve() / 'mlflow.db'}"
    log_records(logger)
    run, series, config = read_mlflow(logger.tracking_uri, logger.run_id)
    assert (run_dir / "mlflow.db").is_file() and list((run_dir / "mlartifacts").rglob("config.json"))
    assert config == CONFIG and series["loss"] == [(1, 0.5), (2, 0.25), (3, 0.125)]


# ---------------------------------------------------------------------------
# Trackio
# ---------------------------------------------------------------------------


@requires("trackio")
def test_trackio_local_store_reads_back(tmp_path):
    # Trackio fixes its storage directory at import, so the run gets a process of its own.
    code = f"""
import json, torch
from grpokit.run.loggers import TrackioLogger, make_loggers
from trackio.sqlite_storage import SQLiteStorage
records = [
    {{"loss": 0.5, "kl": torch.tensor(0.01), "note": "warmup"}},
    {{"loss": 0.25, "kl": torch.tensor(0.02), "grad_norm": float("nan")}},
]
logger = make_loggers(["trackio"], {str(tmp_path)!r}, run_name="tk", config_dict={{"beta": 0.04}})
assert isinstance(logger, TrackioLogger)
with logger:
    for step, record in enumerate(records, start=1):
        logger.log(record, step)
logs = SQLiteStorage.get_logs("grpokit", "tk")
print("LOGS=" + json.dumps([{{k: v for k, v in row.items() if k != "timestamp"}} for row in logs]))
"""
    env = {**os.environ, "PYTHONPATH": SRC, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("LOGS=")]
    logs = json.loads(line[len("LOGS="):])
    assert logs == [
        {"loss": 0.5, "kl": pytest.approx(0.01), "step": 1},
        {"loss": 0.25, "kl": pytest.approx(0.02), "step": 2},
    ]
    assert (tmp_path / "trackio" / "grpokit.db").is_file()


# ---------------------------------------------------------------------------
# Several trackers at once
# ---------------------------------------------------------------------------


@requires("tensorboard")
@requires("mlflow")
def test_make_loggers_composite_writes_every_tracker(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    logger = make_loggers(["tensorboard", "mlflow", "tensorboard"], tmp_path, run_name="both", config_dict=CONFIG)
    assert isinstance(logger, CompositeLogger)
    assert [type(x) for x in logger.loggers] == [TensorBoardLogger, MLflowLogger]  # repeats dropped
    log_records(logger)
    assert read_tensorboard(tmp_path / "tensorboard")["loss"] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    _, series, _ = read_mlflow(uri, logger.loggers[1].run_id)
    assert series["loss"] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert not math.isnan(series["grad_norm"][0][1])
