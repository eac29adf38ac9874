"""The shared-memory segments of vLLM's CPU collectives, when engines join torchrun's group.

On CPU, a vLLM engine spread over several processes (tensor parallelism under torchrun's
external_launcher) talks through one POSIX shared-memory segment per process, created with
O_EXCL under a name made of the group, not of the run: /dev/shm/-tp:0-[0-1]-cpushm_0, the same
for every run. vLLM removes the name only in a C++ destructor at interpreter teardown, which a
launched grpokit process skips (distributed.leave) and a killed one never reaches; the next run
then fails at start with "create shm in SHMManager failed. errno: 17".

So each process removes its segment's name as soon as every peer has opened it: the mapping
stays, the name is free, and nothing can be left behind from then on. Before the engines start,
one process per machine removes the names an earlier run left, those no live process maps.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
# Under external_launcher vLLM's instance identifier is empty, so the names begin with "-".
ENGINE_SEGMENTS = "-*-cpushm_*"

log = logging.getLogger(__name__)


def mapped_paths(proc: Path = Path("/proc")) -> set[str] | None:
    """Every file that a live process of this user maps, from /proc/<pid>/maps; None when /proc
    cannot be read at all (then no segment can be told stale)."""
    try:
        pids = [entry for entry in proc.iterdir() if entry.name.isdigit()]
    except OSError:
        return None
    paths: set[str] = set()
    for pid in pids:
        try:
            maps = (pid / "maps").read_text()
        except OSError:  # gone since the listing, or another user's process (it cannot map 0600 files of ours)
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6:
                paths.add(fields[5])
    return paths


def remove_stale_segments(shm_dir: Path = SHM_DIR, proc: Path = Path("/proc")) -> list[Path]:
    """Remove the engine segments of this user that no live process maps (a killed run's, or one of
    a grpokit older than this module's); a segment still mapped belongs to a running engine and
    stays. Returns what was removed."""
    if not shm_dir.is_dir():
        return []
    candidates = [path for path in sorted(shm_dir.glob(ENGINE_SEGMENTS)) if _owned_by_me(path)]
    if not candidates:
        return []
    mapped = mapped_paths(proc)
    if mapped is None:
        return []
    removed = []
    for path in candidates:
        if str(path) in mapped:
            continue
        try:
            path.unlink()
        except FileNotFoundError:  # another machine-local remover got there first
            continue
        log.warning("removed %s: a vLLM shared-memory segment no process uses, left by an earlier run", path)
        removed.append(path)
    return removed


def unlink_segments(names: list[str], shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the names of this process's own segments (vLLM's SHMManager names, as
    rollout/vllm.py reads them off its groups), once every peer has opened them; returns those
    that were there."""
    removed = []
    for name in names:
        try:
            (shm_dir / name.lstrip("/")).unlink()  # shm_open drops the leading slashes
        except FileNotFoundError:
            continue
        removed.append(name)
    return removed


def stale_segment_error(message: str, shm_dir: Path = SHM_DIR) -> ValueError | None:
    """A clear error for vLLM's start failing on a segment that is still there, else None."""
    if "create shm in SHMManager failed. errno: 17" not in message:
        return None
    left = sorted(str(path) for path in shm_dir.glob(ENGINE_SEGMENTS)) if shm_dir.is_dir() else []
    return ValueError(
        "vLLM could not create its CPU shared-memory segment: one of the same name exists "
        f"({', '.join(left) or 'under ' + str(shm_dir)}): another user's, one that no readable /proc showed unused, "
        "or a vLLM engine starting at the same moment on this machine. Remove it if no run uses it, or start "
        "this run once the other has started"
    )


def _owned_by_me(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except FileNotFoundError:
        return False
