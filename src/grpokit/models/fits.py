"""Whether a model a run will train fits its device, known before any model loads: a parameter
count from the config (a tiny model's shape, or a checkpoint's safetensors headers) against the
device's total memory. The count is a lower bound (activations come on top), so a refusal is sure."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

# A trained model's state: weights, gradients and Adam's two moments, each fp32 (or bf16 weights and
# gradients beside an fp32 master copy): 16 bytes a parameter either way (bench/memory.py).
TRAINED_BYTES_PER_PARAMETER = 16


def tiny_llama_parameters(hidden_size: int, num_layers: int, intermediate_size: int, vocab_size: int = 0) -> int:
    """Parameters of the built-in tiny Llama (tied embeddings): per block, attention's four
    hidden x hidden projections, the MLP's three hidden x intermediate ones and two norms; then the
    final norm and the embedding (vocab_size 0 when unknown, which leaves the count a lower bound)."""
    block = 4 * hidden_size * hidden_size + 3 * hidden_size * intermediate_size + 2 * hidden_size
    return num_layers * block + hidden_size + vocab_size * hidden_size


def checkpoint_parameters(path: str | Path) -> int | None:
    """Parameters of a local checkpoint, from its safetensors headers (no weights read); None for a
    hub id or a directory without safetensors."""
    directory = Path(path)
    files = sorted(directory.glob("*.safetensors")) if directory.is_dir() else []
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device, or of this machine for the CPU; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def training_does_not_fit(parameters: int, device: torch.device) -> str:
    """'' when training `parameters` can fit `device`, else why not, in words."""
    memory = device_memory_bytes(device)
    needed = parameters * TRAINED_BYTES_PER_PARAMETER
    if memory is None or needed <= memory:
        return ""
    return (f"about {parameters / 1e6:,.1f}M parameters: training it needs at least {needed / 2**30:,.1f} GiB "
            f"({TRAINED_BYTES_PER_PARAMETER} bytes a parameter for weights, gradients and Adam), more than "
            f"{device}'s {memory / 2**30:,.1f} GiB")
