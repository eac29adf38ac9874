"""Training reward models: an outcome RM on preference pairs (Bradley-Terry) and a process RM on
step labels (per-step BCE), their held-out accuracy, and the data they learn from.

Data comes from files (`grpokit.data.reward_data`) or from the policy's own samples graded by a
rule: correct vs incorrect answers to the same question make preference pairs, and a step
labeller (the built-in task's `step_labels`) gives process labels.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from grpokit.run.progress import progress as progress_bar

from grpokit.config import RewardModelConfig
from grpokit.data.reward_data import (
    GradedSample,
    PreferencePair,
    StepLabelledSample,
    pairs_from_graded,
    split_steps,
    write_jsonl,
)
from grpokit.math import bradley_terry_loss, step_bce_loss
from grpokit.rewards.learned import OutcomeRewardModel, ProcessRewardModel
from grpokit.rewards.step_labels import label_steps
from grpokit.rollout import SamplingParams
from grpokit.train.schedule import make_optimizer, warmup_cosine

Example = PreferencePair | StepLabelledSample


class RewardModelDataError(ValueError):
    """No usable reward-model training data could be built; the message says what to change."""


def split_by_prompt(items: list, heldout_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) with every prompt wholly on one side, so accuracy is measured on
    questions the reward model never saw."""
    prompts = sorted({x.prompt for x in items})
    random.Random(f"{seed}-rm-split").shuffle(prompts)
    # At least one question on each side when there are two or more.
    n_heldout = min(len(prompts) - 1, max(1, round(heldout_fraction * len(prompts)))) if len(prompts) > 1 else 0
    heldout = set(prompts[:n_heldout])
    return [x for x in items if x.prompt not in heldout], [x for x in items if x.prompt in heldout]


def _batch_loss(scorer, batch: list[Example], balance: bool = False) -> torch.Tensor:
    prompts = [x.prompt for x in batch]
    if isinstance(scorer, OutcomeRewardModel):
        # One forward over chosen and rejected together: 2B rows, then split.
        scores = scorer.forward(prompts + prompts, [x.chosen for x in batch] + [x.rejected for x in batch])
        return bradley_terry_loss(scores[: len(batch)], scores[len(batch) :])
    logits = scorer.step_logits(prompts, [list(x.steps) for x in batch])
    labels = torch.tensor([float(v) for x in batch for v in x.labels], device=logits[0].device)
    return step_bce_loss(torch.cat(logits), labels, balance=balance)


def fit_reward_model(scorer, train: list[Example], config: RewardModelConfig, seed: int = 0,
                     progress: bool = True, desc: str = "reward model") -> list[float]:
    """Train `scorer.model` in place for config.train.max_steps; returns each step's loss."""
    if not train:
        raise RewardModelDataError("no reward-model training data: no preference pairs or step-labelled samples "
                                   "were built")
    kind_ok = isinstance(scorer, OutcomeRewardModel) == isinstance(train[0], PreferencePair)
    if not kind_ok:
        raise ValueError(f"a {scorer.kind} reward model cannot train on {type(train[0]).__name__} data")
    if getattr(scorer, "head", "score") == "likelihood":  # a frozen LM: only its two-parameter head fits
        return [scorer.fit([x.prompt for x in train], [list(x.steps) for x in train], [list(x.labels) for x in train])]
    model = scorer.model
    optimizer = make_optimizer(model, config.train.learning_rate, 0.0)
    scheduler = warmup_cosine(optimizer, config.train.warmup_steps, config.train.max_steps)
    rng = random.Random(f"{seed}-rm-order")
    order: list[int] = []
    losses = []
    model.train()
    bar = progress_bar(range(config.train.max_steps), desc=desc, unit="step", enabled=progress)
    for _ in bar:
        if len(order) < config.train.batch_size:
            order += rng.sample(range(len(train)), len(train))
        batch = [train[i] for i in order[: config.train.batch_size]]
        del order[: config.train.batch_size]
        loss = _batch_loss(scorer, batch, balance=config.train.balance_step_labels)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"reward-model loss became {loss.item()} at step {len(losses)}; "
                                     "lower reward_model.train.learning_rate")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses


