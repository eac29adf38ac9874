"""Plots a person would rather look at than read: the reward curve of a run."""

from __future__ import annotations

from pathlib import Path


def plot_reward_curve(metrics: list[dict], path: str | Path, title: str = "GRPO", baseline: float | None = None,
                      final: float | None = None) -> Path:
    """Mean reward per step (with a moving average) and KL to the reference, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    reward = [m["reward/mean"] for m in metrics]
    kl = [m.get("kl", 0.0) for m in metrics]
    window = max(1, len(reward) // 20)
    smooth = [sum(reward[max(0, i - window + 1) : i + 1]) / len(reward[max(0, i - window + 1) : i + 1])
              for i in range(len(reward))]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, reward, color="tab:blue", alpha=0.3, label="reward (batch mean)")
    ax.plot(steps, smooth, color="tab:blue", label=f"reward ({window}-step mean)")
    if baseline is not None:
        ax.axhline(baseline, color="tab:gray", ls="--", label=f"SFT held-out greedy acc {baseline:.2f}")
    if final is not None:
        ax.axhline(final, color="tab:green", ls="--", label=f"GRPO held-out greedy acc {final:.2f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax2 = ax.twinx()
    ax2.plot(steps, kl, color="tab:red", alpha=0.6, label="KL to reference (k3)")
    ax2.set_ylabel("KL", color="tab:red")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
