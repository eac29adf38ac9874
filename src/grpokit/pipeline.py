"""`grpokit sft` and `grpokit train`: the demo's stages one at a time, on any checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from grpokit.checkpoint import CheckpointError, find_resume_checkpoint, save_checkpoint
from grpokit.config import Config, ConfigError, resume_differences, to_dict
from grpokit.data.files import filter_long_prompts, load_prompt_rows
from grpokit.eval.plots import plot_reward_curve
from grpokit.models import load_model_and_tokenizer
from grpokit.runlock import RunLock
from grpokit.stages import build_rewards, evaluate_chain, load_policy, start_run, task_splits
from grpokit.train.grpo import GRPOTrainer, frozen_copy
from grpokit.train.sft import sft_train


def run_sft(config: Config, progress: bool = True) -> Path:
    """SFT model.name_or_path (or a fresh tiny model) on the task's demonstrations."""
    with RunLock(config.output_dir):
        run_dir = start_run(config)
        sft_rows, _, _ = task_splits(config)
        model, tokenizer = load_policy(config)
        sft_train(model, tokenizer, [(r["prompt"], r["solution"]) for r in sft_rows], config.sft,
                  seed=config.seed, progress=progress)
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


def rl_rows(config: Config, tokenizer) -> tuple[list[dict], list[dict] | None]:
    """(RL prompt rows, held-out rows or None): from data.train_file, or the built-in task."""
    d = config.data
    if not d.train_file:
        _, rows, heldout = task_splits(config)
        return rows, heldout
    loaded = load_prompt_rows(d.train_file, d.prompt_column, d.answer_column, d.skip_malformed_lines)
    for line in loaded.skipped[:5]:
        print(f"grpokit: skipped {line}", file=sys.stderr)
    if loaded.num_skipped:
        print(f"grpokit: skipped {loaded.num_skipped} malformed rows of {d.train_file}", file=sys.stderr)
    rows, long = filter_long_prompts(loaded.rows, tokenizer, d.max_prompt_length, d.long_prompts, d.train_file)
    if long:
        print(f"grpokit: {long} prompts over {d.max_prompt_length} tokens were {d.long_prompts}ped"
              if d.long_prompts == "skip" else f"grpokit: {long} prompts truncated to {d.max_prompt_length} tokens",
              file=sys.stderr)
    return rows, None


def run_train(config: Config, progress: bool = True, resume: bool | str = False, force: bool = False) -> Path:
    """GRPO from model.name_or_path; with `resume`, continue exactly from the latest intact
    checkpoint of output_dir (or from the path given)."""
    if config.data.train_file:  # file errors surface before any model loads
        load_prompt_rows(config.data.train_file, config.data.prompt_column, config.data.answer_column,
                         config.data.skip_malformed_lines)
    with RunLock(config.output_dir):
        checkpoint = None
        if resume:
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
        trainer = GRPOTrainer(model, tokenizer, build_rewards(config), rows, config.grpo, run_dir,
                              seed=config.seed, progress=progress, ref_model=ref_model)
        if checkpoint is not None:
            trainer.resume_from(checkpoint)
            print(f"resumed from {checkpoint} at step {trainer.global_step}", file=sys.stderr)
        history = trainer.train()
        final = trainer.checkpoints.latest()
        if trainer.interrupted:
            return final
        if heldout is not None:
            result = evaluate_chain(model, tokenizer, heldout, config)
            plot_reward_curve(history, run_dir / "reward_curve.png", final=result.greedy_accuracy)
            print(f"held-out greedy accuracy {result.greedy_accuracy:.1%}, pass@{result.k} {result.pass_at_k:.1%}")
    print(f"final checkpoint {final}")
    return final