@torch.no_grad()
def evaluate_reward_model(scorer, heldout: list[Example]) -> dict:
    """Outcome: pairwise accuracy (chosen scored strictly above rejected). Process: step-label
    accuracy at threshold 0.5, also on right and wrong steps separately, since most steps are right."""
    if not heldout:
        return {}
    if isinstance(scorer, OutcomeRewardModel):
        prompts = [x.prompt for x in heldout]
        chosen = scorer.scores(prompts, [x.chosen for x in heldout])
        rejected = scorer.scores(prompts, [x.rejected for x in heldout])
        return {"pairwise_accuracy": float((chosen > rejected).float().mean()), "pairs": len(heldout),
                "mean_margin": float((chosen - rejected).mean())}
    predicted, labels = [], []
    for start in range(0, len(heldout), scorer.batch_size):
        batch = heldout[start : start + scorer.batch_size]
        logits = scorer.step_logits([x.prompt for x in batch], [list(x.steps) for x in batch])
        predicted += [bool(v > 0) for row in logits for v in row.tolist()]
        labels += [bool(v) for x in batch for v in x.labels]
    hits = [p == y for p, y in zip(predicted, labels)]
    right = [h for h, y in zip(hits, labels) if y]
    wrong = [h for h, y in zip(hits, labels) if not y]
    return {
        "step_accuracy": sum(hits) / len(hits),
        "step_accuracy_on_right_steps": sum(right) / len(right) if right else float("nan"),
        "step_accuracy_on_wrong_steps": sum(wrong) / len(wrong) if wrong else float("nan"),
        "steps": len(hits),
        "completions": len(heldout),
    }


# --------------------------------------------------------------------------- data from the policy


