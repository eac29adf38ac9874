"""One run per run directory, never overwritten by accident.

A new run goes into an empty (or new) directory. One that holds another run's files is refused,
naming what is there and the three ways on: `--resume` it, a new `--output-dir`, or
`--overwrite`, which removes the old run first. Without --output-dir each command has a
directory of its own, runs/<command>, and the next free runs/<command>-N once that one is used,
so a bare `grpokit demo` twice keeps both runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from grpokit.models.checkpoint_dirs import LATEST, step_number

RUNS_ROOT = Path("runs")
NEW, OVERWRITE, CLAIMED = "new", "overwrite", "claimed"  # a fresh run's claim on its directory
RUN_CONFIG = "config.yaml"  # every command's run writes it first: what marks a directory as a run


class RunDirectoryInUse(RuntimeError):
    """A new run was pointed at a directory that holds another run."""


class RunComplete(RuntimeError):
    """--resume was asked of a run that has already finished."""


def default_run_dir(command: str, root: Path = RUNS_ROOT) -> Path:
    """runs/<command>, or runs/<command>-N, the first of them with no run in it."""
    for n in range(1, 10_000):
        path = root / (command if n == 1 else f"{command}-{n}")
        if not run_files(path):
            return path
    raise RunDirectoryInUse(f"{root} holds 10,000 {command} runs; pass --output-dir")


def latest_default_run_dir(command: str, root: Path = RUNS_ROOT) -> Path:
    """The newest runs/<command>[-N] that holds a run (what a bare `--resume` continues)."""
    pattern = re.compile(rf"^{re.escape(command)}(?:-(\d+))?$")
    used = [(int(m.group(1) or 1), p) for p in (root.iterdir() if root.is_dir() else [])
            if (m := pattern.match(p.name)) and run_files(p)]
    return max(used)[1] if used else root / command


def run_files(run_dir: str | Path) -> list[str]:
    """What a run left in `run_dir` (sorted names; hidden files such as the lock do not count)."""
    path = Path(run_dir)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if not p.name.startswith("."))


def describe_run(run_dir: str | Path) -> str:
    """What is in a used run directory, in a few words: its files, steps logged, checkpoints."""
    path = Path(run_dir)
    parts = []
    for name in run_files(path)[:8]:
        if name == "metrics.jsonl":
            with (path / name).open("rb") as f:
                parts.append(f"metrics.jsonl ({sum(1 for _ in f)} steps)")
        elif name == "checkpoints" and (path / name).is_dir():
            steps = sorted((p.name for p in (path / name).iterdir() if not p.name.startswith(".")
                            and p.name != LATEST), key=lambda n: (step_number(n) or 0, n))
            parts.append(f"checkpoints/ ({', '.join(steps[-4:]) or 'empty'})")
        else:
            parts.append(name + "/" * (path / name).is_dir())
    extra = len(run_files(path)) - 8
    return ", ".join(parts) + (f" and {extra} more" if extra > 0 else "")


def claim_run_dir(run_dir: str | Path, mode: str, can_resume: bool) -> None:
    """Make `run_dir` ready for a fresh run (call it holding the run lock): refuse a used one,
    or with mode OVERWRITE remove the old run first. CLAIMED: an earlier stage of this same run
    (the demo's SFT) wrote there."""
    path = Path(run_dir)
    used = run_files(path)
    if not used or mode == CLAIMED:
        return
    if RUN_CONFIG not in used:  # --overwrite must never delete what grpokit did not write
        raise RunDirectoryInUse(f"{path} is not empty and holds no grpokit run ({describe_run(path)}); "
                                "pick an empty or new --output-dir")
    if mode == OVERWRITE:
        for name in used:
            target = path / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        print(f"grpokit: --overwrite: removed the earlier run in {path} ({len(used)} entries)")
        return
    resume = "continue it with --resume, " if can_resume else ""
    raise RunDirectoryInUse(
        f"{path} already holds a run ({describe_run(path)}); {resume}start a new one with --output-dir NEW_DIR, "
        f"or pass --overwrite to delete it and start afresh")


def check_not_complete(run_dir: str | Path, checkpoint: Path, max_steps: int) -> None:
    """Refuse to resume a run that reached max_steps and wrote its summary: there is nothing left
    to do. (A run that stopped after its last step but before its final evaluation resumes there.)"""
    summary = Path(run_dir) / "summary.json"
    step = step_number(checkpoint.name)
    if step is None or step < max_steps or not summary.is_file():
        return
    try:
        final = json.loads(summary.read_text()).get("checkpoint", str(checkpoint))
    except ValueError:
        final = str(checkpoint)
    raise RunComplete(
        f"{run_dir} is complete: it trained all {max_steps} steps and its final checkpoint is {final} "
        f"(results in {summary}); nothing to resume. To train longer, resume with a larger --grpo.max_steps, or "
        f"start a new run from it: --model.name_or_path={final} --output-dir NEW_DIR")
