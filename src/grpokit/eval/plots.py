"""Plots a person would rather look at than read: the training curves of a run."""

from __future__ import annotations

from pathlib import Path


def _moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1) : i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def plot_reward_curve(metrics: list[dict], path: str | Path, title: str = "GRPO", baseline: float | None = None,
                      final: float | None = None) -> Path:
    """Reward, completion length and KL per step, stacked, as a PNG.

    baseline / final: held-out greedy accuracy before and after, drawn as reference lines; rows with
    heldout/greedy_accuracy (eval.every_steps) add the held-out learning curve, from baseline to final.
    """
    panels = [
        ("reward/mean", "train reward (sampled rollouts)", "tab:blue"),
        ("completion/mean_length", "completion tokens", "tab:purple"),
        ("kl", "KL to reference (k3)", "tab:red"),
    ]
    fig, axes = _stacked_curves(metrics, panels, title, "GRPO step")
    reward_ax = axes[0]
    if baseline is not None:
        reward_ax.axhline(baseline, color="tab:gray", ls="--", label=f"held-out greedy accuracy, SFT: {baseline:.1%}")
    if final is not None:
        reward_ax.axhline(final, color="tab:green", ls="--", label=f"held-out greedy accuracy, after RL: {final:.1%}")
    if any("heldout/greedy_accuracy" in r for r in metrics):
        reward_ax.plot(*zip(*heldout_curve(metrics, baseline, final)), "o-", color="tab:green", ms=4,
                       label="held-out greedy accuracy")
    reward_ax.set_ylim(-0.02, 1.02)
    return _save(fig, axes, path)


def heldout_curve(metrics: list[dict], before: float | None = None, after: float | None = None
                  ) -> list[tuple[int, float]]:
    """(step, held-out greedy accuracy): `before` at step 0, every row's heldout/greedy_accuracy, and
    `after` at the last step."""
    curve = [(0, before)] if before is not None else []
    curve += [(r["step"], r["heldout/greedy_accuracy"]) for r in metrics if "heldout/greedy_accuracy" in r]
    if after is not None and metrics:
        curve.append((metrics[-1]["step"], after))
    return curve


def plot_loss_curve(metrics: list[dict], path: str | Path, title: str = "SFT") -> Path:
    """SFT's loss, gradient norm and learning rate per step (sft_metrics.jsonl rows), stacked, as a PNG."""
    panels = [
        ("loss", "SFT loss (mean token NLL)", "tab:blue"),
        ("grad_norm", "gradient norm (before clipping)", "tab:red"),
        ("lr", "learning rate", "tab:gray"),
    ]
    fig, axes = _stacked_curves(metrics, panels, title, "SFT step")
    return _save(fig, axes, path)


def _stacked_curves(metrics: list[dict], panels: list[tuple[str, str, str]], title: str, xlabel: str):
    """One panel per (key, label, colour): the raw values faint, a moving average over them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not metrics:
        raise ValueError("no metrics to plot: the run logged no steps")
    steps = [m["step"] for m in metrics]
    window = max(1, len(steps) // 20)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 6.5), dpi=120, sharex=True)
    for ax, (key, label, color) in zip(axes, panels):
        values = [float(m.get(key) or 0.0) for m in metrics]
        ax.plot(steps, values, color=color, alpha=0.25)
        ax.plot(steps, _moving_average(values, window), color=color, label=f"{label}, {window}-step mean")
        ax.set_ylabel(label.split(" (")[0])
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel(xlabel)
    axes[0].set_title(title)
    return fig, axes


def _save(fig, axes, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
