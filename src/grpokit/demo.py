"""`grpokit demo`: the RL stage of DeepSeekMath in miniature, on a laptop CPU, no downloads.

tiny Llama + char tokenizer -> SFT on worked chain-arithmetic solutions (pi_SFT)
-> held-out eval -> GRPO with the rule-based verifier -> held-out eval -> table + plot.

With reward_model.kind = outcome or process, a reward model is first trained on pi_SFT's own
samples graded by rule (correct vs incorrect answers; which step first goes wrong), and GRPO
takes its rewards from it; iterative.iterations > 1 refreshes it between iterations.

The GRPO stage reloads pi_SFT from its saved checkpoint through the same loader a hub
model uses, and trains with the same GRPOTrainer: there is no demo-only code path.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from grpokit.checkpoint import save_checkpoint
from grpokit.config import Config, ConfigError
from grpokit.data import arithmetic
from grpokit.eval.plots import plot_reward_curve
from grpokit.models import load_model_and_tokenizer
from grpokit.runlock import RunLock
from grpokit.stages import (
    evaluate_chain,
    load_policy,
    make_trainer,
    reward_model_stage,
    seed_everything,
    start_run,
    task_splits,
)
from grpokit.train.iterative import rm_headline, run_iterations
from grpokit.train.sft import sft_train

# A learned reward is easier to exploit than a verifier: where the reward model cannot check the
# arithmetic (it learns that worked solutions tend to be right, not which ones are), a firmer
# KL anchor keeps the policy's arithmetic from drifting while it learns to show its steps. The
# demo's model-reward variants use this beta unless one is given (README: reward models).
REWARD_MODEL_BETA = 0.2


def reasoning_rate(result) -> float:
    """Share of greedy answers that work through at least one step before answering."""
    shown = [c for c in result.greedy_completions if arithmetic.shows_steps(c)]
    return len(shown) / max(1, len(result.greedy_completions))


def format_table(before, after, algo: str = "grpo") -> str:
    k, name = before.k, algo.upper()
    rows = [("greedy accuracy", before.greedy_accuracy, after.greedy_accuracy),
            (f"pass@{k}", before.pass_at_k, after.pass_at_k),
            (f"maj@{k}", before.maj_at_k, after.maj_at_k),
            ("shows its steps", reasoning_rate(before), reasoning_rate(after))]
    lines = [f"held-out questions: {before.num_questions}",
             f"{'metric':<16} {'SFT':>7} {name:>7} {'change':>8}"]
    lines += [f"{name:<16} {b:>7.1%} {a:>7.1%} {100 * (a - b):>+7.1f}pt" for name, b, a in rows]
    return "\n".join(lines)


def _refreshes(run_dir) -> list[dict]:
    path = run_dir / "reward_model_metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if r.get("round", 0) > 0]


def run_demo(config: Config, progress: bool = True) -> dict:
    """Run the whole pipeline; returns (and writes) summary.json."""
    with RunLock(config.output_dir):
        return _run_demo(config, progress)


def _run_demo(config: Config, progress: bool) -> dict:
    started = time.perf_counter()
    run_dir = start_run(config)
    for stale in ("metrics.jsonl", "reward_model_metrics.jsonl", "replay_buffer.jsonl"):  # a demo starts afresh
        (run_dir / stale).unlink(missing_ok=True)
    sft_rows, rl_rows, heldout = task_splits(config)
    model, tokenizer = load_policy(config)
    print(f"{model.config.model_type}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"{len(sft_rows)} SFT demonstrations, {len(rl_rows)} RL questions, {len(heldout)} held-out questions")
    if config.sft.checkpoint:  # a pi_SFT saved by an earlier run
        sft_losses, sft_dir = [float("nan")], Path(config.sft.checkpoint)
        if not (sft_dir / "config.json").is_file():
            raise ConfigError(f"sft.checkpoint {str(sft_dir)!r} is not a saved model (no config.json there); "
                              "point it at a run's checkpoints/sft directory")
        print(f"pi_SFT from {sft_dir} (sft.checkpoint); no SFT in this run")
    else:
        sft_losses = sft_train(model, tokenizer, [(r["prompt"], r["solution"]) for r in sft_rows], config.sft,
                               seed=config.seed, progress=progress)
        sft_dir = save_checkpoint(model, tokenizer, run_dir / "checkpoints" / "sft")
    sft_seconds = time.perf_counter() - started

    # pi_SFT enters RL through the same loader a hub checkpoint would.
    policy, tokenizer = load_model_and_tokenizer(str(sft_dir), dtype="fp32", device=config.model.device)
    before = evaluate_chain(policy, tokenizer, heldout, config)
    print(f"SFT  held-out: greedy {before.greedy_accuracy:.1%}, pass@{before.k} {before.pass_at_k:.1%}")

    stage, rm_metrics = None, None
    if config.reward_model.kind != "none":
        seed_everything(config.seed)  # the reward model's data does not depend on how pi_SFT was obtained
        stage = reward_model_stage(config, policy, tokenizer, rl_rows, run_dir, progress)
        if not config.reward_model.path:  # learn it from pi_SFT's own samples, graded by rule
            rm_metrics = stage.train_round(policy, 0)
            stage.save(run_dir / "reward_model", rm_metrics)
            print(f"{config.reward_model.kind} reward model, held-out: {rm_headline(rm_metrics)}")

    seed_everything(config.seed)
    trainer = make_trainer(config, policy, tokenizer, rl_rows, run_dir, progress,
                           reward_scorer=stage.scorer if stage else None)
    grpo_started = time.perf_counter()
    history = run_iterations(trainer, stage, config.iterative.iterations)
    grpo_seconds = time.perf_counter() - grpo_started
    if trainer.interrupted:
        print("demo stopped before its final evaluation; the GRPO checkpoint above is loadable with from_pretrained")
        return {"interrupted": True, "checkpoint": str(trainer.checkpoints.latest())}

    after = evaluate_chain(policy, tokenizer, heldout, config)
    table = format_table(before, after, config.algo)
    print(table)
    plot_reward_curve(history, run_dir / "reward_curve.png",
                      title=f"grpokit demo ({config.algo.upper()}, seed {config.seed})",
                      baseline=before.greedy_accuracy, final=after.greedy_accuracy)
    summary = {
        "seed": config.seed,
        "algo": config.algo,
        "reward": "rule" if config.reward_model.kind == "none" else "model",
        "supervision": "process" if config.reward_model.kind == "process" else "outcome",
        "iterations": config.iterative.iterations,
        "reward_model": rm_metrics,
        "reward_model_refreshes": _refreshes(run_dir),
        "sft_accuracy": before.greedy_accuracy,
        "grpo_accuracy": after.greedy_accuracy,
        "improvement_points": 100 * (after.greedy_accuracy - before.greedy_accuracy),
        "sft_reasoning_rate": reasoning_rate(before),
        "grpo_reasoning_rate": reasoning_rate(after),
        "sft": before.as_dict(),
        "grpo": after.as_dict(),
        "sft_final_loss": sft_losses[-1],
        "sft_seconds": sft_seconds,
        "grpo_seconds": grpo_seconds,
        "wall_seconds": time.perf_counter() - started,
        "checkpoint": str(trainer.checkpoints.latest()),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "results.md").write_text(table + "\n")
    print(f"wall time {summary['wall_seconds']:.0f}s; wrote {run_dir}/summary.json, reward_curve.png, metrics.jsonl")
    return summary
