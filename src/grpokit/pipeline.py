"""`grpokit sft`, `grpokit train-rm` and `grpokit train`: the demo's stages one at a time, on any checkpoint."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import yaml

from grpokit.checkpoint import CheckpointError, find_resume_checkpoint, save_checkpoint
from grpokit.config import Config, ConfigError, resume_differences, to_dict
from grpokit.data.files import filter_long_prompts
from grpokit.data.sources import build_rows, check_sources
from grpokit.eval.plots import plot_reward_curve
from grpokit.models import load_model_and_tokenizer
from grpokit.runlock import RunLock
from grpokit.stages import (
    evaluate_chain,
    load_policy,
    make_trainer,
    start_run,
    task_splits,
)
from grpokit.train.grpo import frozen_copy
from grpokit.train.iterative import latest_iteration, run_iterations
from grpokit.train.sft import sft_train


def run_sft(config: Config, progress: bool = True) -> Path:
    """SFT model.name_or_path (or a fresh tiny model) on the task's demonstrations."""
    check_sources(config.data.sft_sources, config.data.skip_malformed_lines)  # before any model loads
    with RunLock(config.output_dir):
        run_dir = start_run(config)
        model, tokenizer = load_policy(config)
        if config.data.sft_sources:
            rows = build_rows(config.data.sft_sources, config.data, tokenizer, sft=True)
            rows = _limit_prompts(rows, config, tokenizer)
            pairs = [(r["prompt"], r["completion"]) for r in rows]
        else:
            pairs = [(r["prompt"], r["solution"]) for r in task_splits(config)[0]]
        sft_train(model, tokenizer, pairs, config.sft, seed=config.seed, progress=progress)
        path = save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "sft")
    print(f"saved {path}")
    return path


def check_resume_config(checkpoint: Path, config: Config, force: bool) -> None:
    """Refuse to resume with a config that changes what the run computes, unless forced."""
    saved_file = checkpoint / "config.yaml"
    if not saved_file.is_file():
        raise CheckpointError(f"{checkpoint} has no config.yaml to compare against; pass --force to resume anyway")
    differences = resume_differences(yaml.safe_load(saved_file.read_text()) or {}, to_dict(config))
    if differences and not force:
        raise ConfigError(
            f"the config differs from the one {checkpoint} was trained with:\n  " + "\n  ".join(differences)
            + "\nresume with the saved config (" + str(saved_file) + "), or pass --force to accept the changes"
        )
    if differences:
        print("grpokit: --force: resuming with changed keys:\n  " + "\n  ".join(differences), file=sys.stderr)


def _limit_prompts(rows: list[dict], config: Config, tokenizer) -> list[dict]:
    """Apply data.max_prompt_length, saying how many prompts it touched."""
    d = config.data
    rows, long = filter_long_prompts(rows, tokenizer, d.max_prompt_length, d.long_prompts, "data.sources")
    if long:
        done = "skipped" if d.long_prompts == "skip" else "truncated to their last tokens"
        print(f"grpokit: {long} prompts over {d.max_prompt_length} tokens were {done}", file=sys.stderr)
    return rows


