"""Resuming a run: where it resumes (the latest intact checkpoint, the one given, or an iterative
run's last iteration boundary), the checks that refuse a resume that would not continue the same
run (a changed config, another world size, a finished run), and the reward-model log rows a
resumed run redoes. A run killed before its first checkpoint has nothing to resume: `--resume`
starts it again from the beginning (with its saved config), so that one command always continues
a killed run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from grpokit import distributed
from grpokit.run.checkpoint import CheckpointError, NoCheckpoint, find_resume_checkpoint, saved_world_size
from grpokit.config import Config, ConfigError, resume_differences, to_dict
from grpokit.run.directory import RUN_CONFIG, check_not_complete, describe_run, run_files
from grpokit.train.iterative import latest_iteration


def check_resume_config(checkpoint: Path, config: Config, force: bool, what: str = "") -> None:
    """Refuse to resume with a config that changes what the run computes, unless forced.
    `checkpoint`: a checkpoint, or the run directory of a run that has none yet (`what` names it)."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        raise CheckpointError(f"{checkpoint} has no config.yaml to compare against; pass --force to resume anyway")
    differences = resume_differences(yaml.safe_load(saved_file.read_text()) or {}, to_dict(config))
    if differences and not force:
        raise ConfigError(
            f"the config differs from the one {what or checkpoint} was trained with:\n  " + "\n  ".join(differences)
            + "\nresume with the saved config (" + str(saved_file) + "), or pass --force to accept the changes"
        )
    if differences:
        print("grpokit: --force: resuming with changed keys:\n  " + "\n  ".join(differences), file=sys.stderr)


def keep_rounds(run_dir: Path, last: int) -> None:
    """Drop reward-model metrics rows of rounds after `last`: a resumed run redoes them."""
    path = run_dir / "reward_model_metrics.jsonl"
    if path.is_file():
        rows = [line for line in path.read_text().splitlines() if json.loads(line).get("round", 0) <= last]
        path.write_text("".join(row + "\n" for row in rows))


def resume_point(config: Config, resume: bool | str, force: bool) -> tuple[Path | None, Path | None]:
    """(checkpoint to resume from, iteration boundary) or (None, None) for a fresh run."""
    if not resume:
        return None, None
    boundary = latest_iteration(config.output_dir) if config.iterative.iterations > 1 else None
    if boundary is not None and resume is not True:
        print(f"grpokit: iterative runs resume at their last iteration boundary ({boundary}), "
              f"not at {resume}", file=sys.stderr)
    try:
        checkpoint = boundary / "policy" if boundary is not None else \
            find_resume_checkpoint(config.output_dir, None if resume is True else resume)
    except NoCheckpoint:  # killed before its first checkpoint: nothing to lose, start again
        restart_without_checkpoint(Path(config.output_dir), config, force)
        return None, None
    if boundary is None:
        check_not_complete(config.output_dir, checkpoint, config.grpo.max_steps)
    check_resume_config(checkpoint, config, force)
    saved, world = saved_world_size(checkpoint), distributed.world_size()
    if saved != world:
        raise CheckpointError(
            f"{checkpoint} was written by {saved} process{'es' * (saved > 1)} and this run has {world}: an exact "
            f"resume needs the same number (torchrun --nproc_per_node={saved} ... --resume), because each "
            f"process's optimizer shard and random streams are saved apart. To go on with {world} instead, start "
            f"a new run from its weights: --model.name_or_path={checkpoint} (the optimizer and the data order "
            f"start afresh)")
    return checkpoint, boundary


def restart_without_checkpoint(run_dir: Path, config: Config, force: bool) -> None:
    """`--resume` of a run killed before its first checkpoint: nothing was saved, so it starts again
    from the beginning, with the config it was started with (a changed one is refused, as on any
    resume). A directory that holds no run has nothing to resume: the run starts without --resume."""
    if run_files(run_dir) and RUN_CONFIG not in run_files(run_dir):
        raise CheckpointError(f"nothing to resume in {run_dir}: it holds no grpokit run ({describe_run(run_dir)}); "
                              "pick an empty or new --output-dir")
    if not run_files(run_dir):
        raise CheckpointError(f"nothing to resume in {run_dir}: it holds no run yet; start it without --resume")
    check_resume_config(run_dir, config, force, what=f"the run in {run_dir}")
    if distributed.is_main():
        print(f"grpokit: --resume: {run_dir} has no checkpoint yet (it stopped before its first one); starting it "
              f"from the beginning with its saved config ({run_dir / RUN_CONFIG})", file=sys.stderr)
