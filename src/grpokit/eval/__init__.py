"""Evaluation: greedy accuracy, pass@k and maj@k; CoT and tool-integrated benchmarks
(`grpokit eval`); reports and plots."""

from grpokit.eval.benchmark import run_evaluation, score_completions
from grpokit.eval.evaluate import EvalResult, evaluate, pass_at_k
from grpokit.eval.questions import Benchmark, load_benchmark
from grpokit.eval.report import compare_runs

__all__ = ["Benchmark", "EvalResult", "compare_runs", "evaluate", "load_benchmark", "pass_at_k",
           "run_evaluation", "score_completions"]
