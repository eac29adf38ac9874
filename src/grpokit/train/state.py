"""Everything besides the weights that an exact resume needs: RNG streams, optimizer,
scheduler, data-sampler position. Stored with torch.save in a form `weights_only=True`
loads, so opening a checkpoint never runs code from it."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch


def capture_rng() -> dict:
    """The global python, numpy and torch (CPU and CUDA) random streams."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    random.setstate(as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def as_tuple(value):
    """random.setstate needs tuples all the way down; serialisers may hand back lists."""
    return tuple(as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def save_state(state: dict, path: str | Path) -> None:
    torch.save(state, path)


def load_state(path: str | Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)
