"""Evaluation: greedy accuracy, pass@k and maj@k; reports and plots."""

from grpokit.eval.evaluate import EvalResult, evaluate, pass_at_k

__all__ = ["EvalResult", "evaluate", "pass_at_k"]
