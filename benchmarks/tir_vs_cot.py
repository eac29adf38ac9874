"""Evaluation time with tool-integrated reasoning (TIR) against chain-of-thought (CoT), on the
demo's held-out questions, and where TIR's time goes.

    python benchmarks/tir_vs_cot.py runs/demo --repeats 3

loads the run's pi_SFT (checkpoints/sft) and evaluates its 500 held-out questions greedily,
alternating CoT, TIR, CoT, TIR, ... in one process so drift in machine load hits both alike.
CoT is one batched generation. TIR generates until "```output", runs every program in
grpokit.tools.sandbox (a fresh isolated interpreter each, `--workers` at a time), appends the output
and generates again (eval.max_tool_calls rounds). Prints a Markdown table of median seconds,
TIR's split into generation and programs, and the TIR / CoT ratio; then the sandbox's cost per
program alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a demo run directory (its checkpoints/sft is evaluated)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=int, default=500)
    args = parser.parse_args(argv)

    from grpokit.config import read_config as load_config
    from grpokit.eval.evaluate import evaluate_tir
    from grpokit.models import load_model_and_tokenizer
    from grpokit.rollout import HFEngine, SamplingParams, max_model_len
    from grpokit.tools.sandbox import namespaces_available, run_many
    from grpokit.tasks import task_for

    run = Path(args.run)
    config = load_config(run / "config.yaml")
    config.task.num_eval_questions = args.questions
    task = task_for(config)
    model, tokenizer = load_model_and_tokenizer(str(run / "checkpoints" / "sft"))
    rows = task.data(tokenizer, sft=False).heldout
    tir_rows = task.tir_rows(rows, tokenizer)
    if tir_rows is None:
        sys.exit(f"{run}: its pi_SFT's tokenizer cannot write programs; run a demo with model.tiny.alphabet=arithmetic-tir")
    engine, e, max_new = HFEngine(model, tokenizer), config.eval, config.grpo.max_completion_length

    def cot() -> tuple[float, float]:
        start = time.perf_counter()
        out = engine.generate([r["prompt"] for r in rows], 1, SamplingParams(max_new, 0.0, 1.0, e.batch_size))
        hits = sum(task.extract_answer(c) == r["answer"] for r, c in zip(rows, out.completions))
        return time.perf_counter() - start, hits / len(rows)

    cot_runs, tir_runs = [], []
    cot()  # warm-up: first-call allocations
    for _ in range(args.repeats):
        cot_runs.append(cot())
        tir_runs.append(evaluate_tir(engine, tokenizer, tir_rows, task.tir_answer, max_new,
                                     max_model_len(config.rollout, model), e.max_tool_calls, e.tool_timeout_s,
                                     e.batch_size))
    cot_s = statistics.median(s for s, _ in cot_runs)
    tir_s = statistics.median(r.seconds for r in tir_runs)
    gen_s = statistics.median(r.generate_seconds for r in tir_runs)
    tool_s = statistics.median(r.tool_seconds for r in tir_runs)
    programs = tir_runs[-1].programs
    print(f"{len(rows)} held-out questions, greedy, {args.repeats} runs each (median); "
          f"programs isolated in namespaces: {namespaces_available()}\n")
    print("| mode | seconds | vs CoT | generation | programs | accuracy |")
    print("|---|---|---|---|---|---|")
    print(f"| CoT | {cot_s:.2f} | 1 | {cot_s:.2f} | - | {cot_runs[-1][1]:.1%} |")
    print(f"| TIR | {tir_s:.2f} | {tir_s / cot_s:.2f}x | {gen_s:.2f} | {programs} in {tool_s:.2f} s "
          f"({1000 * tool_s / max(1, programs):.1f} ms each) | {tir_runs[-1].greedy_accuracy:.1%} |")

    start = time.perf_counter()
    run_many(["print(1)"] * 200)
    alone = time.perf_counter() - start
    print(f"\nsandbox alone: 200 programs `print(1)` in {alone:.2f} s ({5 * alone:.1f} ms each, wall, "
          "one worker per CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
