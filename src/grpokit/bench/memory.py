"""Memory of an RL run: analytic model-state memory of GRPO vs PPO, or, with --measure, measured peaks:
per process of real GRPO steps, full fine-tune vs LoRA, on 1 vs 2 processes (--table setups), and of
a GRPO step and an SFT step at 1,024-token completions, at a batch and at twice it (--table lengths).

Analytic: model states under bf16 mixed precision with Adam, per model of an RL run.

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


def measure(model_args: list[str], lora_r: int, processes: list[int], timeout_s: float = 1800) -> list[dict]:
    """Peak memory per process of a few GRPO steps (bench/memory_probe.py), measured in fresh
    processes: full fine-tune and LoRA (rank `lora_r`), each on every count in `processes`
    (several processes: torchrun with FSDP2). One row per setup, the largest peak over its processes."""
    import json
    import os
    import socket
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    rows = []
    for r in (0, lora_r):
        for n in processes:
            with tempfile.TemporaryDirectory() as out:
                probe = ["-m", "grpokit.bench.memory_probe", "--out", out, "--lora-r", str(r), *model_args]
                if n > 1:
                    with socket.socket() as s:
                        s.bind(("127.0.0.1", 0))
                        port = s.getsockname()[1]
                    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
                               "--master_port", str(port), *probe]
                else:
                    command = [sys.executable, *probe]
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
                if done.returncode != 0:
                    raise RuntimeError(f"memory probe {' '.join(command)} failed:\n{done.stderr[-3000:]}")
                records = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
            rows.append({"setup": f"LoRA r={r}" if r else "full", "processes": n, "params": records[0]["params"],
                         "device": records[0]["device"], "peak_bytes": max(x["peak_bytes"] for x in records),
                         "baseline_bytes": max(x["baseline_bytes"] for x in records),
                         "seconds": max(x["seconds"] for x in records)})
    return rows


def format_measured(rows: list[dict]) -> str:
    base = next((r["peak_bytes"] for r in rows if r["setup"] == "full" and r["processes"] == 1), None)
    lines = [f"measured peak memory per process, {rows[0]['params'] / 1e6:.2f}M parameters on {rows[0]['device']}",
             "| setup | processes | peak per process | vs full, 1 process |", "|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['peak_bytes'] / base:.2f}" if base else "-"
        lines.append(f"| {r['setup']} | {r['processes']} | {r['peak_bytes'] / 2**20:,.0f} MiB | {ratio} |")
    lines.append("\nPeak over a few GRPO steps (sampling, reference log-probs, update), after the models are built "
                 "and sharded: CUDA max_memory_allocated, or the CPU's peak resident set less the process's size "
                 f"before any model was built ({max(r['baseline_bytes'] for r in rows) / 2**20:,.0f} MiB at most: "
                 "Python, torch and their libraries).")
    return "\n".join(lines)


def run_probe(arguments: list[str], timeout_s: float = 1800) -> dict:
    """One long-sequence measurement (memory_probe --workload grpo|sft) in a fresh process."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "grpokit.bench.memory_probe", "--out", out, *arguments]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"memory probe {' '.join(command)} failed:\n{done.stderr[-3000:]}")
        return json.loads((Path(out) / "rank0.json").read_text())


def measure_lengths(model_args: list[str], grpo_batch: int, sft_batch: int, max_tokens: int) -> list[dict]:
    """Peak memory of a GRPO step at prompts_per_step B and 2B and of an SFT step at batch_size B and 2B,
    each in a fresh process, all under the token budget `max_tokens`."""
    rows = []
    for workload, batch in (("grpo", grpo_batch), ("sft", sft_batch)):
        for b in (batch, 2 * batch):
            record = run_probe([*model_args, "--workload", workload, "--batch", str(b), "--max-tokens", str(max_tokens)])
            rows.append({**record, "max_tokens": max_tokens})
    return rows


