"""Steps per second of rollout.mode sync, one_step_off and async, side by side, on two CPU cores.

    python benchmarks/async_rollouts.py                       # 113M, 5 steps each, the first skipped
    python benchmarks/async_rollouts.py --steps 8 --rounds 2 --json async.json

The model and prompts are benchmarks/vs_trl.py's 113m config (a 113M-parameter Llama whose head
never draws EOS, so every completion runs the full 128 tokens; B = 4 prompts x G = 4), built once
and reused. Each layout is one `grpokit train` run, its layouts alternating over --rounds:

  colocated      today's default: one process samples and learns, with both cores (2 threads)
  sync           the trainer on core 0 and one rollout worker on core 1 (1 thread each),
                 rollout.mode=sync: the worker samples while the trainer waits, and back
  one_step_off   the same layout, rollout.mode=one_step_off: step t+1's batch is sampled while
                 step t learns
  async          the same layout, rollout.mode=async with rollout.max_staleness=2
  one_step_off_spawn / one_step_off_ray
                 one_step_off with a worker the trainer spawns (TCP store, gloo pushes) or that Ray places
                 as an actor (distributed.launcher=ray: actor calls, a gloo weight group); unpinned,
                 1 thread each: the launcher's overhead side by side

The worker is started as a remote machine's would be (rollout.worker_launch=external, `grpokit
rollout-worker --connect`), pinned to its core with taskset. Reported per layout: the median of
perf/step_time_s over the steps after --warmup (steps per second is its inverse), and the mean of
perf/trainer_idle_frac (the share of a step the trainer waited for its batch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl import CONFIGS, _thread_env, prepare  # noqa: E402 - the shared 113M model and prompts

LAYOUTS = {
    "colocated": {"mode": "sync", "workers": 0},
    "sync": {"mode": "sync", "workers": 1},
    "one_step_off": {"mode": "one_step_off", "workers": 1},
    "async": {"mode": "async", "workers": 1, "max_staleness": 2},
    # distributed.launcher against today's transport: the trainer spawns its worker (TCP store, gloo pushes)
    # or Ray places it as an actor (actor calls, a gloo weight group); neither pinned, 1 thread each
    "one_step_off_spawn": {"mode": "one_step_off", "workers": 1, "spawned": True},
    "one_step_off_ray": {"mode": "one_step_off", "workers": 1, "spawned": True, "launcher": "ray"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_yaml(prepared: dict, layout: dict, steps: int, port: int, run_dir: Path) -> str:
    shape = CONFIGS["113m"]
    b, g = shape["prompts"], shape["generations"]
    rollout = {"mode": layout["mode"], "workers": layout["workers"]}
    if layout["workers"] and not layout.get("spawned"):
        rollout.update(worker_launch="external", worker_address=f"127.0.0.1:{port}")
    if "max_staleness" in layout:
        rollout["max_staleness"] = layout["max_staleness"]
    config = {
        "output_dir": str(run_dir), "seed": 0,
        "model": {"name_or_path": prepared["model_dir"], "dtype": "fp32"},
        "data": {"sources": [{"path": prepared["data"]}], "heldout_fraction": 0.0},
        "grpo": {"prompts_per_step": b, "num_generations": g, "max_completion_length": shape["max_new_tokens"],
                 "max_steps": steps, "save_steps": 0, "beta": 0.04, "epsilon": 0.2, "learning_rate": 1e-6,
                 "warmup_steps": 0, "loss_aggregation": "sequence", "micro_batch_size": b * g,
                 "generation_batch_size": b * g},
        "rollout": rollout,
        "distributed": {"launcher": layout.get("launcher", "torchrun")},
    }
    return json.dumps(config)  # JSON is YAML


def run_layout(name: str, prepared: dict, steps: int, workdir: Path) -> list[dict]:
    layout, port = LAYOUTS[name], _free_port()
    run_dir = workdir / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config = workdir / f"{name}.yaml"
    config.write_text(config_yaml(prepared, layout, steps, port, run_dir))
    cores = "0,1" if not layout["workers"] or layout.get("spawned") else "0"
    threads = 2 if not layout["workers"] else 1
    trainer = subprocess.Popen(["taskset", "-c", cores, sys.executable, "-m", "grpokit", "train", str(config),
                                "--quiet"], env=dict(_thread_env(threads), RAY_USAGE_STATS_ENABLED="0"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    workers = []
    if layout["workers"] and not layout.get("spawned"):  # started by hand, as on another machine, on core 1
        workers.append(subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "grpokit", "rollout-worker",
                                         "--connect", f"127.0.0.1:{port}", "--index", "0", "--threads", "1"],
                                        env=_thread_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    out, _ = trainer.communicate()
    for w in workers:
        w.wait(timeout=120)
    if trainer.returncode:
        raise RuntimeError(f"{name}: grpokit train failed:\n{out[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(name: str, rows: list[dict], warmup: int) -> dict:
    kept = rows[warmup:]
    step = statistics.median(r["perf/step_time_s"] for r in kept)
    return {"layout": name, "steps": len(kept), "step_time_s": step, "steps_per_s": 1 / step,
            "trainer_idle_frac": statistics.mean(r.get("perf/trainer_idle_frac", 0.0) for r in kept),
            "update_s": statistics.median(r["perf/update_time_s"] for r in kept),
            "push_s": statistics.median(r.get("rollout/sync_time_s", 0.0) for r in kept),
            "push_bytes": kept[-1].get("rollout/push_bytes", 0),
            "staleness_max": max(r.get("rollout/staleness_max", 0) for r in kept)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the medians")
    parser.add_argument("--rounds", type=int, default=1, help="alternating rounds of all layouts")
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "grpokit-bench"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    prepared = prepare("113m", workdir, sft_steps=0, seed=0, threads=2, num_rl_questions=200)
    names = args.layouts.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names:
            print(f"round {round_ + 1}: {name} ...", file=sys.stderr, flush=True)
            runs[name].extend(run_layout(name, prepared, args.steps, workdir)[args.warmup:])
    results = [summarize(n, runs[n], 0) for n in names]
    base = {r["layout"]: r["steps_per_s"] for r in results}
    print(f"{'layout':14} {'step s':>8} {'steps/s':>8} {'vs sync':>8} {'vs coloc':>9} {'idle':>6} {'update s':>9} "
          f"{'push s':>7} {'stale':>5}")
    for r in results:
        vs_sync = r["steps_per_s"] / base["sync"] if "sync" in base else float("nan")
        vs_coloc = r["steps_per_s"] / base["colocated"] if "colocated" in base else float("nan")
        print(f"{r['layout']:14} {r['step_time_s']:8.2f} {r['steps_per_s']:8.3f} {vs_sync:7.2f}x {vs_coloc:8.2f}x "
              f"{r['trainer_idle_frac']:6.1%} {r['update_s']:9.2f} {r['push_s']:7.3f} {r['staleness_max']:5d}")
    print(f"weights pushed per step: {results[-1]['push_bytes'] / 1e6:.1f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
