"""The building blocks every entry point shares: seeding, the run directory, rewards from the
config, the policy, a run's setup (RunSetup), the rollout engine, the trainer and the reward model.
stages.py and rl.py compose them."""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grpokit.config import Config, ConfigError, save_config, to_dict
from grpokit.run.loggers import make_loggers
from grpokit.seeds import derive_seed
from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model, load_model_and_tokenizer
from grpokit.models.loading import resolve_device
from grpokit.models.device import model_device
from grpokit.models.lora import merged_copy
from grpokit.models.precision import compute_dtype, resolve_precision, set_compute_dtype
from grpokit.models.value import trained_dtype
from grpokit.rewards import WeightedReward
from grpokit.rewards.learned import load_reward_model, new_reward_model
from grpokit.rewards.likelihood_prm import LikelihoodProcessRewardModel
from grpokit.rewards.scorers import as_scorer
from grpokit.rewards.scoring import configured_rewards, row_columns, score_completions
from grpokit.rollout import make_engine
from grpokit.tasks import Task
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.iterative import RewardModelStage
from grpokit.train.ppo import PPOTrainer
from grpokit.train.reward_model import new_scorer

ASCII_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
# Per-run logs a fresh (not resumed) run starts without.
RUN_LOGS = ("metrics.jsonl", "reward_model_metrics.jsonl", "replay_buffer.jsonl")


@dataclass
class RunSetup:
    """What a stage's steps read, built once (for `grpokit train`, by rl.prepare()): the config, the
    run directory, the task, the policy, its tokenizer and the rows it trains on, and what RL adds."""
    config: Config
    run_dir: Path
    task: Task
    model: Any
    tokenizer: Any
    rows: list[dict]
    progress: bool = True
    engine: Any = None  # the rollout engine evaluation and the reward model's data sample from
    ref_model: Any = None  # a frozen pi_ref the trainer cannot make itself (None: it makes its own)
    heldout: list[dict] = field(default_factory=list)  # the held-out questions evaluated before and after
    checkpoint: Path | None = None  # the checkpoint a resumed run continues from
    boundary: Path | None = None  # the iteration boundary it continues from (iterative.iterations > 1)
    model_len: int | None = None  # the engine's max_model_len where it holds its own weights (vLLM)
    ray: Any = None  # the run's RayLaunch (distributed.launcher=ray, rank 0)
    validation: list[dict] = field(default_factory=list)  # the validation questions (settings are chosen on)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_rewards(config: Config, tokenizer=None) -> list[WeightedReward]:
    """The configured rewards; a reward factory that counts tokens (overlong_penalty) gets `tokenizer`."""
    return configured_rewards(config, tokenizer)


def load_policy(config: Config, path: str | None = None, trainable: bool = True):
    """(model, tokenizer): `path` or model.name_or_path through the hub loader, or a fresh tiny model.
    A `trainable` model holds its weights in model.master_dtype, a frozen one in model.dtype; both
    compute in model.dtype (models/precision.py)."""
    m = config.model
    master = m.master_dtype if trainable else "same"
    if path or m.name_or_path:
        model, tokenizer = load_model_and_tokenizer(path or m.name_or_path, m.dtype, m.device, m.attn_implementation,
                                                    m.trust_remote_code, master_dtype=master, eos_token=m.eos_token,
                                                    chat_template=config.data.chat_template)
        return model, with_chat_template_file(tokenizer, config.data.chat_template_file)
    t = m.tiny
    alphabets = {"arithmetic-tir": arithmetic.TIR_ALPHABET, "arithmetic": arithmetic.ALPHABET, "ascii": ASCII_ALPHABET}
    tokenizer = build_char_tokenizer(alphabets[t.alphabet])
    model = build_tiny_model(tokenizer, t.architecture, t.hidden_size, t.num_layers, t.num_heads,
                             t.intermediate_size, seed=config.seed)
    device = resolve_device(m.device)
    precision = resolve_precision(m.dtype, master, device)
    tokenizer = with_chat_template_file(tokenizer, config.data.chat_template_file)
    return set_compute_dtype(model.to(device=device, dtype=precision.master), precision.compute), tokenizer


def with_chat_template_file(tokenizer, path: str):
    """`tokenizer` with data.chat_template_file's template as its chat template (when set)."""
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"data.chat_template_file={path!r} is no file: give a Jinja chat template file")
        tokenizer.chat_template = Path(path).read_text()
    return tokenizer


def start_run(config: Config, fresh: bool = False, write: bool = True) -> Path:
    """Create the run directory, save config.yaml, seed everything; a `fresh` run drops the
    per-run logs an earlier run left there. `write`=False (ranks other than 0) only seeds."""
    run_dir = Path(config.output_dir)
    if not write:
        seed_everything(config.seed)
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        for stale in RUN_LOGS:
            (run_dir / stale).unlink(missing_ok=True)
    save_config(config, run_dir / "config.yaml")
    seed_everything(config.seed)
    return run_dir


