"""Crash-safe checkpoints: Hugging Face weights plus the trainer state for an exact resume.

A checkpoint directory `checkpoints/step-N/` holds
  model.safetensors, config.json, tokenizer files   (AutoModelForCausalLM.from_pretrained loads it)
  trainer_state.pt    optimizer, scheduler, RNG streams, step, data-sampler position
  config.yaml         the run's config when it was saved
  manifest.json       size and sha256 of every file above, written last

Writes are atomic: everything goes into a hidden temp directory, each file is fsynced, the
directory is renamed into place, and only then is the `latest` pointer replaced. A crash or a
full disk at any moment leaves the previous checkpoint, and the pointer to it, untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none that is intact could be found."""


# --------------------------------------------------------------------------- file helpers


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def write_manifest(directory: Path) -> None:
    """Record size and sha256 of every file; fsync them all, then the manifest itself."""
    entries = {}
    for p in _files(directory):
        if p.name == MANIFEST:
            continue
        _fsync_path(p)
        entries[str(p.relative_to(directory))] = {"bytes": p.stat().st_size, "sha256": _sha256(p)}
    target = directory / MANIFEST
    with target.open("w") as f:
        json.dump({"files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(directory)


def verify_checkpoint(directory: str | Path) -> list[str]:
    """Problems with a checkpoint directory (empty list = intact): missing manifest, or a
    file whose size or hash differs from it."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    if not manifest.is_file():
        return [f"{manifest} is missing (the save did not finish)"]
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        return [f"{manifest} is unreadable ({err})"]
    problems = []
    for name, expected in entries.items():
        p = directory / name
        if not p.is_file():
            problems.append(f"{name} is missing")
        elif p.stat().st_size != expected["bytes"]:
            problems.append(f"{name} has {p.stat().st_size} bytes, the manifest says {expected['bytes']}")
        elif _sha256(p) != expected["sha256"]:
            problems.append(f"{name} does not match its sha256 in the manifest")
    return problems


# --------------------------------------------------------------------------- saving


def save_checkpoint(model, tokenizer, path: str | Path, extra=None) -> Path:
    """Write model + tokenizer (+ `extra(tmp_dir)` for more files) to `path` atomically.

    On any failure (full disk, unwritable directory) the temp directory is removed, whatever
    was at `path` before is left as it was, and CheckpointError says what happened.
    """
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        write_manifest(tmp)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        _fsync_path(final.parent)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
    except Exception as err:  # OSError, or safetensors' own error wrapping one: clean up, keep the old one
        shutil.rmtree(tmp, ignore_errors=True)
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise CheckpointError(
            f"could not write checkpoint {final}: {reason} ({type(err).__name__}); "
            "free disk space or fix the directory's permissions. Earlier checkpoints are untouched."
        ) from err
    return final


class CheckpointManager:
    """`checkpoints/step-N` directories under one run, a `latest` pointer, keep the last K."""

    def __init__(self, directory: str | Path, keep_last: int = 0):
        self.directory = Path(directory)
        self.keep_last = keep_last

    def step_dirs(self) -> list[Path]:
        """Completed step-N directories, newest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir() if (m := _STEP_DIR.match(p.name))]
        return [p for _, p in sorted(found, reverse=True)]

    def save(self, step: int, model, tokenizer, extra=None) -> Path:
        path = save_checkpoint(model, tokenizer, self.directory / f"step-{step}", extra)
        self._point_latest_at(path.name)
        self._prune(keep=path)
        return path

    def _point_latest_at(self, name: str) -> None:
        tmp = self.directory / f".{LATEST}.tmp-{os.getpid()}"
        try:
            with tmp.open("w") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.directory / LATEST)
            _fsync_path(self.directory)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise CheckpointError(f"could not update {self.directory / LATEST}: {err}") from err

    def _prune(self, keep: Path) -> None:
        if self.keep_last <= 0:
            return
        for old in self.step_dirs()[self.keep_last :]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The newest intact checkpoint: the one `latest` names if it verifies, else the
        newest step-N that does. Broken ones are reported on stderr and skipped, never deleted."""
        import sys

        candidates: list[Path] = []
        pointer = self.directory / LATEST
        if pointer.is_file():
            candidates.append(self.directory / pointer.read_text().strip())
        candidates += [p for p in self.step_dirs() if p not in candidates]
        for path in candidates:
            problems = verify_checkpoint(path)
            if not problems:
                return path
            print(f"grpokit: skipping checkpoint {path}: {'; '.join(problems)}", file=sys.stderr)
        return None


def find_resume_checkpoint(run_dir: str | Path, explicit: str | Path | None = None) -> Path:
    """The checkpoint `--resume` continues from: `explicit` if given (it must verify), else the
    newest intact one under run_dir/checkpoints."""
    if explicit is not None:
        path = Path(explicit)
        problems = verify_checkpoint(path)
        if problems:
            raise CheckpointError(f"cannot resume from {path}: {'; '.join(problems)}")
        return path
    path = CheckpointManager(Path(run_dir) / "checkpoints").latest()
    if path is None:
        raise CheckpointError(
            f"no intact checkpoint under {Path(run_dir) / 'checkpoints'} to resume from; "
            "start without --resume, or pass --resume PATH"
        )
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(f"{path} holds weights only (no {TRAINER_STATE}); it cannot be resumed exactly")
    return path
