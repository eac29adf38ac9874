"""What a run reports: the before/after table of held-out accuracy (and its TIR form), written
to results.md with the reward curve, the summary's results, and the line of each stage's time."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from grpokit import distributed
from grpokit.config import Config
from grpokit.eval.paired import PairedChange, paired_change
from grpokit.eval.plots import heldout_curve, plot_reward_curve
from grpokit.run.metrics import read_metrics


STAGES = (("sft_seconds", "sft"), ("eval_before_seconds", "eval before"), ("reward_model_seconds", "reward model"),
          ("rl_seconds", None), ("eval_after_seconds", "eval after"))


def stage_times(summary: dict, algo: str) -> str:
    """One line of each stage's wall time in `summary` and the remainder (loading, saving)."""
    parts = [(name or algo, summary[key]) for key, name in STAGES if key in summary]
    other = summary["wall_seconds"] - sum(seconds for _, seconds in parts)
    return "stage times: " + ", ".join(f"{name} {seconds:.0f}s" for name, seconds in [*parts, ("other", other)]) \
        + f"; total {summary['wall_seconds']:.0f}s"


def reward_means_table(before, after, algo: str = "grpo") -> str:
    """Questions without a reference answer: the before/after table of each reward's mean."""
    width = max([16, *map(len, after.reward_means)])
    lines = [f"held-out questions: {after.num_questions} (no reference answers: each reward's mean on the greedy "
             "completions)", f"{'reward':<{width}} {'before':>8} {algo.upper():>8} {'change':>8}"]
    for reward, a in after.reward_means.items():
        b = (before.reward_means or {}).get(reward) if before is not None else None
        known = b is not None and not math.isnan(b)
        lines.append(f"{reward:<{width}} {(f'{b:.3f}' if known else '-'):>8} {a:>8.3f} "
                     f"{(f'{a - b:+.3f}' if known and not math.isnan(a) else ''):>8}")
    return "\n".join(lines)


def format_table(task, before, after, algo: str = "grpo") -> str:
    """The before/after table of held-out accuracy (and the task's own rates), or of each reward's
    mean where the questions have no reference answer."""
    if after.reward_means is not None:
        return reward_means_table(before, after, algo)
    k, name = after.k, algo.upper()
    rates = [(key, task.report(before)[key] if before else None, value) for key, value in task.report(after).items()]
    rows = [("greedy accuracy", before and before.greedy_accuracy, after.greedy_accuracy),
            *([(f"pass@{k}", before and before.pass_at_k, after.pass_at_k),
               (f"maj@{k}", before and before.maj_at_k, after.maj_at_k)] if k else []), *rates]
    lines = [f"held-out questions: {after.num_questions}", f"{'metric':<16} {'before':>7} {name:>7} {'change':>8}"]
    for label, b, a in rows:
        b = None if b is None or math.isnan(b) else b  # NaN: a rate of nothing (no worked answer, say)
        change = f"{100 * (a - b):>+7.1f}pt" if b is not None and not math.isnan(a) else f"{'':>9}"
        lines.append(f"{label:<16} {(f'{b:.1%}' if b is not None else '-'):>7} "
                     f"{('-' if math.isnan(a) else f'{a:.1%}'):>7} {change}")
    change = greedy_change(before, after)
    if change is not None:
        lines.append(f"greedy change: {change.describe()}")
    if after.tir is not None:
        lines += ["", tir_table(before, after, algo)]
    return "\n".join(lines)


def _as_dict(change: PairedChange | None) -> dict | None:
    return None if change is None else asdict(change)


def greedy_change(before, after) -> PairedChange | None:
    """The greedy accuracy's change over the same questions, with its 95% interval (None without a before)."""
    if before is None or not before.greedy_correct or len(before.greedy_correct) != len(after.greedy_correct):
        return None
    return paired_change(before.greedy_correct, after.greedy_correct)