def make_trainer(run: RunSetup, engine=None, reward_scorer=None, remote=None):
    """The training loop with the algorithm config.algo names: GRPO, or the PPO baseline, over the
    run's policy, rows and reference, sampling from `engine` (default: a new one for the policy). An
    outcome `reward_scorer` joins the rewards by weight; a process one gives process supervision."""
    config = run.config
    rewards = build_rewards(config, run.tokenizer)
    process = None
    if reward_scorer is not None and reward_scorer.kind == "outcome":
        rewards.append(WeightedReward("reward_model", reward_scorer, config.reward_model.weight, None))
    elif reward_scorer is not None:
        process = reward_scorer
    engine = engine or make_engine(config.rollout, run.model, run.tokenizer, config.seed)
    logger = make_loggers(config.report_to, run.run_dir, Path(config.output_dir).name, to_dict(config))
    common = dict(seed=config.seed, progress=run.progress, ref_model=run.ref_model, engine=engine, logger=logger,
                  rollout_config=config.rollout, save_merged=config.model.lora.save_merged, remote=remote)
    args = (run.model, run.tokenizer, rewards, run.rows, config.grpo, run.run_dir)
    if config.algo == "ppo":
        return PPOTrainer(*args, ppo=config.ppo, **common)
    return GRPOTrainer(*args, process_reward=process, **common)


def verifier(config: Config, task: Task, tokenizer=None):
    """grade(rows, completions) -> [bool]: the rule that labels reward-model data. The configured
    rule-based rewards when there are any (correct = weighted sum > 0.5), else the task's own rule."""
    if not config.rewards:
        return task.grade
    rewards = build_rewards(config, tokenizer)

    def grade(rows: list[dict], completions: list[str]) -> list[bool]:
        result = score_completions(rewards, [r["prompt"] for r in rows], completions, row_columns(rows))
        return [bool(ok) and float(t) > 0.5 for t, ok in zip(result.total, result.valid)]

    return grade


def _note_own_tokenizer(rm_tokenizer, tokenizer, what: str) -> None:
    """Say once, on stderr, that a reward model reads completions with a tokenizer of its own."""
    if rm_tokenizer.get_vocab() != tokenizer.get_vocab():
        print(f"grpokit: {what}; it reads completions as text, re-tokenized, and step ends are mapped back to "
              "the policy's tokens", file=sys.stderr)


def reward_model_backbone(config: Config, policy, tokenizer):
    """(causal LM, tokenizer) whose backbone a new reward model copies, by reward_model.model.init: the
    policy (pi_SFT, as DeepSeekMath), a fresh tiny model on the policy's tokenizer, or a checkpoint
    with its own tokenizer. The tiny one holds and computes in the policy's dtypes, like the policy's copy."""
    spec = config.reward_model.model
    if spec.init == "checkpoint":
        m = config.model
        model, rm_tokenizer = load_model_and_tokenizer(spec.path, m.dtype, config.reward_model.device,
                                                       m.attn_implementation, m.trust_remote_code,
                                                       master_dtype=m.master_dtype, chat_template="off")
        _note_own_tokenizer(rm_tokenizer, tokenizer,
                            f"the reward model from reward_model.model.path {spec.path} has its own tokenizer")
        return model, rm_tokenizer
    if spec.init == "tiny":
        architecture = policy.config.model_type if policy.config.model_type in ("llama", "qwen2") else "llama"
        # its own seed, not the run's random streams (manual_seed reseeds every CUDA generator too)
        with torch.random.fork_rng(devices=range(torch.cuda.device_count())):
            model = build_tiny_model(tokenizer, architecture, spec.hidden_size, spec.num_layers, spec.num_heads,
                                     spec.intermediate_size, seed=derive_seed(config.seed, "reward-model"))
        model = model.to(device=model_device(policy), dtype=trained_dtype(policy))
        return set_compute_dtype(model, compute_dtype(policy)), tokenizer
    return policy, tokenizer


def reward_model_stage(run: RunSetup, path: str | None = None) -> RewardModelStage:
    """The reward model config.reward_model names, wrapped for training (on samples of the run's policy
    from its engine, over its rows) and scoring: loaded from `path` (default reward_model.path), or new
    (then untrained) from the backbone reward_model.model names."""
    config, policy, tokenizer = run.config, run.model, run.tokenizer
    rm = config.reward_model
    path = rm.path if path is None else path
    if path:
        retrained = config.iterative.iterations > 1  # iterative GRPO trains it on: fp32 master weights
        model, rm_tokenizer, info = load_reward_model(path, rm.device, config.model.dtype,
                                                      config.model.master_dtype if retrained else "same")
        if info.kind != rm.kind:
            raise ConfigError(f"reward_model.kind is {rm.kind!r} but {path} holds a {info.kind} reward model")
        _note_own_tokenizer(rm_tokenizer, tokenizer, "the reward model's tokenizer differs from the policy's")
        scorer = as_scorer(model, rm_tokenizer, info, rm.batch_size)
    elif rm.model.head == "likelihood":  # the backbone's own LM, frozen: a copy, since the policy trains on
        backbone, rm_tokenizer = reward_model_backbone(config, policy, tokenizer)
        # pi_SFT's weights now, LoRA merged in: it saves as a whole causal LM, and a resume loads that, never pi_theta
        model = (merged_copy(backbone) if backbone is policy else backbone).to(resolve_device(rm.device))
        scorer = LikelihoodProcessRewardModel(model, rm_tokenizer, rm.step_delimiter, rm.batch_size)
    else:
        backbone, rm_tokenizer = reward_model_backbone(config, policy, tokenizer)
        model = new_reward_model(backbone, rm_tokenizer, rm.kind).to(resolve_device(rm.device))
        scorer = new_scorer(model, rm_tokenizer, rm.kind, rm)
    shuffled = random.Random(f"{config.seed}-rm-questions").sample(run.rows, len(run.rows))
    return RewardModelStage(scorer, tokenizer, rm, shuffled, verifier(config, run.task, tokenizer),
                            run.task.step_labeller, config.grpo.max_completion_length, run.run_dir, config.seed,
                            run.progress, engine=run.engine, hard_negative=run.task.hard_negative,
                            replay_fraction=config.iterative.replay_fraction)
