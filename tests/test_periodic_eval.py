"""eval.every_steps: the held-out learning curve, evaluated during RL without changing what RL does."""

from __future__ import annotations

import json

from run_helpers import RUN, cli

from grpokit.eval.plots import heldout_curve
from grpokit.run.metrics import read_metrics


def test_the_curve_runs_from_before_through_each_evaluated_step_to_after():
    rows = [{"step": 1}, {"step": 2, "heldout/greedy_accuracy": 0.25}, {"step": 3},
            {"step": 4, "heldout/greedy_accuracy": 0.5}, {"step": 5}]
    assert heldout_curve(rows, 0.125, 0.75) == [(0, 0.125), (2, 0.25), (4, 0.5), (5, 0.75)]
    assert heldout_curve(rows) == [(2, 0.25), (4, 0.5)]
    assert heldout_curve([], 0.1, 0.2) == [(0, 0.1)]


def test_every_steps_logs_the_curve_and_trains_exactly_as_without(tmp_path):
    args = [*RUN, "--grpo.max_steps=5", "--eval.k=0", "--eval.tir=false", "--eval.before=true"]
    cli("train", f"--output_dir={tmp_path / 'plain'}", *args)
    cli("train", f"--output_dir={tmp_path / 'curve'}", *args, "--eval.every_steps=2")
    plain, curve = read_metrics(tmp_path / "plain" / "metrics.jsonl"), read_metrics(tmp_path / "curve" / "metrics.jsonl")
    # steps 2 and 4; step 5 is the last, which the evaluation after RL covers
    assert [r["step"] for r in curve if "heldout/greedy_accuracy" in r] == [2, 4]
    assert all(r["perf/heldout_eval_time_s"] > 0 for r in curve if "heldout/greedy_accuracy" in r)
    for a, b in zip(plain, curve):
        assert {k: a[k] for k in ("reward/mean", "loss", "kl", "entropy")} == \
            {k: b[k] for k in ("reward/mean", "loss", "kl", "entropy")}
    summary = json.loads((tmp_path / "curve" / "summary.json").read_text())
    steps = [step for step, _ in summary["heldout_curve"]]
    assert steps == [0, 2, 4, 5]
    assert summary["heldout_curve"][-1][1] == summary["grpo_accuracy"]
    assert (tmp_path / "curve" / "reward_curve.png").stat().st_size > 0


def test_each_evaluation_first_readies_an_engine_that_holds_its_own_weights(monkeypatch):
    """With rollout workers, the trainer's own engine (vLLM) received no push during training: the
    sampler's ready_for_eval gives it the step's weights before every evaluation, as before the last one."""
    from types import SimpleNamespace

    from grpokit.checks import load_config
    from grpokit.pipeline import rl

    calls = []

    class Sampler:
        def ready_for_eval(self, step):
            calls.append(("ready", step))

    def evaluate(*args, **kwargs):
        calls.append(("evaluate", kwargs["k"]))
        return SimpleNamespace(greedy_accuracy=0.5)

    monkeypatch.setattr(rl, "evaluate", evaluate)
    config = load_config(overrides=["--eval.every_steps=2", "--grpo.max_steps=5"])
    task = SimpleNamespace(extract_answer=None, grade=None)
    run = SimpleNamespace(config=config, task=task, model=None, tokenizer=None, engine=None,
                          heldout=[{"prompt": "q", "answer": "1"}])
    hook = rl._periodic_heldout(run, Sampler())
    assert hook(1) == {} and calls == []
    assert hook(2)["heldout/greedy_accuracy"] == 0.5
    assert calls == [("ready", 2), ("evaluate", 0)]  # greedy only
    assert hook(4) and hook(5) == {}  # step 5 is the last: the evaluation after RL
    assert calls[2:] == [("ready", 4), ("evaluate", 0)]
    run = SimpleNamespace(config=load_config(), task=task, model=None, tokenizer=None, engine=None,
                          heldout=[{"prompt": "q"}])
    assert rl._periodic_heldout(run, Sampler()) is None
