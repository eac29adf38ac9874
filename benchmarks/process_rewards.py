"""Outcome vs process supervision when the step rewards are right (issue 35, part 2), per seed, on one
pi_SFT each: GRPO with the chain task's outcome rule (chain_accuracy, eq. 5) against its step rule
(chain_steps, eq. 6) and eq. 6's variants.

    python benchmarks/process_rewards.py --seeds 0,1,2 [--out runs/process] [--jobs 2] [--steps 150]
                                         [--arms outcome,process] [--sft-from runs/seed{seed}] [--set KEY=VALUE ...]

For each seed, pi_SFT is the --sft-from run's checkpoints/sft (a plain `grpokit demo --seed S` run), or,
without --sft-from, one `grpokit demo --stages=[sft]` run into OUT/sft-s{seed}. Every arm below then runs
in a fresh `grpokit demo --sft.checkpoint=...` subprocess (no SFT is redone), unless its summary.json
is already there. Every arm samples the same number of completions (--steps x grpo.prompts_per_step x
grpo.num_generations, the demo's 16 x 8 unless --set changes them), so they compare at equal cost.

  outcome          rewards: [chain_accuracy], eq. 5
  process          rewards: [chain_steps], eq. 6 (grpo.process_advantage: grpo)
  process-step     the same steps, each token credited with its own step only (grpo.process_advantage: step)
  process-per-completion  eq. 6 divided by the completion's number of steps (per_completion)
  process+outcome  eq. 6 plus eq. 5 of the last (answer) step's score (process_outcome)

Each arm evaluates its held-out questions greedily every --steps/4 steps (eval.every_steps: at 25%, 50%
and 75%), and at the end with the demo's own evaluation: greedy, maj@k and pass@k (eval.k, 8). --arms runs some of them (outcome always: every other arm is measured
against it); a later run with more arms reuses the finished ones. Prints one Markdown table, then how many seeds each process arm's final greedy
accuracy is at least the outcome arm's. --set KEY=VALUE (repeatable) passes a config override to every
run, the SFT run included: how a short check shrinks the setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STEPS_RULE = ["--rewards=[{name: chain_steps}]"]
ARMS = {
    "outcome": ["--rewards=[{name: chain_accuracy}]"],
    "process": STEPS_RULE,
    "process-step": [*STEPS_RULE, "--grpo.process_advantage=step"],
    "process-per-completion": [*STEPS_RULE, "--grpo.process_advantage=per_completion"],
    "process+outcome": [*STEPS_RULE, "--grpo.process_advantage=process_outcome"],
}
QUARTERS = (1, 2, 3)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def grpokit(args: list[str], what: str) -> None:
    print("+ grpokit", " ".join(args), file=sys.stderr)
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", *args], env=ENV, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")


def sft_checkpoint(args, seed: int) -> Path:
    """pi_SFT of `seed`: the --sft-from run's, or one trained here (once) into OUT/sft-s{seed}."""
    if args.sft_from:
        path = Path(args.sft_from.format(seed=seed)) / "checkpoints" / "sft"
        if not path.is_dir():
            raise SystemExit(f"--sft-from: {path} does not exist; run `grpokit demo --seed {seed}` there first")
        return path
    run_dir = Path(args.out) / f"sft-s{seed}"
    path = run_dir / "checkpoints" / "sft"
    if not path.is_dir():
        grpokit(["demo", "--stages=[sft]", "--quiet", f"--seed={seed}", f"--output-dir={run_dir}", *args.set],
                f"pi_SFT of seed {seed}")
    return path


