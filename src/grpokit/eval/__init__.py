"""Evaluation: greedy accuracy, pass@k and maj@k; CoT and tool-integrated benchmarks
(`grpokit eval`); reports and plots."""

from grpokit.eval import benchmark as _benchmark
from grpokit.eval.benchmark import grade_completion_file, run_evaluation
from grpokit.eval.evaluate import EvalResult, evaluate, pass_at_k
from grpokit.eval.questions import Benchmark, load_benchmark
from grpokit.eval.report import compare_runs

__all__ = ["Benchmark", "EvalResult", "compare_runs", "evaluate", "load_benchmark", "pass_at_k",
           "grade_completion_file", "run_evaluation"]


def __getattr__(name: str):
    """grpokit.eval.score_completions: the old name of grade_completion_file (eval/benchmark.py says so)."""
    return getattr(_benchmark, name)
