"""A run directory taken for a stage: its lock (run/lock.py), taken by rank 0 alone, and the
directory claimed for a new run (run/directory.py); when rank 0 cannot, every process stops.
(Moved here from pipeline/stages.py.)"""

from __future__ import annotations

from contextlib import contextmanager

from grpokit import distributed
from grpokit.run.directory import CLAIMED, claim_run_dir
from grpokit.run.lock import RunLock


def on_main(step, what: str) -> None:
    """Run `step` on rank 0 alone; when it fails there, every process stops (rank 0 with its error)."""
    failure = None
    if distributed.is_main():
        try:
            step()
        except Exception as err:
            failure = err
    if not distributed.all_agree(failure is None):
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank 0 could not {what}; see its message")


@contextmanager
def run_lock(output_dir: str, mode: str = CLAIMED, can_resume: bool = False):
    """The run directory's lock, taken by rank 0 alone (the other processes write nothing there),
    and the directory claimed for a new run (rundir.claim_run_dir) unless `mode` is CLAIMED;
    when rank 0 cannot take or claim it, every process stops."""
    lock = RunLock(output_dir)
    on_main(lock.__enter__, f"lock the run directory {output_dir}")
    try:
        on_main(lambda: claim_run_dir(output_dir, mode, can_resume), f"claim the run directory {output_dir}")
        yield
    finally:
        if distributed.is_main():
            lock.__exit__(None, None, None)


def claim(output_dir: str, mode: str) -> None:
    """Claim output_dir for a new run (rundir.claim_run_dir) under its lock, then release the lock
    for the run's stages to take in turn."""
    with run_lock(output_dir, mode):
        pass
