"""Do bf16 GRPO steps move the weights? Side by side from one pi_SFT, through `grpokit train`:

  fp32         model.dtype=fp32: fp32 weights and compute (the reference)
  bf16         model.dtype=bf16: bf16 compute over fp32 master weights (the default on CUDA)
  bf16-same    model.dtype=bf16 model.master_dtype=same: bf16 weights, no master copy (the old behaviour)

Each runs the same `--steps` GRPO steps at `--lr` (12 steps at 2e-6 by default: a small learning
rate, as a 7B run uses, is where bf16 rounding swallows updates). The movement of a run is the mean
|w_after - w_before| over every weight, w_after being the weights that go on training (the fp32
master weights, checkpoints/step-N/master/, where there are some) and w_before pi_SFT's weights
held the same way (fp32, or rounded to bf16 for bf16-same). The check passes when bf16's movement
is within 10% of fp32's.

    python benchmarks/bf16_movement.py --out runs/movement                       # SFTs a demo pi_SFT first
    python benchmarks/bf16_movement.py --sft-dir runs/demo/checkpoints/sft --device cuda --out runs/movement

Writes OUT/movement.json: {fp32,bf16,bf16_same}_mean_abs_dw, their changed fractions, ratio
(bf16 / fp32), pass.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
PRESET = REPO / "src" / "grpokit" / "presets" / "demo.yaml"
VARIANTS = {"fp32": ["--model.dtype=fp32"], "bf16": ["--model.dtype=bf16"],
            "bf16_same": ["--model.dtype=bf16", "--model.master_dtype=same"]}


def grpokit(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "grpokit.cli", *args, "--quiet"], check=True, env=env)


def trained_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The weights a run goes on training from: master/ (fp32) when the checkpoint has it."""
    directory = checkpoint / "master" if (checkpoint / "master" / "model.safetensors").is_file() else checkpoint
    return load_file(str(directory / "model.safetensors"))


def movement(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(mean |after - before| over every weight, share of weights that changed), in float64."""
    total, changed, count = 0.0, 0, 0
    for name, w in before.items():
        delta = (after[name].double() - w.double()).abs()
        total += float(delta.sum())
        changed += int((delta > 0).sum())
        count += delta.numel()
    return total / count, changed / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sft-dir", help="pi_SFT checkpoint (default: SFT the demo's now, into OUT/sft)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more grpokit train overrides")
    args = parser.parse_args(argv)
    out = Path(args.out)
    started = time.perf_counter()
    sft_dir = Path(args.sft_dir) if args.sft_dir else None
    if sft_dir is None:
        grpokit("sft", str(PRESET), f"--output-dir={out / 'sft'}", "--model.dtype=fp32",
                f"--model.device={args.device}")
        sft_dir = out / "sft" / "checkpoints" / "sft"
    start = trained_weights(sft_dir)
    result: dict = {"steps": args.steps, "lr": args.lr, "device": args.device, "sft_dir": str(sft_dir)}
    for name in args.variants:
        run = out / name
        grpokit("train", str(PRESET), f"--output-dir={run}", f"--model.name_or_path={sft_dir}",
                f"--model.device={args.device}", f"--grpo.max_steps={args.steps}",
                f"--grpo.learning_rate={args.lr}", "--eval.before=false", "--task.num_eval_questions=1",
                "--eval.tir=false", *VARIANTS[name], *args.extra)
        before = start if name != "bf16_same" else {k: v.to(torch.bfloat16) for k, v in start.items()}
        mean, changed = movement(before, trained_weights(run / "checkpoints" / f"step-{args.steps}"))
        result[f"{name}_mean_abs_dw"], result[f"{name}_changed_frac"] = mean, changed
        print(f"{name:10s} mean |dw| {mean:.3e}, {changed:.1%} of weights changed", flush=True)
    if "fp32" in args.variants and "bf16" in args.variants:
        if result["fp32_mean_abs_dw"] == 0:  # rewards that never varied: nothing moved, nothing to compare
            result["ratio"], result["pass"] = None, False
            print("fp32 did not move the weights (no reward varied within a group): no ratio")
        else:
            result["ratio"] = result["bf16_mean_abs_dw"] / result["fp32_mean_abs_dw"]
            result["pass"] = abs(result["ratio"] - 1) <= 0.10
            print(f"bf16 / fp32 movement: {result['ratio']:.3f} (target 0.90-1.10: "
                  f"{'met' if result['pass'] else 'MISSED'})")
    result["seconds"] = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "movement.json").write_text(json.dumps(result, indent=2))
    return 0 if result.get("pass", True) else 1


if __name__ == "__main__":
    sys.exit(main())
