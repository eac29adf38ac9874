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
               from wrong? The AUC of the first step's log-probability, then a two-parameter logistic
               regression on each step's running sum of log-probabilities, scored like the PRM

Step kinds: `step` a chain line, `ans` the answer line after a chain, `direct` a lone answer; `+` right,
`-first` the first wrong step, `-later` a step after it (wrong by the prefix rule).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from grpokit.config import RewardModelConfig
from grpokit.config.schema import RewardModelTrainConfig
from grpokit.data.reward_data import StepLabelledSample
from grpokit.models.loading import load_model_and_tokenizer
from grpokit.rewards.learned import encode, new_reward_model
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


def step_log_probs(model, tokenizer, samples: list[StepLabelledSample]) -> list[list[float]]:
    """Each step's summed log-probability under `model`, given everything before it."""
    out = []
    with torch.no_grad():
        for start in range(0, len(samples), 64):
            batch = samples[start : start + 64]
            inputs = encode(tokenizer, [x.prompt for x in batch], [list(x.steps) for x in batch])
            logits = model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask).logits[:, :-1].float()
            token_lp = torch.gather(F.log_softmax(logits, -1), 2, inputs.input_ids[:, 1:, None])[..., 0]
            for i, sample in enumerate(batch):
                begin = len(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]) - 1
                row = []
                for end in inputs.step_positions[i]:  # token k is predicted at column k-1
                    row.append(float(token_lp[i, begin:end].sum()))
                    begin = end
                out.append(row)
    return out


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
        print(f"  held-out: {summary(accuracy_by_kind(first(heldout), prm_logits(scorer, first(heldout))))}")
    if "likelihood" in probes:
        model, tokenizer = load_model_and_tokenizer(args.init, "fp32", "cpu", chat_template="off")
        model.eval()
        firsts = first(heldout)
        scores = [row[0] for row in step_log_probs(model, tokenizer, firsts)]
        right = [s for s, x in zip(scores, firsts) if x.labels[0]]
        wrong = [s for s, x in zip(scores, firsts) if not x.labels[0]]
        print(f"likelihood: AUC of the first step's log-probability, right over wrong: {auc(right, wrong):.3f} "
              f"({len(right)} right, {len(wrong)} wrong first steps)")
        running = lambda rows: [torch.tensor(r).cumsum(0).tolist() for r in rows]  # noqa: E731
        fit_rows = train[:6000]
        x = torch.tensor([v for row in running(step_log_probs(model, tokenizer, fit_rows)) for v in row])
        y = torch.tensor([float(v) for s in fit_rows for v in s.labels])
        center, scale = x.mean(), x.std()  # a confident model's sums reach -30 and below: fit on z-scores
        x = (x - center) / scale
        a, b = torch.zeros((), requires_grad=True), torch.zeros((), requires_grad=True)
        optimizer = torch.optim.LBFGS([a, b], max_iter=200, line_search_fn="strong_wolfe")

        def closure():
            optimizer.zero_grad()
            loss = F.binary_cross_entropy_with_logits(a * x + b, y)
            loss.backward()
            return loss

        optimizer.step(closure)
        a, b = a.item() / scale.item(), b.item() - a.item() * center.item() / scale.item()  # back to raw sums
        held_rows = [[a * v + b for v in row] for row in running(step_log_probs(model, tokenizer, heldout))]
        print(f"likelihood, logistic regression on the running sum (logit = {a:.3f} x sum {b:+.3f}):")
        print(f"  held-out: {summary(accuracy_by_kind(heldout, held_rows))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
