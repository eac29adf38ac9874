"""`grpokit sft` and `grpokit train`: the demo's stages, one at a time, on any checkpoint."""

from __future__ import annotations

from pathlib import Path

from grpokit.checkpoint import save_checkpoint
from grpokit.config import Config, save_config
from grpokit.demo import build_rewards, evaluate_chain, seed_everything, task_splits
from grpokit.eval.plots import plot_reward_curve
from grpokit.models import build_char_tokenizer, build_tiny_model, load_model_and_tokenizer
from grpokit.data import arithmetic
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.sft import sft_train


def load_policy(config: Config):
    """model.name_or_path through the hub loader, or a fresh tiny model when it is empty."""
    m = config.model
    if m.name_or_path:
        return load_model_and_tokenizer(m.name_or_path, m.dtype, m.device, m.attn_implementation,
                                        m.trust_remote_code)
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    t = m.tiny
    return build_tiny_model(tokenizer, t.architecture, t.hidden_size, t.num_layers, t.num_heads,
                            t.intermediate_size, seed=config.seed), tokenizer


def _start(config: Config) -> Path:
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    seed_everything(config.seed)
    return run_dir


def run_sft(config: Config, progress: bool = True) -> Path:
    run_dir = _start(config)
    sft_rows, _, _ = task_splits(config)
    model, tokenizer = load_policy(config)
    sft_train(model, tokenizer, [(r["prompt"], r["solution"]) for r in sft_rows], config.sft,
              seed=config.seed, progress=progress)
    path = save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "sft")
    print(f"saved {path}")
    return path


def run_train(config: Config, progress: bool = True) -> Path:
    run_dir = _start(config)
    _, rl_rows, heldout = task_splits(config)
    model, tokenizer = load_policy(config)
    trainer = GRPOTrainer(model, tokenizer, build_rewards(config), rl_rows, config.grpo, run_dir,
                          seed=config.seed, progress=progress)
    history = trainer.train()
    result = evaluate_chain(model, tokenizer, heldout, config)
    plot_reward_curve(history, run_dir / "reward_curve.png", final=result.greedy_accuracy)
    print(f"held-out greedy accuracy {result.greedy_accuracy:.1%}, pass@{result.k} {result.pass_at_k:.1%}")
    return run_dir / "checkpoints" / f"step-{trainer.global_step}"
