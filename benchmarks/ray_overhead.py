"""Ray's overhead as a launcher: the demo's RL stage with one rollout worker, the TCP store and Ray side by side.

    make demo                                  # its pi_SFT: runs/demo/checkpoints/sft (seed 0)
    pip install -e ".[ray]"
    python benchmarks/ray_overhead.py --rounds 4 --json docs/results/data/ray-overhead.json \\
        --label "what this checkout's transport does, and what else ran on the machine"

Each run is `grpokit train` from the demo's pi_SFT with rollout.mode=one_step_off (k = 1), one rollout
worker the trainer starts itself, and distributed.launcher=torchrun (the TCP store, gloo weight pushes)
or ray (worker actors called for each task, weights over a gloo group), 1 thread per process. The launchers alternate over
--rounds, so a slow spell of the machine falls on both. Reported per round: the median of
perf/step_time_s over the steps after --warmup, Ray's over the store's, and the mean share of Ray's
steps the trainer waited for its batch (perf/trainer_idle_frac).

With --json, the rows are added to that file's `overhead` table (earlier rows kept: they are the
history of the code named in --label), the table docs/results/async.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

COLUMNS = [{"title": "code", "key": "code"}, {"title": "round", "key": "round"},
           {"title": "TCP store, s/step", "key": "store"}, {"title": "Ray, s/step", "key": "ray"},
           {"title": "Ray / store", "key": "ratio"}, {"title": "Ray: trainer idle", "key": "idle"}]


def run(launcher: str, model: Path, steps: int, workdir: Path) -> list[dict]:
    run_dir = workdir / f"run-{launcher}"
    # RAY_ADDRESS=local: each Ray run on a private cluster of its own, never one left running here
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", RAY_ADDRESS="local")
    command = [sys.executable, "-m", "grpokit", "train", "--quiet", "--overwrite", "--output-dir", str(run_dir),
               f"--model.name_or_path={model}", "--rollout.mode=one_step_off", "--rollout.workers=1",
               f"--distributed.launcher={launcher}", f"--grpo.max_steps={steps}", "--eval.before=false",
               "--eval.k=0"]  # the final held-out greedy pass only: the steps are what is timed
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"ray_overhead: `{' '.join(command)}` failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="runs/demo/checkpoints/sft",
                        help="the demo's pi_SFT (default runs/demo/checkpoints/sft)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "grpokit-ray-overhead"))
    parser.add_argument("--json", default="", help="add the rows to this results file's `overhead` table")
    parser.add_argument("--label", default="this checkout", help="the code measured, the table's first column")
    args = parser.parse_args()
    model = Path(args.model)
    if not (model / "config.json").is_file():
        raise SystemExit(f"ray_overhead: no model at {model}/config.json: run `make demo` first, or pass --model")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = []
    for round_ in range(1, args.rounds + 1):
        metrics = {}
        for launcher in ("torchrun", "ray"):
            print(f"round {round_}: {launcher} ...", file=sys.stderr, flush=True)
            metrics[launcher] = run(launcher, model, args.steps, workdir)[args.warmup:]
        store, ray = (statistics.median(r["perf/step_time_s"] for r in metrics[k]) for k in ("torchrun", "ray"))
        idle = statistics.mean(r.get("perf/trainer_idle_frac", 0.0) for r in metrics["ray"])
        row = {"code": args.label, "round": round_, "store": round(store, 3), "ray": round(ray, 3),
               "idle": round(idle, 3), "ratio": f"{ray / store:.2f}×"}
        rows.append(row)
        print(f"round {round_}: store {row['store']} s/step, ray {row['ray']} s/step, {row['ratio']}, "
              f"ray's trainer idle {row['idle']:.1%}")
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {"about": "", "tables": {}}
        table = data["tables"].setdefault("overhead", {"columns": COLUMNS, "rows": []})
        table["rows"].extend(rows)
        data.setdefault("runs", []).append({
            "label": args.label, "command": " ".join(["python", "benchmarks/ray_overhead.py", *sys.argv[1:]]),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "steps": args.steps, "warmup": args.warmup})
        path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
