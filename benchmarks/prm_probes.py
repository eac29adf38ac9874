"""Why the demo's process reward model stops near 76% of steps: four probes on one seed's PRM data.

    python benchmarks/prm_probes.py --data runs/levers/process-4x-data-steps-s0/reward_model_data/round-0.jsonl \
        --init runs/seed0/checkpoints/sft --seed 0 [--probes fit,first-step,likelihood] [--steps 800]

--data is a `train-rm --process` run's own step-labelled samples (reward_model_data/round-0.jsonl), split
by question as train-rm splits it; --init is the reward model's backbone (pi_SFT, or a larger model).

  fit          a PRM trained for --steps at --lr: held-out and training step accuracy side by side
               (equal: the PRM underfits, more data of the same kind will not fix it), by kind of step
  first-step   the same PRM trained on the first step of worked solutions only: the simplest check
               there is (is "15+1-8" what "17-2+1-8" reduces to?), and how many wrong ones it catches
  likelihood   no training of the backbone: does --init's own log-probability of a step tell right steps
               from wrong? The AUC of the first step's log-probability, then the likelihood head
               (reward_model.model.head: likelihood): a and b of a * running sum + b fit on 6,000
               training samples, scored like the PRM

Step kinds: `step` a chain line, `ans` the answer line after a chain, `direct` a lone answer; `+` right,
`-first` the first wrong step, `-later` a step after it (wrong by the prefix rule).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from grpokit.config import RewardModelConfig
from grpokit.config.schema import RewardModelTrainConfig
from grpokit.data.reward_data import StepLabelledSample
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.rewards.learned import new_reward_model
from grpokit.rewards.likelihood_prm import LikelihoodProcessRewardModel
from grpokit.train.reward_model import fit_reward_model, new_scorer, split_by_prompt


def kind_of(sample: StepLabelledSample, j: int) -> str:
    where = "direct" if len(sample.steps) == 1 else ("ans" if sample.steps[j].startswith("A:") else "step")
    if sample.labels[j]:
        return where + "+"
    return where + ("-first" if j == 0 or sample.labels[j - 1] else "-later")


def accuracy_by_kind(samples: list[StepLabelledSample], logits: list[list[float]]) -> dict[str, list[bool]]:
    hits: dict[str, list[bool]] = {}
    for sample, row in zip(samples, logits):
        for j, (label, logit) in enumerate(zip(sample.labels, row)):
            hits.setdefault(kind_of(sample, j), []).append((logit > 0) == label)
    return hits


def summary(hits: dict[str, list[bool]]) -> str:
    every = [h for group in hits.values() for h in group]
    wrong = [h for name, group in hits.items() if "-" in name for h in group]
    parts = ", ".join(f"{name} {sum(g) / len(g):.1%} (n={len(g)})" for name, g in sorted(hits.items()))
    return f"steps {sum(every) / len(every):.1%}, wrong caught {sum(wrong) / max(1, len(wrong)):.1%}; {parts}"


def prm_logits(scorer, samples: list[StepLabelledSample]) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for start in range(0, len(samples), 64):
            batch = samples[start : start + 64]
            rows = scorer.step_logits([x.prompt for x in batch], [list(x.steps) for x in batch])
            out += [row.tolist() for row in rows]
    return out


def train_prm(init: str, train: list, steps: int, lr: float, seed: int):
    torch.manual_seed(seed)
    backbone, tokenizer = load_model_and_tokenizer(init, "fp32", "cpu", chat_template="off")
    config = RewardModelConfig(kind="process", train=RewardModelTrainConfig(learning_rate=lr, max_steps=steps))
    scorer = new_scorer(new_reward_model(backbone, tokenizer, "process"), tokenizer, "process", config)
    losses = fit_reward_model(scorer, train, config, seed=seed, progress=False)
    return scorer, sum(losses[-100:]) / len(losses[-100:])


def auc(right: list[float], wrong: list[float]) -> float:
    """P(a right one scores above a wrong one), ties half."""
    pairs = [(r > w) + 0.5 * (r == w) for r in right for w in wrong]
    return sum(pairs) / len(pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probes", default="fit,first-step,likelihood")
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in Path(args.data).open()]
    samples = [StepLabelledSample(r["prompt"], tuple(r["steps"]), tuple(map(bool, r["labels"]))) for r in records]
    train, heldout = split_by_prompt(samples, 0.1, args.seed)
    probes = args.probes.split(",")
    if "fit" in probes:
        scorer, loss = train_prm(args.init, train, args.steps, args.lr, args.seed)
        print(f"fit, {args.steps} steps at lr {args.lr:g}, last-100 loss {loss:.3f}")
        print(f"  held-out: {summary(accuracy_by_kind(heldout, prm_logits(scorer, heldout)))}")
        print(f"  training: {summary(accuracy_by_kind(train[:3000], prm_logits(scorer, train[:3000])))}")
    first = lambda xs: [StepLabelledSample(x.prompt, x.steps[:1], x.labels[:1]) for x in xs  # noqa: E731
                        if len(x.steps) > 1 and not x.steps[0].startswith("A:")]
    if "first-step" in probes:
        scorer, loss = train_prm(args.init, first(train), args.steps, args.lr, args.seed)
        print(f"first-step, {args.steps} steps at lr {args.lr:g}, last-100 loss {loss:.3f}")
        hits = accuracy_by_kind(first(heldout), prm_logits(scorer, first(heldout)))
        print(f"  held-out: {summary({name.replace('direct', 'first step'): h for name, h in hits.items()})}")
    if "likelihood" in probes:
        model, tokenizer = load_model_and_tokenizer(args.init, "fp32", "cpu", chat_template="off")
        scorer = LikelihoodProcessRewardModel(model, tokenizer, "\n")  # reward_model.model.head: likelihood
        firsts = first(heldout)
        scores = [float(row[0]) for row in scorer.step_log_prob_sums([x.prompt for x in firsts],
                                                                       [list(x.steps) for x in firsts])]
        right = [s for s, x in zip(scores, firsts) if x.labels[0]]
        wrong = [s for s, x in zip(scores, firsts) if not x.labels[0]]
        print(f"likelihood: AUC of the first step's log-probability, right over wrong: {auc(right, wrong):.3f} "
              f"({len(right)} right, {len(wrong)} wrong first steps)")
        fit_rows = train[:6000]
        scorer.fit([x.prompt for x in fit_rows], [list(x.steps) for x in fit_rows], [list(x.labels) for x in fit_rows])
        held_rows = [row.tolist() for row in scorer.step_logits([x.prompt for x in heldout],
                                                                [list(x.steps) for x in heldout])]
        print(f"likelihood head, fit on {len(fit_rows)} training samples (logit = {scorer.weight:.3f} x running sum "
              f"{scorer.bias:+.3f}):")
        print(f"  held-out: {summary(accuracy_by_kind(heldout, held_rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
