"""`grpokit bench cost`: GRPO and PPO measured on the same model, batch and lengths.

Each algorithm runs in its own fresh subprocess (a process's peak RSS only ever grows, so two
runs cannot share one), with the same seed, model, prompts, G and lengths. Reported per run:
  peak memory     CPU: peak RSS of the process, and that peak above its RSS just before the
                  models were built (the interpreter and libraries); CUDA: max_memory_allocated
  step time       median over the measured steps, split into generation, scoring,
                  reference/old log-probs (and critic values), and the update
The model is a randomly initialised Llama sized so that model state, not the interpreter,
dominates memory (about 113M parameters by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from grpokit.config import GRPOConfig, PPOConfig
from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model, resolve_device
from grpokit.rewards import WeightedReward
from grpokit.run.memory import peak_rss_bytes, rss_bytes

STAGES = [("generation", "perf/rollout_time_s"), ("scoring", "perf/scoring_time_s"),
          ("ref/old log-probs", "perf/logprob_time_s"), ("update", "perf/update_time_s")]


def measure(algo: str, args: argparse.Namespace) -> dict:
    """One algorithm's run, in this process; returns its numbers."""
    import torch

    torch.set_num_threads(args.threads) if args.threads else None

    device = resolve_device(args.device)
    baseline = rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = build_tiny_model(tokenizer, "llama", args.hidden_size, args.layers, args.heads, args.intermediate_size,
                             seed=args.seed).to(device)
    params = sum(p.numel() for p in model.parameters())
    task = arithmetic.ChainSpec()
    rows = [{"prompt": r["prompt"], "answer": r["answer"]}
            for r in arithmetic.make_rows(arithmetic.sample_questions(256, args.seed, task, "train"))]
    config = GRPOConfig(num_generations=args.generations, prompts_per_step=args.prompts,
                        max_completion_length=args.max_new_tokens, max_steps=args.steps + 1, learning_rate=1e-5,
                        micro_batch_size=args.micro_batch_size, warmup_steps=0)
    rewards = [WeightedReward("chain_accuracy", arithmetic.chain_accuracy)]
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as run_dir:
        if algo == "ppo":
            # a trainer only in the measuring subprocess: the parent `grpokit bench cost` (its --help
            # too) starts without the training stack
            from grpokit.train.ppo import PPOTrainer

            trainer = PPOTrainer(model, tokenizer, rewards, rows, config, run_dir, seed=args.seed, progress=False,
                                 ppo=PPOConfig())
        else:
            from grpokit.train.grpo import GRPOTrainer  # as PPOTrainer above

            trainer = GRPOTrainer(model, tokenizer, rewards, rows, config, run_dir, seed=args.seed, progress=False)
        records = [trainer.step() for _ in range(args.steps + 1)][1:]  # the first step warms caches up
    out = {
        "algo": algo,
        "params": params,
        "device": str(device),
        "steps_measured": len(records),
        "step_seconds": statistics.median(r["perf/step_time_s"] for r in records),
        "stage_seconds": {name: statistics.median(r[key] for r in records) for name, key in STAGES},
        "completion_tokens_mean": statistics.mean(r["completion/mean_length"] for r in records),
    }
    if device.type == "cuda":
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        out["memory_measure"] = "torch.cuda.max_memory_allocated"
    else:
        out["peak_mem_bytes"] = peak_rss_bytes()
        out["baseline_rss_bytes"] = baseline
        out["peak_above_baseline_bytes"] = out["peak_mem_bytes"] - baseline
        out["memory_measure"] = "peak RSS (ru_maxrss)"
    return out


SHARED_OPTIONS = ("hidden_size", "layers", "heads", "intermediate_size", "prompts", "generations", "max_new_tokens",
                  "micro_batch_size", "steps", "seed", "threads", "device")


def _worker_command(algo: str, args: argparse.Namespace) -> list[str]:
    """The same settings for each algorithm's subprocess."""
    options = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in SHARED_OPTIONS]
    return [sys.executable, "-m", "grpokit.bench.cost", "--worker", algo, *options]


def _combine(runs: list[dict]) -> dict:
    """Medians over repeated runs of one algorithm (each run is itself a median over steps)."""
    out = dict(runs[0])
    for key in ("step_seconds", "peak_mem_bytes", "baseline_rss_bytes", "peak_above_baseline_bytes"):
        if key in out:
            out[key] = statistics.median(r[key] for r in runs)
    out["stage_seconds"] = {k: statistics.median(r["stage_seconds"][k] for r in runs) for k in out["stage_seconds"]}
    out["repeats"] = len(runs)
    return out


def run_cost(args: argparse.Namespace) -> dict:
    """Both algorithms, each run in a fresh subprocess, alternating (GRPO, PPO, PPO, GRPO, ...) so
    that machine noise falls on both; returns {"grpo": {...}, "ppo": {...}, "ratios": {...}}."""
    runs: dict[str, list[dict]] = {"grpo": [], "ppo": []}
    for i in range(args.repeats):
        for algo in (("grpo", "ppo") if i % 2 == 0 else ("ppo", "grpo")):
            print(f"measuring {algo} (run {i + 1}/{args.repeats}: {args.steps} steps after one warm-up) ...",
                  file=sys.stderr, flush=True)
            proc = subprocess.run(_worker_command(algo, args), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"the {algo} measurement failed:\n{proc.stderr[-3000:]}")
            runs[algo].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    results = {algo: _combine(r) for algo, r in runs.items()}
    g, p = results["grpo"], results["ppo"]
    results["ratios"] = {"peak_mem": g["peak_mem_bytes"] / p["peak_mem_bytes"],
                         "step_time": g["step_seconds"] / p["step_seconds"]}
    if "peak_above_baseline_bytes" in g:
        results["ratios"]["peak_mem_above_baseline"] = g["peak_above_baseline_bytes"] / p["peak_above_baseline_bytes"]
    return results


def format_table(results: dict) -> str:
    g, p, r = results["grpo"], results["ppo"], results["ratios"]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    sec = lambda s: f"{s:.3f} s"  # noqa: E731
    rows = [("peak memory (" + g["memory_measure"] + ")", mib(g["peak_mem_bytes"]), mib(p["peak_mem_bytes"]),
             f"{r['peak_mem']:.2f}")]
    if "peak_above_baseline_bytes" in g:
        rows.append(("  above the pre-model baseline", mib(g["peak_above_baseline_bytes"]),
                     mib(p["peak_above_baseline_bytes"]), f"{r['peak_mem_above_baseline']:.2f}"))
    rows.append(("step time (median)", sec(g["step_seconds"]), sec(p["step_seconds"]), f"{r['step_time']:.2f}"))
    for name, _ in STAGES:
        a, b = g["stage_seconds"][name], p["stage_seconds"][name]
        rows.append((f"  {name}", sec(a), sec(b), f"{a / b:.2f}" if b else "-"))
    head = (f"model: Llama, {g['params'] / 1e6:.1f}M parameters on {g['device']}; "
            f"{g['repeats']} run(s) x {g['steps_measured']} measured steps each, medians; "
            f"completion tokens ~{g['completion_tokens_mean']:.0f}")
    lines = [head, "", "| | GRPO | PPO | GRPO / PPO |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--intermediate-size", type=int, default=3072)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="G, completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    parser.add_argument("--repeats", type=int, default=1, help="fresh runs of each algorithm, alternating")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = torch's default")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpokit bench cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["grpo", "ppo"], help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(args.worker, args)))
        return 0
    results = run_cost(args)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