def eval_every(steps: int) -> int:
    return max(1, steps // 4)


def run_arm(args, seed: int, arm: str, sft: Path) -> dict:
    """The arm's summary.json, plus its greedy accuracy at each quarter (eval.every_steps) and its wall time."""
    run_dir = Path(args.out) / f"{arm}-s{seed}"
    every = eval_every(args.steps)
    started = time.perf_counter()
    if not (run_dir / "summary.json").is_file():
        before = "true" if arm == "outcome" else "false"  # pi_SFT's accuracy once per seed
        grpokit(["demo", "--quiet", f"--seed={seed}", f"--sft.checkpoint={sft}", f"--output-dir={run_dir}",
                 f"--grpo.max_steps={args.steps}", f"--eval.every_steps={every}", "--eval.tir=false",
                 f"--eval.before={before}", *ARMS[arm], *args.set], f"{arm} (seed {seed})")
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = dict(summary.get("heldout_curve") or [])  # none in a run finished before eval.every_steps
    summary["greedy_at"] = {q: (q * every, curve.get(q * every)) for q in QUARTERS}
    summary["bench_seconds"] = time.perf_counter() - started
    return summary


def table(seeds: list[int], done: dict, steps: int, arms: list[str]) -> list[str]:
    k = next(iter(done.values()))["grpo"]["k"]
    quarters = " | ".join(f"greedy {q * 25}% (step {q * eval_every(steps)})" for q in QUARTERS)
    lines = [f"| seed | arm | SFT greedy | {quarters} | final greedy | maj@{k} | pass@{k} | final vs outcome |",
             "|---|---|---|" + "---|" * len(QUARTERS) + "---|---|---|---|"]
    for seed in seeds:
        sft = done[(seed, "outcome")]["sft_accuracy"]
        baseline = done[(seed, "outcome")]["grpo_accuracy"]
        for arm in arms:
            s = done[(seed, arm)]
            at = " | ".join("-" if s["greedy_at"][q][1] is None else f"{s['greedy_at'][q][1]:.1%}" for q in QUARTERS)
            versus = "—" if arm == "outcome" else f"{100 * (s['grpo_accuracy'] - baseline):+.1f} pt"
            lines.append(f"| {seed} | {arm} | {sft:.1%} | {at} | {s['grpo_accuracy']:.1%} | "
                         f"{s['grpo']['maj_at_k']:.1%} | {s['grpo']['pass_at_k']:.1%} | {versus} |")
    return lines


def target_lines(seeds: list[int], done: dict, arms: list[str]) -> list[str]:
    """The issue's target: process >= outcome in final held-out greedy on at least 2 of 3 seeds."""
    out = []
    for arm in arms:
        if arm == "outcome":
            continue
        wins = [s for s in seeds if done[(s, arm)]["grpo_accuracy"] >= done[(s, "outcome")]["grpo_accuracy"]]
        out.append(f"- {arm} ≥ outcome (final greedy) on {len(wins)} of {len(seeds)} seeds "
                   f"({', '.join(map(str, wins)) or 'none'})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/process", help="where the runs go")
    parser.add_argument("--steps", type=int, default=150, help="GRPO steps of every arm (the demo's 150)")
    parser.add_argument("--sft-from", default="", help="a plain demo run per seed, e.g. runs/seed{seed}, whose "
                                                       "pi_SFT every arm starts from; empty: train one per seed")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"which arms, of {', '.join(ARMS)}")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, one thread each")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. --set grpo.prompts_per_step=4")
    args = parser.parse_args(argv)
    args.set = [f"--{item.removeprefix('--')}" for item in args.set]
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = ["outcome", *(a for a in args.arms.split(",") if a != "outcome")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"--arms: no arm {', '.join(unknown)}; the arms are {', '.join(ARMS)}")
    started = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        sfts = dict(zip(seeds, pool.map(lambda seed: sft_checkpoint(args, seed), seeds)))
        todo = [(seed, arm) for seed in seeds for arm in arms]
        done = dict(zip(todo, pool.map(lambda job: run_arm(args, job[0], job[1], sfts[job[0]]), todo)))
    print("\n".join(table(seeds, done, args.steps, arms)))
    print()
    print("\n".join(target_lines(seeds, done, arms)))
    each = ", ".join(f"{arm}-s{seed} {d['bench_seconds']:.0f}s" for (seed, arm), d in done.items())
    print(f"\nwall time {time.perf_counter() - started:.0f}s ({each})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
