"""`grpokit bench limit`: generation measured against what this machine can do at most.

In one run, on the machine it runs on:
  bandwidth   the best of a few copies of a large tensor (bytes read + bytes written, per second)
  matmul      the best of a few square GEMMs, in fp32 and in bf16 (2 n^3 FLOPs each)
  generation  one rollout batch of a config (default: the SmolLM2 example: its prompts_per_step x
              num_generations completions of its first training prompts, chat-templated as training
              renders them, its max_completion_length and temperature), through rollout.engine=hf, in
              fp32 and in bf16 (model.dtype), with the prompt prefilled once per group and per row
Each way's time is printed against the machine's bound for the work the batch needs:
  prefill  FLOPs / peak: each distinct prompt once (the linear layers, attention, the LM head at its
           last position)
  decode   (weight bytes x decode steps + KV-cache bytes read) / bandwidth + FLOPs / peak, where the
           weights are every linear layer's (LoRA adapters and the tied LM head included) in the
           compute dtype, the steps are the batch's longest completion less one, and the FLOPs and KV
           bytes count each row's own tokens only
so "at 27% of the limit" means the way took 1/0.27 times the least time this machine could take.
The bound adds the memory and compute times (no overlap), as the issue that asked for it defines it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = "examples/smollm2_word_arithmetic.yaml"
DTYPES = ("fp32", "bf16")


def best_seconds(fn, repeats: int) -> float:
    """The shortest of `repeats` timed calls of fn() (after one untimed call): the machine's best, not its average."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def machine_facts() -> dict:
    """CPU model, cores, the flags that decide bf16 speed, and the library versions."""
    import torch
    import transformers

    cpu, flags = platform.processor() or platform.machine(), ""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model name":
                cpu = value.strip()
            if key.strip() == "Flags":
                flags = value
    except (OSError, subprocess.SubprocessError):
        pass
    have = sorted({f for f in flags.split() if f.startswith(("amx", "avx512_bf16", "avx512_fp16"))})
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "bf16_flags": have,
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def measure_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of `dst.copy_(src)` over `nbytes`-byte tensors: each copy reads and writes nbytes."""
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src), repeats)


def measure_matmul(n: int, dtype: str, repeats: int) -> float:
    """FLOP/s of an n x n by n x n product in `dtype`."""
    import torch

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = torch.randn(n, n).to(torch_dtype), torch.randn(n, n).to(torch_dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats)


def smoke_overrides() -> list[str]:
    """The default config's tiny model at a few prompts and tokens: every field, in seconds."""
    return ["--grpo.prompts_per_step=2", "--grpo.num_generations=2", "--grpo.max_completion_length=4",
            "--grpo.generation_batch_size=4", "--num_rl_questions=8", "--num_eval_questions=2"]


def run_limit(args) -> dict:
    import torch

    say = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    # The thread settings change every number here, so the command carries them.
    env = [f"{key}={os.environ[key]}" for key in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if key in os.environ]
    command = " ".join([*env, "grpokit bench limit", *map(shlex.quote, args.argv)])
    machine = machine_facts()
    say(f"{machine['cpu']}, {machine['cores']} cores ({machine['torch_threads']} torch threads), "
        f"bf16 flags: {', '.join(machine['bf16_flags']) or 'none'}; torch {machine['torch']}")
    copy_bytes = (1 << 20) * (1 if args.smoke else args.copy_mib)
    gemm = 64 if args.smoke else args.gemm
    bandwidth = measure_bandwidth(copy_bytes, args.repeats)
    say(f"memory bandwidth: {bandwidth / 1e9:.1f} GB/s (copy of {copy_bytes >> 20} MiB, read + write, best of "
        f"{args.repeats})")
    peaks = {}
    for dtype in DTYPES:
        peaks[dtype] = measure_matmul(gemm, dtype, args.repeats)
        say(f"matmul {dtype}: {peaks[dtype] / 1e9:.0f} GFLOP/s ({gemm} x {gemm} x {gemm}, best of {args.repeats})")
    torch.manual_seed(0)
    path = None if args.smoke else args.config
    overrides = [*(smoke_overrides() if args.smoke else []), *args.overrides]
    from grpokit.bench.generation import measure_generation  # the model stack: not on `grpokit --help`

    batch, ways = measure_generation(path, overrides, args.gen_repeats, bandwidth, peaks, say)
    fastest = {dtype: min(w["seconds"] for w in ways if w["dtype"] == dtype) for dtype in DTYPES}
    return {"command": command, "config": path, "overrides": overrides, "machine": machine,
            "bandwidth_bytes_per_s": bandwidth, "copy_bytes": copy_bytes, "gemm_n": gemm,
            "matmul_flops_per_s": peaks, "batch": batch, "ways": ways, "fastest_seconds": fastest}


def result_tables(result: dict) -> dict:
    """The docs' tables of a result (docs/results/machine-limit.md shows them; tests/test_results_tables.py
    checks them cell for cell), rows pointing at the result's own numbers."""
    machine = {"columns": [{"title": "memory bandwidth (GB/s)", "key": "bandwidth", "format": "giga"},
                           {"title": "matmul fp32 (GFLOP/s)", "key": "fp32", "format": "giga"},
                           {"title": "matmul bf16 (GFLOP/s)", "key": "bf16", "format": "giga"}],
               "rows": [{"bandwidth": result["bandwidth_bytes_per_s"], **result["matmul_flops_per_s"]}]}
    ways = {"columns": [{"title": "dtype", "key": "dtype"}, {"title": "prefill", "key": "prefill"},
                        {"title": "generation", "key": "seconds", "format": "seconds"},
                        {"title": "tokens/s", "key": "tokens_per_s", "format": "rate"},
                        {"title": "bound", "key": "bound.total_s", "format": "seconds"},
                        {"title": "of which prefill", "key": "bound.prefill_s", "format": "seconds"},
                        {"title": "fraction of the limit", "key": "fraction_of_limit", "format": "pct"}],
            "rows": [{**w, "prefill": "shared" if w["shared_prefill"] else "per row"} for w in result["ways"]]}
    return {"machine": machine, "generation": ways}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="grpokit bench limit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="the run whose rollout batch is generated")
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the copied tensor")
    parser.add_argument("--gemm", type=int, default=2048, help="n of the n x n x n matmul")
    parser.add_argument("--repeats", type=int, default=3, help="timed copies and matmuls (the best counts)")
    parser.add_argument("--gen-repeats", type=int, default=1, help="timed batches per way (the best counts)")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="the tiny default model and small sizes: a check "
                        "that every field is produced, in seconds; its numbers mean nothing")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("overrides", nargs="*", help="config overrides, --key=value, after --")
    args = parser.parse_args(argv)
    args.argv = argv
    if not args.smoke and not Path(args.config).is_file():
        print(f"grpokit: error: --config {args.config} does not exist; run from the repository root, or pass "
              "--config PATH (or --smoke)", file=sys.stderr)
        return 2
    result = run_limit(args)
    result["tables"] = result_tables(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
