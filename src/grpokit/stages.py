"""The building blocks every entry point shares: seeding, the task's data splits,
rewards from the config, the policy, evaluation. `demo`, `sft` and `train` compose them."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

from grpokit.config import Config, ConfigError, save_config
from grpokit.data import arithmetic
from grpokit.eval import evaluate
from grpokit.models import (
    build_char_tokenizer,
    build_tiny_model,
    load_model_and_tokenizer,
)
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
                 ref_model=None, reward_scorer=None):
    """The trainer config.algo names: GRPO, or the PPO baseline on the same loop. An outcome
    `reward_scorer` joins the rewards by weight; a process one gives process supervision."""
    rewards = build_rewards(config)
    process = None
    if reward_scorer is not None and reward_scorer.kind == "outcome":
        rewards.append(WeightedReward("reward_model", reward_scorer, config.reward_model.weight, None))
    elif reward_scorer is not None:
        process = reward_scorer
    common = dict(seed=config.seed, progress=progress, ref_model=ref_model)
    if config.algo == "ppo":
        from grpokit.train.ppo import PPOTrainer

        return PPOTrainer(model, tokenizer, rewards, rows, config.grpo, run_dir, ppo=config.ppo, **common)
    from grpokit.train.grpo import GRPOTrainer

    return GRPOTrainer(model, tokenizer, rewards, rows, config.grpo, run_dir, process_reward=process, **common)


def verifier(config: Config):
    """grade(rows, completions) -> [bool]: the rule that labels reward-model data. The configured
    rule-based rewards when there are any (correct = weighted sum > 0.5), else the data's own checker."""
    if config.rewards:
        from grpokit.rewards.scoring import row_columns, score_completions

        rewards = build_rewards(config)

        def grade(rows: list[dict], completions: list[str]) -> list[bool]:
            result = score_completions(rewards, [r["prompt"] for r in rows], completions, row_columns(rows))
            return [bool(ok) and float(t) > 0.5 for t, ok in zip(result.total, result.valid)]

        return grade
    check = arithmetic.chain_accuracy if not config.data.sources else get_reward_function("math_accuracy")

    def grade_by_data(rows: list[dict], completions: list[str]) -> list[bool]:
        scores = check([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])
        return [s is not None and float(s) > 0.5 for s in scores]

    return grade_by_data


def chain_step_labeller(row: dict, steps: list[str]) -> list[bool]:
    """Process labels of the built-in task: which step first goes wrong."""
    question = row["prompt"].strip().removeprefix("Q:").strip()
    return arithmetic.step_labels(question, steps, row["answer"])


def reward_model_stage(config: Config, policy, tokenizer, rows: list[dict], run_dir: Path, progress: bool = True,
                       path: str | None = None):
    """The reward model config.reward_model names, wrapped for training and scoring: loaded from
    `path` (default reward_model.path), or new from the policy's backbone (then untrained)."""
    from grpokit.models.loading import resolve_device
    from grpokit.rewards.learned import as_scorer, load_reward_model, new_reward_model
    from grpokit.train.iterative import RewardModelStage
    from grpokit.train.reward_model import new_scorer

    rm = config.reward_model
    path = rm.path if path is None else path
    if path:
        model, rm_tokenizer, info = load_reward_model(path, rm.device, config.model.dtype)
        if info.kind != rm.kind:
            raise ConfigError(f"reward_model.kind is {rm.kind!r} but {path} holds a {info.kind} reward model")
        if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
            print("grpokit: the reward model's tokenizer differs from the policy's; it reads completions as text, "
                  "re-tokenized, and step ends are mapped back to the policy's tokens", file=sys.stderr)
        scorer = as_scorer(model, rm_tokenizer, info, rm.batch_size)
    else:
        model = new_reward_model(policy, tokenizer, rm.kind).to(resolve_device(rm.device))
        scorer = new_scorer(model, tokenizer, rm.kind, rm)
    labeller = chain_step_labeller if not config.data.sources else None
    shuffled = random.Random(f"{config.seed}-rm-questions").sample(rows, len(rows))
    return RewardModelStage(scorer, tokenizer, rm, shuffled, verifier(config), labeller,
                            config.grpo.max_completion_length, run_dir, config.seed, progress)
