"""Evaluation: greedy accuracy, pass@k and maj@k; CoT and tool-integrated benchmarks
(`grpokit eval`); reports and plots."""

from grpokit.eval.benchmark import (
    Benchmark,
    compare_runs,
    load_benchmark,
    run_evaluation,
    score_completions,
)
from grpokit.eval.evaluate import EvalResult, evaluate, pass_at_k

__all__ = ["Benchmark", "EvalResult", "compare_runs", "evaluate", "load_benchmark", "pass_at_k",
           "run_evaluation", "score_completions"]
