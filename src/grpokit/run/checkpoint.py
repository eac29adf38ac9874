"""Crash-safe checkpoints: Hugging Face weights plus the trainer state for an exact resume.

A checkpoint directory `checkpoints/step-N/` holds
  model.safetensors, config.json, tokenizer files   (AutoModelForCausalLM.from_pretrained loads it)
  trainer_state.pt    optimizer, scheduler, RNG streams, step, data-sampler position
  trainer_state.rank{r}.pt   the same for process r > 0 of a torchrun run (optimizer shards, RNG)
  master/             fp32 master weights, when compute ran in bf16 (model.safetensors is then bf16)
  config.yaml         the run's config when it was saved
  manifest.json       size and sha256 of every file above, written last
and `checkpoints/latest` links to the newest (from_pretrained("run/checkpoints/latest") loads it).

Writes are atomic: everything goes into a hidden temp directory, each file is fsynced, the
directory is renamed into place, and only then is the `latest` pointer replaced. A crash or a
full disk at any moment leaves the previous checkpoint, and the pointer to it, untouched.

Under torchrun the weights are gathered from the FSDP2 shards and rank 0 writes them, as one
Hugging Face checkpoint; every process writes its own trainer state into the same temp
directory, and rank 0 renames it into place only once all have succeeded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from grpokit import distributed
from grpokit.models import checkpoint_dirs
from grpokit.models.checkpoint_dirs import LATEST, MASTER_DIR
from grpokit.models.lora import is_lora
from grpokit.models.precision import compute_dtype, compute_dtype_state
from grpokit.models.sharding import full_state_dict
from grpokit.models.wrapping import is_sharded

MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.pt"
_RANK_STATE = re.compile(r"^trainer_state\.rank(\d+)\.pt$")


def rank_state_file(rank: int) -> str:
    """Process `rank`'s trainer-state file: trainer_state.pt for rank 0 (and one-process runs)."""
    return TRAINER_STATE if rank == 0 else f"trainer_state.rank{rank}.pt"


