"""Rule-based reward vs learned reward models on the demo task, per seed, on one pi_SFT each.

    python benchmarks/reward_models.py --seeds 0,1,2 [--out runs/rm] [--sft-from runs/seed{seed}] [--jobs 2]

For each seed it runs, in fresh `grpokit demo` subprocesses, each variant below starting from
the same pi_SFT (`--sft.checkpoint`; the SFT stage is skipped), unless that run's summary.json is
already there; then prints one markdown table. Every variant samples the same number of policy
completions (150 steps x 16 questions x 8), so outcome and process supervision compare at equal cost.

  rule       the verifier (the plain demo; read from the --sft-from run's own summary.json)
  orm        --reward model: an outcome RM trained on pi_SFT's graded samples, GRPO's only reward
  prm        --supervision process: a process RM's step scores, process advantages (eq. 6)
  orm-iter2  --iterative 2: the outcome RM, refreshed once on the new policy's samples (10% replay);
             two iterations of 75 steps, so the same 150 steps in all
  prm-iter2  --supervision process --iterative 2: the same with the process RM

--rm-init PATH initialises every variant's reward model from that checkpoint ({seed} is replaced;
reward_model.model.init=checkpoint), e.g. a larger pi_SFT; --prm-head likelihood gives the process RMs
the likelihood head (reward_model.model.head); --variants runs a subset.
--jobs runs that many variants side by side, one thread each. With --breakdown it also prints each
initial reward model's held-out accuracy by kind of example, and the issue's targets table: the
outcome RM's pairwise accuracy (all pairs, and right-worked vs wrong-worked), the process RM's step
accuracy and share of wrong steps caught, process vs outcome supervision, and 2 iterations vs 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VARIANTS = {"orm": ["--reward", "model"], "prm": ["--supervision", "process"],
            "orm-iter2": ["--iterative", "2"], "prm-iter2": ["--supervision", "process", "--iterative", "2"]}


def run_variant(seed: int, name: str, sft_run: Path, out: Path, rm_init: str = "", prm_head: str = "score") -> dict:
    run_dir = out / f"{name}-s{seed}"
    if not (run_dir / "summary.json").is_file():
        init = (["--reward_model.model.init=checkpoint", f"--reward_model.model.path={rm_init.format(seed=seed)}"]
                if rm_init else [])
        init += [f"--reward_model.model.head={prm_head}"] if name.startswith("prm") else []
        cmd = [sys.executable, "-m", "grpokit.cli", "demo", "--quiet", "--seed", str(seed), *VARIANTS[name], *init,
               f"--sft.checkpoint={sft_run / 'checkpoints' / 'sft'}", "--output-dir", str(run_dir)]
        print("+", " ".join(cmd[2:]), file=sys.stderr)
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return json.loads((run_dir / "summary.json").read_text())


def rm_accuracy(summary: dict) -> str:
    rm = summary.get("reward_model") or {}
    if "pairwise_accuracy" in rm:
        return f"{rm['pairwise_accuracy']:.1%} pairwise"
    if "step_accuracy" in rm:
        return f"{rm['step_accuracy']:.1%} of steps"
    return "-"


def breakdown(run_dir: Path, seed: int) -> dict[str, list[bool]]:
    """Held-out accuracy of a run's initial reward model by kind of example: does it verify, or does
    it only know that worked solutions tend to be right? (built-in task; round-0 data, same split)"""
    import torch

    from grpokit.data.arithmetic import shows_steps
    from grpokit.data.reward_data import PreferencePair, StepLabelledSample
    from grpokit.rewards.learned import load_reward_model
    from grpokit.rewards.scorers import as_scorer
    from grpokit.train.reward_model import split_by_prompt

    model, tokenizer, info = load_reward_model(run_dir / "reward_model", device="cpu")
    scorer = as_scorer(model, tokenizer, info)
    records = [json.loads(line) for line in (run_dir / "reward_model_data" / "round-0.jsonl").open()]
    kind = lambda text: "worked" if shows_steps(text) else "direct"  # noqa: E731
    hits: dict[str, list[bool]] = {}
    if info.kind == "outcome":
        _, heldout = split_by_prompt([PreferencePair(**r) for r in records], 0.1, seed)
        chosen = scorer.scores([p.prompt for p in heldout], [p.chosen for p in heldout])
        rejected = scorer.scores([p.prompt for p in heldout], [p.rejected for p in heldout])
        for p, c, r in zip(heldout, chosen, rejected):
            hits.setdefault(f"right {kind(p.chosen)} vs wrong {kind(p.rejected)}", []).append(bool(c > r))
    else:
        samples = [StepLabelledSample(r["prompt"], tuple(r["steps"]), tuple(map(bool, r["labels"]))) for r in records]
        _, heldout = split_by_prompt(samples, 0.1, seed)
        with torch.no_grad():
            for start in range(0, len(heldout), 64):
                batch = heldout[start : start + 64]
                logits = scorer.step_logits([x.prompt for x in batch], [list(x.steps) for x in batch])
                for x, row in zip(batch, logits):
                    for step, label, logit in zip(x.steps, x.labels, row.tolist()):
                        what = "direct answer" if len(x.steps) == 1 else ("answer line" if step.startswith("A:")
                                                                          else "chain step")
                        hits.setdefault(f"{what}, {'right' if label else 'wrong'}", []).append((logit > 0) == label)
    return hits


def share(hits: dict[str, list[bool]], keep) -> float:
    """The share of right calls among the examples whose kind `keep` accepts."""
    picked = [h for name, group in hits.items() if keep(name) for h in group]
    return sum(picked) / len(picked) if picked else float("nan")


def targets_row(seed: int, results: dict[str, dict], orm: dict[str, list[bool]], prm: dict[str, list[bool]]) -> str:
    """One seed's line of the targets table, from its runs and its reward models' breakdowns."""
    acc = {name: s["grpo_accuracy"] for name, s in results.items()}

    def at_least(name: str, baseline: str) -> str:
        return f"{'yes' if acc[name] >= acc[baseline] else 'no'} ({acc[name]:.1%} vs {acc[baseline]:.1%})"

    worked = share(orm, lambda n: n == "right worked vs wrong worked")
    return (f"| {seed} | {share(orm, lambda n: True):.1%} | {worked:.1%} "
            f"| {share(prm, lambda n: True):.1%} | {share(prm, lambda n: n.endswith('wrong')):.1%} "
            f"| {at_least('prm', 'orm')} | {at_least('orm-iter2', 'orm')} | {at_least('prm-iter2', 'prm')} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/rm", help="where the variant runs go")
    parser.add_argument("--sft-from", default="runs/seed{seed}",
                        help="the plain demo run of each seed: its pi_SFT and its rule-based result")
    parser.add_argument("--breakdown", action="store_true",
                        help="also: each initial reward model's held-out accuracy by kind of example, and the "
                             "targets table")
    parser.add_argument("--jobs", type=int, default=1, help="variant runs side by side, one thread each")
    parser.add_argument("--rm-init", default="", help="reward-model initialisation checkpoint ({seed} is replaced)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="which variants: " + ", ".join(VARIANTS))
    parser.add_argument("--prm-head", default="score", choices=["score", "likelihood"],
                        help="the process RM's head (reward_model.model.head)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {list(VARIANTS)}")
    if args.breakdown and set(VARIANTS) - set(variants):
        parser.error("--breakdown compares every variant: leave --variants out")
    out = Path(args.out)
    todo = [(seed, name) for seed in seeds for name in variants]
    with ThreadPoolExecutor(args.jobs) as pool:
        done = dict(zip(todo, pool.map(
            lambda job: run_variant(job[0], job[1], sft_dir(args, job[0]), out, args.rm_init, args.prm_head), todo)))
    rows, by_seed = [], {}
    for seed in seeds:
        rule = json.loads((sft_dir(args, seed) / "summary.json").read_text())
        results = by_seed[seed] = {"rule": rule} | {name: done[(seed, name)] for name in variants}
        for name, s in results.items():
            refresh = s.get("reward_model_refreshes") or []
            after = f" → {rm_accuracy({'reward_model': refresh[-1]})}" if refresh else ""
            rows.append(f"| {seed} | {name} | {rm_accuracy(s)}{after} | {s['sft_accuracy']:.1%} | "
                        f"{s['grpo_accuracy']:.1%} | {100 * (s['grpo_accuracy'] - s['sft_accuracy']):+.1f} pt | "
                        f"{s['grpo']['maj_at_k']:.1%} | {s['grpo_shows_its_steps']:.0%} |")
    print("| seed | reward | reward model held-out accuracy | SFT greedy | GRPO greedy | change | GRPO maj@8 "
          "| shows steps |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.breakdown:
        hits = {(seed, name): breakdown(out / f"{name}-s{seed}", seed) for seed in seeds for name in ("orm", "prm")}
        for (seed, name), by_kind in hits.items():
            print(f"seed {seed} {name}: " + ", ".join(f"{kind} {sum(h) / len(h):.0%} (n={len(h)})"
                                                     for kind, h in sorted(by_kind.items())))
        print()
        print("| seed | ORM pairwise (≥ 90%) | ORM right-worked vs wrong-worked (≥ 80%) | PRM steps (≥ 90%) "
              "| PRM wrong steps caught (≥ 80%) | PS ≥ OS | ORM 2 iterations ≥ 1 | PRM 2 iterations ≥ 1 |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(targets_row(seed, by_seed[seed], hits[(seed, "orm")], hits[(seed, "prm")]) for seed in seeds))
    return 0


def sft_dir(args, seed: int) -> Path:
    return Path(args.sft_from.format(seed=seed))


if __name__ == "__main__":
    sys.exit(main())