def sample_completions(engine, rows: list[dict], config: RewardModelConfig, max_new_tokens: int,
                       batch_size: int = 512, progress: bool = True) -> tuple[list[dict], list[str]]:
    """config.data.samples_per_question completions of each row's prompt from the policy, through its
    rollout `engine`: (the row of each sample, the completions)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=config.data.temperature,
                            batch_size=batch_size)
    out_rows, completions = [], []
    chunk = max(1, batch_size // config.data.samples_per_question)
    for start in progress_bar(range(0, len(rows), chunk), desc="sampling for the reward model", unit="batch",
                              enabled=progress and len(rows) > chunk):
        part = rows[start : start + chunk]
        rollout = engine.generate([r["prompt"] for r in part], config.data.samples_per_question, params, part)
        out_rows += rollout.rows
        completions += rollout.completions
    return out_rows, completions


def build_examples(kind: str, rows: list[dict], completions: list[str], grade: Callable[[list[dict], list[str]],
                   list[bool]], step_labeller: Callable[[dict, list[str]], list[bool]] | None,
                   config: RewardModelConfig, seed: int) -> list[Example]:
    """Graded samples -> training examples: preference pairs (outcome) or step-labelled samples (process)."""
    if kind == "outcome":
        graded = [GradedSample(r["prompt"], c, ok) for r, c, ok in zip(rows, completions, grade(rows, completions))]
        return pairs_from_graded(graded, seed=seed, max_pairs_per_prompt=config.data.max_pairs_per_prompt)
    if step_labeller is None:
        raise ValueError("process labels need a step labeller; for data other than the built-in task, "
                         "train the PRM from a step-labelled file (grpokit train-rm --process --data FILE)")
    examples = []
    for row, completion in zip(rows, completions):
        steps = split_steps(completion, config.step_delimiter) or [completion]
        examples.append(StepLabelledSample(row["prompt"], tuple(steps), tuple(step_labeller(row, steps))))
    return examples


def hard_negative_examples(kind: str, rows: list[dict], completions: list[str],
                           make_twin: Callable[[dict, str, random.Random], str | None] | None,
                           step_labeller: Callable[[dict, list[str]], list[bool]] | None,
                           config: RewardModelConfig, seed: int) -> list[Example]:
    """config.data.hard_negatives one-slip twins of each distinct right solution among `completions`
    (`make_twin` gives None for any other): outcome pairs (the solution over its twin), or the
    twins with the rule's step labels (process). The surface is the policy's own; only the
    arithmetic of one step differs, which is what a reward model has to learn to see."""
    if make_twin is None or (kind == "process" and step_labeller is None):
        raise ValueError("reward_model.data.hard_negatives needs a task whose rule makes one-slip twins and labels "
                         "their steps (the built-in task); set it to 0")
    rng = random.Random(f"{seed}-hard-negatives")
    seen: set[tuple[str, str]] = set()
    examples: list[Example] = []
    for row, completion in zip(rows, completions):
        if (row["prompt"], completion) in seen:
            continue
        seen.add((row["prompt"], completion))
        twins = [make_twin(row, completion, rng) for _ in range(config.data.hard_negatives)]
        for twin in dict.fromkeys(t for t in twins if t is not None):  # distinct, in order
            if kind == "outcome":
                examples.append(PreferencePair(row["prompt"], completion, twin))
            else:
                steps = split_steps(twin, config.step_delimiter) or [twin]
                examples.append(StepLabelledSample(row["prompt"], tuple(steps), tuple(step_labeller(row, steps))))
    return examples


def rollout_step_examples(engine, rows: list[dict], completions: list[str], grade, config: RewardModelConfig,
                          max_new_tokens: int, progress: bool = False) -> tuple[list[StepLabelledSample], dict]:
    """Process labels from rollouts (Math-Shepherd): each step prefix of each sampled completion
    is continued config.label.rollouts times through the policy's engine and graded; a step is
    right when any continuation reaches the reference. Returns (examples, label_steps' stats)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=config.data.temperature)

    def complete(prefixes: list[str], n: int) -> list[list[str]]:
        done = engine.generate(prefixes, n, params).completions
        return [done[i * n : (i + 1) * n] for i in range(len(prefixes))]

    by_prompt: dict[str, tuple[dict, list[str]]] = {}
    for row, completion in zip(rows, completions):
        by_prompt.setdefault(row["prompt"], (row, []))[1].append(completion)
    grouped = list(by_prompt.values())
    records, stats = label_steps([r for r, _ in grouped], [c for _, c in grouped], complete, grade,
                                 config.label.rollouts, config.step_delimiter,
                                 batch_size=max(1, 512 // config.label.rollouts),
                                 skip_uniform=config.label.skip_uniform)
    return [StepLabelledSample(r["prompt"], tuple(r["steps"]), tuple(r["labels"])) for r in records], stats


def example_record(example: Example) -> dict:
    """The JSONL form of an example: the same fields `grpokit train-rm --data` reads."""
    record = asdict(example)
    if isinstance(example, StepLabelledSample):
        record["steps"], record["labels"] = list(example.steps), [int(v) for v in example.labels]
    return record


class ReplayBuffer:
    """Iterative GRPO's replay (Algorithm 1): after each reward-model refresh a random
    `fraction` of that refresh's new data joins the buffer, so it holds that share of all
    historical data; the next refresh trains on its new data plus the whole buffer.
    Persisted as JSONL in the run directory."""

    def __init__(self, path: str | Path, fraction: float, seed: int = 0):
        self.path, self.fraction, self.seed = Path(path), fraction, seed
        self.items: list[Example] = []

    def add(self, new: list[Example], round_index: int) -> None:
        keep = math.ceil(self.fraction * len(new))  # at least one of a small round, when fraction > 0
        self.items += random.Random(f"{self.seed}-replay-{round_index}").sample(new, keep)
        write_jsonl(self.path, [example_record(x) for x in self.items])

    def load(self) -> None:
        """Read back exactly what `add` wrote (this file is ours: no re-splitting, and an empty
        completion, which a policy can sample, stays an example)."""
        self.items = []
        if not self.path.is_file():
            return
        for line in self.path.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            if "steps" in record:
                self.items.append(StepLabelledSample(record["prompt"], tuple(record["steps"]),
                                                     tuple(bool(v) for v in record["labels"])))
            else:
                self.items.append(PreferencePair(record["prompt"], record["chosen"], record["rejected"]))


def new_scorer(model, tokenizer, kind: str, config: RewardModelConfig):
    if kind == "process":
        return ProcessRewardModel(model, tokenizer, config.step_delimiter, config.batch_size)
    return OutcomeRewardModel(model, tokenizer, config.batch_size)