def saved_world_size(directory: str | Path) -> int:
    """How many processes wrote a checkpoint: one trainer-state file each."""
    directory = Path(directory)
    return 1 + sum(1 for p in directory.iterdir() if _RANK_STATE.match(p.name)) if directory.is_dir() else 1


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or none that is intact could be found."""


class NoCheckpoint(CheckpointError):
    """A run directory holds no intact checkpoint (a run killed before its first one)."""


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


def save_model_files(model, tokenizer, directory: Path, state_dict=None) -> None:
    """model.safetensors + config.json + tokenizer files that from_pretrained loads; a PEFT model
    writes its adapter (adapter_model.safetensors + adapter_config.json) instead of full weights.

    A model trained with fp32 master weights and a lower compute dtype (models/precision.py) is
    written in its compute dtype, which is what it runs in, and its fp32 master weights go to
    master/ beside it (a Hugging Face checkpoint of their own), from which a resume or a later
    stage continues exactly."""
    dtype = compute_dtype(model)
    kwargs = {"state_dict": state_dict} if state_dict is not None else {}
    mixed = dtype is not None and not is_lora(model) and _weights_dtype(model, state_dict) != dtype
    if mixed:  # the master weights as they are, then the compute-dtype copy at the top
        model.save_pretrained(directory / MASTER_DIR, safe_serialization=True, **kwargs)
        kwargs = {"state_dict": compute_dtype_state(state_dict if state_dict is not None else model.state_dict(),
                                                    dtype)}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    if mixed:
        _set_config_dtype(directory / "config.json", dtype)
    tokenizer.save_pretrained(directory)


def _weights_dtype(model, state_dict=None):
    """The dtype of the first floating-point weight (of the gathered `state_dict` when given)."""
    tensors = state_dict.values() if state_dict is not None else model.parameters()
    return next((t.dtype for t in tensors if t.is_floating_point()), None)


def _set_config_dtype(config_file: Path, dtype) -> None:
    """config.json's dtype: save_pretrained records the live (master) weights' dtype, not the saved one."""
    config = json.loads(config_file.read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model, tokenizer, path: str | Path, extra=None, rank_extra=None, state_dict=None) -> Path:
    """Write model + tokenizer (+ `extra(tmp_dir)` for more files) to `path` atomically.

    Under torchrun every process calls it: the weights are gathered from their shards, rank 0
    writes them, the tokenizer and `extra`, and each process writes `rank_extra(tmp_dir)`
    (its own trainer state). `state_dict`: the full weights when the caller has gathered them
    already. On any failure on any process (full disk, unwritable directory)
    the temp directory is removed, whatever was at `path` before is left as it was, and every
    process raises a CheckpointError that says what happened.
    """
    final = Path(path)
    main = distributed.is_main()
    tmp = final.with_name(f".{final.name}.tmp-{distributed.broadcast_object(os.getpid())}")
    # Collective for sharded models: every process gathers, rank 0 keeps the tensors.
    state = state_dict if state_dict is not None else full_state_dict(model) if is_sharded(model) else None
    failure: BaseException | None = None

    def phase(step) -> None:
        nonlocal failure
        if failure is None:
            try:
                step()
            except Exception as err:  # OSError, or safetensors' own error wrapping one
                failure = err
        if not distributed.all_agree(failure is None) and failure is None:
            failure = CheckpointError("another process could not write its part (see its message)")

    def write_shared() -> None:
        if not main:
            return
        final.parent.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        save_model_files(model, tokenizer, tmp, state)
        if extra is not None:
            extra(tmp)

    def write_own() -> None:
        if rank_extra is not None:
            rank_extra(tmp)

    def publish() -> None:
        if not main:
            return
        write_manifest(tmp)
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        _fsync_path(final.parent)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)

    try:
        for step in (write_shared, write_own, publish):
            phase(step)
    except BaseException:  # a peer died mid-save (PeerFailure), or a second signal: no half-written directory
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if failure is not None:  # clean up, keep the old one
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        err = failure
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
        return checkpoint_dirs.step_dirs(self.directory)

    def save(self, step: int, model, tokenizer, extra=None, rank_extra=None, state_dict=None) -> Path:
        path = save_checkpoint(model, tokenizer, self.directory / f"step-{step}", extra, rank_extra, state_dict)
        if distributed.is_main():
            self._point_latest_at(path.name)
            self._prune(keep=path)
        distributed.barrier()  # no process runs ahead of a checkpoint that is not yet in place
        return path

    def _point_latest_at(self, name: str) -> None:
        """`latest` -> step-N, a relative symbolic link, so from_pretrained(".../latest") loads it;
        a one-line text file naming it where the file system has no links."""
        tmp = self.directory / f".{LATEST}.tmp-{os.getpid()}"
        try:
            tmp.unlink(missing_ok=True)
            try:
                os.symlink(name, tmp, target_is_directory=True)
            except (OSError, NotImplementedError):
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

    def pointed(self) -> Path | None:
        """The checkpoint `latest` names, unverified: a link, or the text pointer of older runs."""
        return checkpoint_dirs.pointed(self.directory)

    def latest(self) -> Path | None:
        """The newest intact checkpoint: the one `latest` names if it verifies, else the
        newest step-N that does. Broken ones are reported on stderr and skipped, never deleted."""
        import sys

        pointed = self.pointed()
        candidates = [pointed] if pointed is not None else []
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
        raise NoCheckpoint(
            f"no intact checkpoint under {Path(run_dir) / 'checkpoints'} to resume from; "
            "start without --resume, or pass --resume PATH"
        )
    if not (path / TRAINER_STATE).is_file():
        raise CheckpointError(f"{path} holds weights only (no {TRAINER_STATE}); it cannot be resumed exactly")
    return path
