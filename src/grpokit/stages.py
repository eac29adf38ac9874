"""The building blocks every entry point shares: seeding, the task's data splits,
rewards from the config, the policy, evaluation. `demo`, `sft` and `train` compose them."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from grpokit.config import Config, save_config
from grpokit.data import arithmetic
from grpokit.eval import evaluate
from grpokit.models import build_char_tokenizer, build_tiny_model, load_model_and_tokenizer
from grpokit.rewards import WeightedReward, get_reward_function

ASCII_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def chain_task(config: Config) -> arithmetic.ChainTask:
    t = config.task
    return arithmetic.ChainTask(t.min_ops, t.max_ops, t.max_start, t.max_operand, t.max_value, t.heldout_percent)


def task_splits(config: Config) -> tuple[list[dict], list[dict], list[dict]]:
    """(SFT rows with solutions, RL rows with answers only, held-out eval rows)."""
    task, t, seed = chain_task(config), config.task, config.seed
    sft = arithmetic.make_sft_rows(arithmetic.sample_questions(t.num_sft_examples, seed, task, "train"),
                                   t.sft_direct_fraction, seed)
    rl = [{k: r[k] for k in ("prompt", "answer")}
          for r in arithmetic.make_rows(arithmetic.sample_questions(t.num_rl_questions, seed + 1, task, "train"))]
    heldout = arithmetic.make_rows(arithmetic.sample_questions(t.num_eval_questions, 0, task, "heldout"))
    return sft, rl, heldout


def build_rewards(config: Config) -> list[WeightedReward]:
    return [WeightedReward(r.name, get_reward_function(r.name), r.weight, r.timeout_s) for r in config.rewards]


def evaluate_chain(model, tokenizer, rows: list[dict], config: Config):
    e = config.eval
    return evaluate(model, tokenizer, rows, arithmetic.extract_answer, config.grpo.max_completion_length,
                    k=e.k, temperature=e.temperature, batch_size=e.batch_size)


def load_policy(config: Config):
    """(model, tokenizer): model.name_or_path through the hub loader, or a fresh tiny model."""
    m = config.model
    if m.name_or_path:
        return load_model_and_tokenizer(m.name_or_path, m.dtype, m.device, m.attn_implementation,
                                        m.trust_remote_code)
    t = m.tiny
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET if t.alphabet == "arithmetic" else ASCII_ALPHABET)
    model = build_tiny_model(tokenizer, t.architecture, t.hidden_size, t.num_layers, t.num_heads,
                             t.intermediate_size, seed=config.seed)
    return model, tokenizer


def start_run(config: Config) -> Path:
    """Create the run directory, save config.yaml, seed everything."""
    run_dir = Path(config.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, run_dir / "config.yaml")
    seed_everything(config.seed)
    return run_dir


def make_trainer(config: Config, model, tokenizer, rows: list[dict], run_dir: Path, progress: bool = True,
                 ref_model=None):
    """The trainer config.algo names: GRPO, or the PPO baseline on the same loop."""
    common = dict(seed=config.seed, progress=progress, ref_model=ref_model)
    if config.algo == "ppo":
        from grpokit.train.ppo import PPOTrainer

        return PPOTrainer(model, tokenizer, build_rewards(config), rows, config.grpo, run_dir, ppo=config.ppo,
                          **common)
    from grpokit.train.grpo import GRPOTrainer

    return GRPOTrainer(model, tokenizer, build_rewards(config), rows, config.grpo, run_dir, **common)
