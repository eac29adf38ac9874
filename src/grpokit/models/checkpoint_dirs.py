"""Where a checkpoint's pieces lie in a run directory: `step-N` directories, the `latest` pointer
and the fp32 master/ weights. Model loading reads them (a checkpoint is a model); grpokit.run.checkpoint,
above, writes them."""

from __future__ import annotations

import os
import re
from pathlib import Path

LATEST = "latest"
MASTER_DIR = "master"  # fp32 master weights of a mixed-precision run
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_number(name: str) -> int | None:
    """N of a `step-N` checkpoint directory's name; None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_dirs(directory: Path) -> list[Path]:
    """Completed step-N directories under `directory`, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def pointed(directory: Path) -> Path | None:
    """The checkpoint `latest` under `directory` names, unverified: a link, or the text pointer of older runs."""
    pointer = directory / LATEST
    if pointer.is_symlink():
        return directory / os.readlink(pointer)
    if pointer.is_file():
        return directory / pointer.read_text().strip()
    return None


def master_weights_dir(directory: str | Path) -> Path | None:
    """The fp32 master weights saved beside a checkpoint's compute-dtype weights, if any."""
    master = Path(directory) / MASTER_DIR
    return master if (master / "config.json").is_file() else None
