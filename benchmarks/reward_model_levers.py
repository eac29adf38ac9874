"""What each lever buys a reward model on the demo task: held-out accuracy of outcome and process
reward models trained on pi_SFT's own graded samples, with and without each lever.

    python benchmarks/reward_model_levers.py --seeds 0,1,2 --sft-from "runs/seed{seed}" --out runs/levers --jobs 2

For each seed and lever it runs `grpokit train-rm` (outcome) or `grpokit train-rm --process` in a
fresh subprocess, initialised from that seed's pi_SFT (`--model.name_or_path`), unless the run's
reward model is already there, then prints one Markdown table. Every run samples the same
questions with the same seed, so the held-out questions, and the real samples on them, are the
same in every row of a seed; hard negatives join the training questions only.

  base             the defaults (1,000 questions x 8 samples, 400 steps)
  hard-negatives   2 one-slip twins per right training solution (reward_model.data.hard_negatives)
  balanced         process: right and wrong steps weigh equally in the loss
  hard+balanced    process: both
  3x-data-steps    3,000 questions and 1,200 steps
  4x-data-steps    4,000 questions and 1,600 steps (the data axis of the capacity curve)
  tiny-1x          a fresh, randomly initialised RM of the policy's shape (reward_model.model.init=tiny,
                   hidden 128, 2 blocks): size alone, without pi_SFT's weights
  tiny-4x          the same, hidden 256 (about 4x the policy's parameters)
  tiny-16x         the same, hidden 512 (about 16x)
  checkpoint       initialised from --rm-checkpoint (reward_model.model.init=checkpoint), e.g. a larger
                   pi_SFT: a reward model that knows the task's arithmetic better than the policy does
  checkpoint-4x    the same, with 4x the samples and steps

Columns: the outcome RM's pairwise accuracy, over all held-out pairs and over pairs of a right
worked solution and a wrong worked one (the pairs where only the arithmetic differs); the process
RM's step accuracy, its share of wrong steps caught, and of right steps passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from reward_models import breakdown, share  # noqa: E402

LEVERS = {
    "base": [],
    "hard-negatives": ["--reward_model.data.hard_negatives=2"],
    "balanced": ["--reward_model.train.balance_step_labels=true"],
    "hard+balanced": ["--reward_model.data.hard_negatives=2", "--reward_model.train.balance_step_labels=true"],
    "3x-data-steps": ["--reward_model.data.num_questions=3000", "--reward_model.train.max_steps=1200"],
    "4x-data-steps": ["--reward_model.data.num_questions=4000", "--reward_model.train.max_steps=1600"],
    **{f"tiny-{scale}x": ["--reward_model.model.init=tiny", f"--reward_model.model.hidden_size={hidden}",
                          "--reward_model.model.num_layers=2", f"--reward_model.model.intermediate_size={4 * hidden}"]
       for scale, hidden in ((1, 128), (4, 256), (16, 512))},
    "checkpoint": ["--reward_model.model.init=checkpoint"],
    "checkpoint-4x": ["--reward_model.model.init=checkpoint", "--reward_model.data.num_questions=4000",
                      "--reward_model.train.max_steps=1600"],
}
PROCESS_ONLY = {"balanced", "hard+balanced"}


def train(seed: int, kind: str, lever: str, sft: Path, out: Path, rm_checkpoint: str = "") -> Path:
    run_dir = out / f"{kind}-{lever}-s{seed}"
    if not (run_dir / "reward_model").is_dir():
        init = ([f"--reward_model.model.path={rm_checkpoint.format(seed=seed)}"]
                if lever.startswith("checkpoint") else [])
        cmd = [sys.executable, "-m", "grpokit.cli", "train-rm", *(["--process"] if kind == "process" else []),
               "--quiet", "--seed", str(seed), f"--model.name_or_path={sft}", "--output-dir", str(run_dir),
               *LEVERS[lever], *init]
        print("+", " ".join(cmd[2:]), file=sys.stderr)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return run_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--sft-from", default="runs/seed{seed}", help="demo runs whose checkpoints/sft are pi_SFT")
    parser.add_argument("--out", default="runs/levers")
    parser.add_argument("--levers", default=",".join(LEVERS))
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side, one thread each")
    parser.add_argument("--kinds", default="outcome,process", help="which reward models: outcome, process or both")
    parser.add_argument("--rm-checkpoint", default="",
                        help="the checkpoint levers' reward-model initialisation ({seed} is replaced)")
    args = parser.parse_args(argv)
    seeds, levers = [int(s) for s in args.seeds.split(",")], args.levers.split(",")
    unknown = sorted(set(levers) - set(LEVERS))
    if unknown:
        parser.error(f"unknown levers {unknown}; choose from {sorted(LEVERS)}")
    if any(lever.startswith("checkpoint") for lever in levers) and not args.rm_checkpoint:
        parser.error("the checkpoint levers need --rm-checkpoint PATH")
    kinds = list(dict.fromkeys(args.kinds.split(",")))  # each once: two jobs must not share a run directory
    if not kinds or set(kinds) - {"outcome", "process"}:
        parser.error(f"--kinds takes outcome, process or both, got {args.kinds!r}")
    jobs = [(seed, kind, lever) for seed in seeds for lever in levers for kind in kinds
            if kind == "process" or lever not in PROCESS_ONLY]
    sft = {seed: Path(args.sft_from.format(seed=seed)) / "checkpoints" / "sft" for seed in seeds}
    with ThreadPoolExecutor(args.jobs) as pool:
        dirs = dict(zip(jobs, pool.map(
            lambda j: train(j[0], j[1], j[2], sft[j[0]], Path(args.out), args.rm_checkpoint), jobs)))
    print("| seed | lever | ORM pairwise | ORM right-worked vs wrong-worked | PRM steps | PRM wrong steps caught "
          "| PRM right steps passed |")
    print("|---|---|---|---|---|---|---|")
    for seed in seeds:
        for lever in levers:
            orm = breakdown(dirs[(seed, "outcome", lever)], seed) if (seed, "outcome", lever) in dirs else None
            prm = breakdown(dirs[(seed, "process", lever)], seed) if (seed, "process", lever) in dirs else None
            if orm is None and prm is None:
                continue  # a process-only lever with --kinds outcome
            cells = ["-", "-"] if orm is None else [f"{share(orm, lambda n: True):.1%}",
                                                    f"{share(orm, lambda n: n == 'right worked vs wrong worked'):.1%}"]
            cells += ["-", "-", "-"] if prm is None else [
                f"{share(prm, lambda n: True):.1%}", f"{share(prm, lambda n: n.endswith('wrong')):.1%}",
                f"{share(prm, lambda n: n.endswith('right')):.1%}"]
            print(f"| {seed} | {lever} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
