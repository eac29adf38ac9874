"""The step-time cost of tool-integrated (TIR) rollouts in RL: where a step's time goes in a run
that samples with the Python tool, against a run that samples chain-of-thought only, from the
same pi_SFT on the same machine.

    grpokit demo --output-dir runs/cot                                   # pi_SFT, then CoT-only RL
    grpokit demo --output-dir runs/mixed --sft.checkpoint=runs/cot/checkpoints/sft \\
        --rollout.tool=python --task.prompt_modes='{cot: 0.5, tir: 0.5}'
    python benchmarks/tir_rl_step.py runs/cot runs/mixed

reads each run's metrics.jsonl and prints a Markdown table of per-step medians: the step, its
sampling, of which generation (in the engine) and programs (in the tool, wall time: a round's
programs run together), then scoring and the update; and each run's step time over the first's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

COLUMNS = [("step", "perf/step_time_s"), ("sampling", "perf/rollout_time_s"),
           ("of which generation", "tool/generate_wall_s"), ("of which programs", "tool/wall_s"),
           ("scoring", "perf/scoring_time_s"), ("update", "perf/update_time_s")]


def medians(run: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{run / 'metrics.jsonl'} holds no steps")
    out = {key: statistics.median(r[key] for r in rows) for _, key in COLUMNS if all(key in r for r in rows)}
    out["steps"] = len(rows)
    out["calls"] = statistics.mean(r.get("tool/calls_mean", 0.0) for r in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories; the first is the baseline")
    args = parser.parse_args(argv)
    found = [(run, medians(run)) for run in args.runs]
    base = found[0][1]["perf/step_time_s"]
    print("| run | steps | tool calls / completion | " + " | ".join(f"{name} (s)" for name, _ in COLUMNS)
          + " | step / first run's |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    for run, m in found:
        cells = [f"{m[key]:.3f}" if key in m else "-" for _, key in COLUMNS]
        print(f"| {run} | {m['steps']} | {m['calls']:.2f} | " + " | ".join(cells)
              + f" | {m['perf/step_time_s'] / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
