"""Atomic checkpoints in Hugging Face format (safetensors), loadable by from_pretrained."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_checkpoint(model, tokenizer, path: str | Path) -> Path:
    """Write model + tokenizer to `path` atomically: a crash mid-save never leaves a
    half-written checkpoint where a complete one was expected."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)
    return final