def rl_rows(config: Config, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(RL prompt rows, held-out rows or None): from data.sources, or the built-in task."""
    if not config.data.sources:
        _, rows, heldout = task_splits(config)
        return rows, heldout
    rows = _limit_prompts(build_rows(config.data.sources, config.data, tokenizer), config, tokenizer)
    return rows, None


def _keep_rounds(run_dir: Path, last: int) -> None:
    """Drop reward-model metrics rows of rounds after `last`: a resumed run redoes them."""
    path = run_dir / "reward_model_metrics.jsonl"
    if path.is_file():
        import json

        rows = [line for line in path.read_text().splitlines() if json.loads(line).get("round", 0) <= last]
        path.write_text("".join(row + "\n" for row in rows))


def check_reward_model_setup(config: Config) -> None:
    """Setups that could only fail after training has started, refused before any model loads."""
    rm = config.reward_model
    needs_labels = not rm.path or config.iterative.iterations > 1
    if rm.kind == "process" and config.data.sources and needs_labels:
        raise ConfigError(
            "process labels for data.sources cannot be made by rule here (only the built-in task has a step "
            "checker): train a PRM with `grpokit train-rm --process --data STEPS.jsonl`, set reward_model.path "
            "to it, and keep iterative.iterations=1")


def _reward_model_for_run(config: Config, policy, tokenizer, rows, run_dir: Path, progress: bool, checkpoint,
                          boundary: Path | None):
    """The run's reward model: from an iteration boundary (with its replay buffer), from the one
    this run trained before (on resume), from reward_model.path, or trained now on the policy's
    graded samples and saved as run_dir/reward_model."""
    from grpokit.stages import reward_model_stage

    if config.reward_model.kind == "none":
        return None
    own = run_dir / "reward_model"
    if boundary is not None:
        stage = reward_model_stage(config, policy, tokenizer, rows, run_dir, progress, path=str(boundary / "reward_model"))
        shutil.copyfile(boundary / "replay_buffer.jsonl", stage.buffer.path)
        stage.buffer.load()
        _keep_rounds(run_dir, int(boundary.name.split("-")[1]))
        return stage
    if checkpoint is not None and not config.reward_model.path and (own / "config.json").is_file():
        stage = reward_model_stage(config, policy, tokenizer, rows, run_dir, progress, path=str(own))
        stage.buffer.load()  # round 0's replay share, which the next refresh must keep
        _keep_rounds(run_dir, 0)
        return stage
    stage = reward_model_stage(config, policy, tokenizer, rows, run_dir, progress)
    if not config.reward_model.path:
        for stale in ("reward_model_metrics.jsonl", "replay_buffer.jsonl"):
            (run_dir / stale).unlink(missing_ok=True)
        metrics = stage.train_round(policy, 0)
        stage.save(own, metrics)
    return stage


def run_train(config: Config, progress: bool = True, resume: bool | str = False, force: bool = False) -> Path:
    """GRPO from model.name_or_path; with `resume`, continue exactly from the latest intact
    checkpoint of output_dir (or from the path given)."""
    check_sources(config.data.sources, config.data.skip_malformed_lines)  # file errors before any model loads
    check_reward_model_setup(config)
    with RunLock(config.output_dir):
        checkpoint = None
        boundary = latest_iteration(config.output_dir) if resume and config.iterative.iterations > 1 else None
        if boundary is not None and resume is not True:
            print(f"grpokit: iterative runs resume at their last iteration boundary ({boundary}), "
                  f"not at {resume}", file=sys.stderr)
        if boundary is not None:  # iterative GRPO resumes at its last complete iteration boundary
            checkpoint = boundary / "policy"
            check_resume_config(checkpoint, config, force)
        elif resume:
            checkpoint = find_resume_checkpoint(config.output_dir, None if resume is True else resume)
            check_resume_config(checkpoint, config, force)
        run_dir = start_run(config)
        initial, tokenizer = load_policy(config)  # the frozen reference is always the initial policy
        rows, heldout = rl_rows(config, tokenizer)
        if checkpoint is None:
            model, ref_model = initial, None
        else:
            m = config.model
            model, _ = load_model_and_tokenizer(str(checkpoint), m.dtype, m.device, m.attn_implementation,
                                                m.trust_remote_code)
            ref_model = frozen_copy(initial) if config.grpo.beta > 0 else None
        stage = _reward_model_for_run(config, model, tokenizer, rows, run_dir, progress, checkpoint, boundary)
        trainer = make_trainer(config, model, tokenizer, rows, run_dir, progress, ref_model,
                               reward_scorer=stage.scorer if stage else None)
        if checkpoint is not None:
            trainer.resume_from(checkpoint)
            print(f"resumed from {checkpoint} at step {trainer.global_step}", file=sys.stderr)
        start = int(boundary.name.split("-")[1]) + 1 if boundary is not None else 1
        history = run_iterations(trainer, stage, config.iterative.iterations, start=start)
        final = trainer.checkpoints.latest()
        if trainer.interrupted:
            return final
        if heldout is not None:
            result = evaluate_chain(model, tokenizer, heldout, config)
            plot_reward_curve(history, run_dir / "reward_curve.png", final=result.greedy_accuracy)
            print(f"held-out greedy accuracy {result.greedy_accuracy:.1%}, pass@{result.k} {result.pass_at_k:.1%}")
    print(f"final checkpoint {final}")
    return final


def reward_model_examples(path: str, kind: str, delimiter: str, skip_malformed: bool, seed: int,
                          max_pairs_per_prompt: int = 8) -> list:
    """Training examples from a file: preference pairs (prompt, chosen, rejected), graded samples
    (prompt, completion, correct) made into pairs, or step-labelled samples for a process RM."""
    from grpokit.data.files import read_file_records
    from grpokit.data.reward_data import (
        pairs_from_graded,
        read_graded_samples,
        read_preference_pairs,
        read_step_labels,
    )

    if kind == "process":
        return read_step_labels(path, delimiter, skip_malformed)
    records, _ = read_file_records(path, skip_malformed=True)
    first = records[0][1] if records and isinstance(records[0][1], dict) else {}
    if "chosen" in first or "rejected" in first:
        return read_preference_pairs(path, skip_malformed)
    return pairs_from_graded(read_graded_samples(path, skip_malformed), seed=seed,
                             max_pairs_per_prompt=max_pairs_per_prompt)


def run_train_rm(config: Config, progress: bool = True, data: str = "") -> Path:
    """Train an outcome (Bradley-Terry) or process (per-step BCE) reward model, initialised from
    model.name_or_path (or a fresh tiny model), on `data` or on the policy's own graded samples.
    Saves output_dir/reward_model in Hugging Face format with its held-out accuracy."""
    import json

    from grpokit.stages import reward_model_stage
    from grpokit.train.reward_model import (
        evaluate_reward_model,
        fit_reward_model,
        split_by_prompt,
    )

    if config.reward_model.kind == "none":  # train-rm without --process: an outcome reward model
        config = dataclasses.replace(config, reward_model=dataclasses.replace(config.reward_model, kind="outcome"))
    rm = config.reward_model
    with RunLock(config.output_dir):
        run_dir = start_run(config)
        examples = reward_model_examples(data, rm.kind, rm.step_delimiter, config.data.skip_malformed_lines,
                                         config.seed, rm.max_pairs_per_prompt) if data else None
        policy, tokenizer = load_policy(config)
        rows, _ = rl_rows(config, tokenizer) if not data else ([], None)
        stage = reward_model_stage(config, policy, tokenizer, rows, run_dir, progress)
        if examples is None:
            metrics = stage.train_round(policy, 0)
        else:
            train, heldout = split_by_prompt(examples, rm.heldout_fraction, config.seed)
            losses = fit_reward_model(stage.scorer, train, rm, seed=config.seed, progress=progress)
            metrics = {"round": 0, "new_examples": len(train), "heldout_examples": len(heldout),
                       "final_loss": losses[-1], **evaluate_reward_model(stage.scorer, heldout)}
        del policy
        path = stage.save(run_dir / "reward_model", metrics)
    print(json.dumps(metrics, indent=2))
    print(f"saved {path} ({rm.kind} reward model)")
    return path