def tir_table(before, after, algo: str = "grpo") -> str:
    """DeepSeekMath's Table 5 in miniature: greedy accuracy with chain-of-thought and with
    tool-integrated reasoning, before and after RL (which trained on CoT prompts only)."""
    lines = [f"greedy accuracy  {'CoT':>7} {'TIR':>7}"]
    has_before = before is not None and before.tir is not None
    if has_before:
        lines.append(f"{'pi_SFT':<16} {before.greedy_accuracy:>7.1%} {before.tir.greedy_accuracy:>7.1%}")
    lines.append(f"{algo.upper():<16} {after.greedy_accuracy:>7.1%} {after.tir.greedy_accuracy:>7.1%}")
    if has_before:
        cot, tir = after.greedy_accuracy - before.greedy_accuracy, after.tir.greedy_accuracy - before.tir.greedy_accuracy
        lines.append(f"{'change':<16} {f'{100 * cot:+.1f}pt':>7} {f'{100 * tir:+.1f}pt':>7}")
    return "\n".join(lines)


def report_results(config: Config, task, run_dir: Path, history: list[dict], before, after) -> dict:
    """Print and write the before/after table and the reward curve (of every step the run logged,
    before a resume too); the summary's results."""
    logged = run_dir / "metrics.jsonl"
    history = (read_metrics(logged) if logged.is_file() else []) or history
    table = format_table(task, before, after, config.algo)
    print(table)
    if after.reward_means is not None:
        return _report_reward_means(config, run_dir, history, table, before, after)
    if after.tir is not None:
        tir, cot_s = after.tir, after.greedy_seconds
        ratio = f"{tir.seconds / cot_s:.1f}x CoT greedy's {cot_s:.1f}s; " if cot_s > 0 else ""
        print(f"TIR evaluation of {tir.num_questions} questions: {tir.seconds:.1f}s ({ratio}generation "
              f"{tir.generate_seconds:.1f}s, {tir.programs} programs {tir.tool_seconds:.1f}s)")
    print(f"held-out {after.headline()}")
    if distributed.is_main():  # every process evaluated the same questions; one writes
        (run_dir / "results.md").write_text(table + "\n")
        plot_reward_curve(history, run_dir / "reward_curve.png",
                          title=f"grpokit {config.algo.upper()} (seed {config.seed})",
                          baseline=before.greedy_accuracy if before else None, final=after.greedy_accuracy)
    refreshes = run_dir / "reward_model_metrics.jsonl"
    rm_rounds = [json.loads(line) for line in refreshes.read_text().splitlines()] if refreshes.is_file() else []
    out = {
        "reward": "rule" if config.reward_model.kind == "none" else "model",
        "supervision": "process" if config.reward_model.kind == "process" else "outcome",
        "iterations": config.iterative.iterations,
        "reward_model": next((r for r in rm_rounds if r.get("round", 0) == 0), None),
        "reward_model_refreshes": [r for r in rm_rounds if r.get("round", 0) > 0],
        "grpo_accuracy": after.greedy_accuracy, "grpo": after.as_dict(),
        "greedy_change": _as_dict(greedy_change(before, after)),
        "heldout_curve": heldout_curve(history, before.greedy_accuracy if before else None, after.greedy_accuracy),
        **{f"grpo_{key.replace(' ', '_')}": value for key, value in task.report(after).items()},
    }
    if after.tir is not None:
        out["grpo_tir_accuracy"] = after.tir.greedy_accuracy
    if before is not None and before.tir is not None and after.tir is not None:
        out.update(sft_tir_accuracy=before.tir.greedy_accuracy,
                   tir_improvement_points=100 * (after.tir.greedy_accuracy - before.tir.greedy_accuracy))
    if before is not None:
        out.update({"sft_accuracy": before.greedy_accuracy, "sft": before.as_dict(),
                    "improvement_points": 100 * (after.greedy_accuracy - before.greedy_accuracy),
                    **{f"sft_{key.replace(' ', '_')}": value for key, value in task.report(before).items()}})
    return out


def _report_reward_means(config: Config, run_dir: Path, history: list[dict], table: str, before, after) -> dict:
    """The report of questions without reference answers: the table, the reward curve, and the
    summary's held-out reward means before and after RL."""
    print(f"held-out {after.headline()}")
    if distributed.is_main():
        (run_dir / "results.md").write_text(table + "\n")
        plot_reward_curve(history, run_dir / "reward_curve.png",
                          title=f"grpokit {config.algo.upper()} (seed {config.seed})")
    return {"heldout_reward_means": {"before": before.reward_means if before is not None else None,
                                     "after": after.reward_means},
            "heldout_questions": after.num_questions}
