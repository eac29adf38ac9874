"""Run-directory metrics: one JSON object per step in metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsWriter:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullWriter:
    """A metrics file on ranks other than 0: rank 0 writes the reduced row."""

    def __enter__(self) -> "NullWriter":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def write(self, record: dict) -> None:
        pass


def read_metrics(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep only rows with step <= last_step (rows past a resumed checkpoint are redone).
    Rewrites the file atomically; returns how many rows were dropped."""
    import os

    path = Path(path)
    if not path.is_file():
        return 0
    rows = read_metrics(path)
    kept = [r for r in rows if r.get("step", 0) <= last_step]
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(rows) - len(kept)