def format_lengths(rows: list[dict], completion_length: int, prompt_length: int, num_generations: int) -> str:
    lines = [f"peak memory of one step at {completion_length}-token completions, {rows[0]['params'] / 1e6:.1f}M "
             f"parameters on {rows[0]['device']}, max_tokens_per_micro_batch={rows[0]['max_tokens']}",
             "| step | batch | rows x tokens | peak | vs batch | seconds |", "|---|---|---|---|---|---|"]
    first: dict[str, int] = {}
    for r in rows:
        base = first.setdefault(r["workload"], r["peak_bytes"])
        name = "prompts_per_step" if r["workload"] == "grpo" else "batch_size"
        n = r["batch"] * (num_generations if r["workload"] == "grpo" else 1)
        change = "-" if r["peak_bytes"] == base else f"{100 * (r['peak_bytes'] / base - 1):+.1f}%"
        lines.append(f"| {r['workload'].upper()} | {name}={r['batch']} | {n} x {prompt_length + completion_length} | "
                     f"{r['peak_bytes'] / 2**20:,.0f} MiB | {change} | {r['seconds']:.0f} |")
    lines.append("\nPeak over one step after the model (and, for GRPO, its frozen reference) is built: CUDA "
                 "max_memory_allocated, or the CPU's peak resident set less the process's size before any model. "
                 "GRPO completions are random tokens of the full length (generation is not measured); SFT "
                 "examples are random tokens of the same length.")
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
    measured = parser.add_argument_group("--measure: peak memory of real GRPO steps on a Llama of this shape "
                                         "(default 113M parameters)")
    measured.add_argument("--measure", action="store_true",
                          help="measure full vs LoRA, on 1 and on 2 processes (torchrun, FSDP2), instead")
    measured.add_argument("--hidden-size", type=int, default=768)
    measured.add_argument("--num-layers", type=int, default=12)
    measured.add_argument("--num-heads", type=int, default=12)
    measured.add_argument("--intermediate-size", type=int, default=3072)
    measured.add_argument("--lora-r", type=int, default=16)
    measured.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    measured.add_argument("--steps", type=int, default=2, help="GRPO steps measured")
    measured.add_argument("--max-completion-length", type=int, default=32)
    measured.add_argument("--table", choices=["all", "setups", "lengths"], default="all",
                          help="setups: full vs LoRA, 1 vs 2 processes; lengths: a GRPO and an SFT step at long "
                               "completions, batch B vs 2B (a ~110M Llama, 32k vocabulary; about 20 minutes on "
                               "one CPU thread of a busy 2-core machine)")
    lengths = parser.add_argument_group("--table lengths")
    lengths.add_argument("--completion-length", type=int, default=1024)
    lengths.add_argument("--prompt-length", type=int, default=64)
    lengths.add_argument("--vocab-size", type=int, default=32000)
    lengths.add_argument("--length-intermediate-size", type=int, default=2048,
                         help="MLP width of the long-sequence model (with 768 x 12 layers: ~110M parameters)")
    lengths.add_argument("--grpo-batch", type=int, default=1, help="prompts_per_step B (4 completions each)")
    lengths.add_argument("--sft-batch", type=int, default=2, help="sft.batch_size B")
    lengths.add_argument("--max-tokens", type=int, default=2304,
                         help="max_tokens_per_micro_batch of both (default: two rows of 1,088 tokens)")
    lengths.add_argument("--no-gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    if args.measure:
        out: dict = {}
        if args.table in ("all", "setups"):
            model_args = ["--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers), "--num-heads",
                          str(args.num_heads), "--intermediate-size", str(args.intermediate_size), "--steps",
                          str(args.steps), "--max-completion-length", str(args.max_completion_length)]
            out["setups"] = measure(model_args, args.lora_r, args.processes)
            print(format_measured(out["setups"]))
        if args.table in ("all", "lengths"):
            model_args = ["--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers), "--num-heads",
                          str(args.num_heads), "--intermediate-size", str(args.length_intermediate_size),
                          "--vocab-size", str(args.vocab_size), "--prompt-length", str(args.prompt_length),
                          "--completion-length", str(args.completion_length), "--num-generations", "4", "--steps", "1"]
            if not args.no_gradient_checkpointing:
                model_args.append("--gradient-checkpointing")
            out["lengths"] = measure_lengths(model_args, args.grpo_batch, args.sft_batch, args.max_tokens)
            print(("\n" if "setups" in out else "") + format_lengths(out["lengths"], args.completion_length,
                                                                     args.prompt_length, 4))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out if len(out) > 1 else next(iter(out.values())), f, indent=2)
        return 0
    print(format_table(args.params, args.reward_model_params))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([rl_memory(p, args.reward_model_params) for p in args.params], f, indent=2)
    return 0
