"""One trainer per run directory: an exclusive lock on RUN_DIR/.lock, released by the OS
when the process ends however it ends (a SIGKILL leaves no stale lock)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class RunDirectoryLocked(RuntimeError):
    """Another process is training in this run directory."""


class RunDirectoryUnwritable(RuntimeError):
    """The run directory cannot be created or written."""


class RunLock:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> "RunLock":
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise RunDirectoryUnwritable(
                f"cannot write to the run directory {self.path.parent}: {err.strerror or err}; "
                "pick a writable --output-dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirectoryLocked(
                f"run directory {self.path.parent} is in use by another grpokit process (pid {holder}); "
                "wait for it to finish, or pick another output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
