"""Analytic memory of model states under bf16 mixed precision with Adam, per model of an RL run.

A trained model holds bf16 weights (2 B/param), bf16 gradients (2), an fp32 master copy (4) and
Adam's two fp32 moments (8): 16 bytes per parameter. A frozen model (the reference, a reward
model) holds only its bf16 weights: 2 bytes per parameter. Activations, the KV cache and
framework overhead come on top and depend on batch and length, so they are left out.
"""

from __future__ import annotations

TRAINED_BYTES = {"weights (bf16)": 2, "grads (bf16)": 2, "fp32 master": 4, "Adam m+v (fp32)": 8}
FROZEN_BYTES = {"weights (bf16)": 2}


def model_bytes(params: float, trained: bool) -> dict[str, float]:
    parts = TRAINED_BYTES if trained else FROZEN_BYTES
    out = {name: params * b for name, b in parts.items()}
    out["total"] = sum(out.values())
    return out


def rl_memory(params: float, reward_model_params: float = 0.0, critic_params: float | None = None) -> dict:
    """Bytes of model state for GRPO and PPO on a policy of `params` parameters.

    GRPO: policy (trained) + reference (frozen) [+ reward model (frozen)].
    PPO:  the same + a critic (trained, the policy's size unless critic_params says otherwise).
    """
    critic_params = params if critic_params is None else critic_params
    models = {
        "policy": model_bytes(params, trained=True)["total"],
        "reference": model_bytes(params, trained=False)["total"],
        "reward model": model_bytes(reward_model_params, trained=False)["total"],
        "critic": model_bytes(critic_params, trained=True)["total"],
    }
    grpo = models["policy"] + models["reference"] + models["reward model"]
    ppo = grpo + models["critic"]
    return {"params": params, "models": models, "grpo_bytes": grpo, "ppo_bytes": ppo, "saved_bytes": ppo - grpo,
            "ratio": grpo / ppo}


def gib(x: float) -> str:
    return f"{x / 2**30:,.1f} GiB"


def format_table(sizes: list[float], reward_model_params: float = 0.0) -> str:
    lines = ["| policy size | policy | reference | critic (PPO) | reward model | GRPO total | PPO total | GRPO saves | GRPO/PPO |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in sizes:
        r = rl_memory(p, reward_model_params)
        m = r["models"]
        lines.append(f"| {p / 1e9:g}B | {gib(m['policy'])} | {gib(m['reference'])} | {gib(m['critic'])} | "
                     f"{gib(m['reward model'])} | {gib(r['grpo_bytes'])} | {gib(r['ppo_bytes'])} | "
                     f"{gib(r['saved_bytes'])} | {r['ratio']:.2f} |")
    per = ", ".join(f"{k} {v} B" for k, v in TRAINED_BYTES.items())
    lines.append(f"\nTrained model: {per} = 16 B/param; frozen model: 2 B/param (bf16 weights). "
                 "Activations and KV cache not included.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="grpokit bench memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=float, nargs="+", default=[1.5e9, 7e9, 70e9],
                        help="policy sizes in parameters (default: 1.5e9 7e9 70e9)")
    parser.add_argument("--reward-model-params", type=float, default=0.0,
                        help="a learned reward model's size (0 = a rule-based verifier)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    print(format_table(args.params, args.reward_model_params))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([rl_memory(p, args.reward_model_params) for p in args.params], f, indent=2)
    return 0
