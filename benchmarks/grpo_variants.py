"""The GRPO variants on the demo task, from one pi_SFT: held-out greedy accuracy after the same
number of steps, and wall time (dynamic sampling's extra generation counts in its time).

    python benchmarks/grpo_variants.py --sft runs/demo/checkpoints/sft [--seeds 0] [--jobs 4] [--out runs/variants]

Each variant is a `grpokit demo --sft.checkpoint=...` subprocess (so no SFT is redone); --jobs of
them run side by side with one thread each, so their wall times are measured under the same load.
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

VARIANTS = {
    "GRPO (paper)": [],
    "Dr. GRPO": ["--grpo.scale_rewards=false", "--grpo.loss_aggregation=constant"],
    "DAPO": ["--grpo.loss_aggregation=token", "--grpo.epsilon_high=0.28", "--grpo.dynamic_sampling=true"],
    "GSPO": ["--grpo.importance_sampling_level=sequence", "--grpo.epsilon=3e-4", "--grpo.epsilon_high=4e-4"],
}


def run(name: str, flags: list[str], seed: int, sft: str, out: Path) -> dict:
    run_dir = out / f"{name.split()[0].lower().replace('.', '')}-s{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "grpokit", "demo", f"--sft.checkpoint={sft}", f"--seed={seed}",
                           f"--output-dir={run_dir}", "--quiet", *flags], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{name} (seed {seed}) failed:\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sampled = sum(r.get("sampling/groups_sampled", 16) for r in rows)
    return {"variant": name, "seed": seed, "sft": summary["sft_accuracy"], "after": summary["grpo_accuracy"],
            "seconds": seconds, "groups_sampled": sampled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sft", required=True, help="a saved pi_SFT (a demo's checkpoints/sft)")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--out", default="runs/variants")
    args = parser.parse_args()
    out = Path(args.out)
    todo = [(name, flags, int(seed)) for seed in args.seeds.split(",") for name, flags in VARIANTS.items()]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run(*job, args.sft, out), todo))
    print("| variant | seed | SFT greedy | after 150 steps | change | groups sampled | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['seed']} | {r['sft']:.1%} | {r['after']:.1%} | "
              f"{100 * (r['after'] - r['sft']):+.1f} pt | {r['groups_sampled']} | {r['seconds']:.0f} s |")
    (out / "variants.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
