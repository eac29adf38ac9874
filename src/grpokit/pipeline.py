"""`grpokit sft` and `grpokit train`: the demo's stages one at a time, on any checkpoint."""

from __future__ import annotations

from pathlib import Path

from grpokit.checkpoint import save_checkpoint
from grpokit.config import Config
from grpokit.eval.plots import plot_reward_curve
from grpokit.stages import build_rewards, evaluate_chain, load_policy, start_run, task_splits
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.sft import sft_train


def run_sft(config: Config, progress: bool = True) -> Path:
    """SFT model.name_or_path (or a fresh tiny model) on the task's demonstrations."""
    run_dir = start_run(config)
    sft_rows, _, _ = task_splits(config)
    model, tokenizer = load_policy(config)
    sft_train(model, tokenizer, [(r["prompt"], r["solution"]) for r in sft_rows], config.sft,
              seed=config.seed, progress=progress)
    path = save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "sft")
    print(f"saved {path}")
    return path


def run_train(config: Config, progress: bool = True) -> Path:
    """GRPO from model.name_or_path on the task's questions; evaluates on the held-out split."""
    run_dir = start_run(config)
    _, rl_rows, heldout = task_splits(config)
    model, tokenizer = load_policy(config)
    trainer = GRPOTrainer(model, tokenizer, build_rewards(config), rl_rows, config.grpo, run_dir,
                          seed=config.seed, progress=progress)
    history = trainer.train()
    result = evaluate_chain(model, tokenizer, heldout, config)
    plot_reward_curve(history, run_dir / "reward_curve.png", final=result.greedy_accuracy)
    print(f"held-out greedy accuracy {result.greedy_accuracy:.1%}, pass@{result.k} {result.pass_at_k:.1%}")
    return run_dir / "checkpoints" / f"step-{trainer.global_step}"
