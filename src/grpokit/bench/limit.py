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


def model_shape(model) -> dict:
    """What the bound needs of a causal LM: its linear weights' elements (each tensor once: a tied LM head is
    the embedding), the LM head's, and the attention sizes."""
    import torch

    seen, linear = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.data_ptr() not in seen:
            seen.add(module.weight.data_ptr())
            linear += module.weight.numel()
    config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
    config = getattr(config, "text_config", config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    head = model.get_output_embeddings().weight.numel()
    return {"linear_params": linear, "head_params": head, "layers": config.num_hidden_layers,
            "q_width": config.num_attention_heads * head_dim,
            "kv_width": getattr(config, "num_key_value_heads", config.num_attention_heads) * head_dim}


def bound_seconds(shape: dict, prompt_lengths: list[int], completion_lengths: list[int], itemsize: int,
                  bandwidth: float, peak: float) -> dict:
    """{prefill, decode, total}: the least seconds this machine needs for the batch (module docstring).
    prompt_lengths: each distinct prompt's tokens; completion_lengths: each row's generated tokens and
    the real prompt length it continues ([(prompt, completion)] flattened as two lists of one length)."""
    body = shape["linear_params"] - shape["head_params"]
    attention = 4 * shape["layers"] * shape["q_width"]  # QK^T and AV: 2 x 2 x width FLOPs per (query, key)
    prefill_flops = sum(2 * body * p + attention * p * (p + 1) / 2 + 2 * shape["head_params"] for p in prompt_lengths)
    decode_flops = kv_bytes = 0.0
    steps = max((t for _, t in completion_lengths), default=1) - 1
    for p, t in completion_lengths:
        for step in range(1, t):  # token `step` of the row is sampled from the logits of the forward at p + step
            context = p + step
            decode_flops += 2 * shape["linear_params"] + attention * context
            kv_bytes += 2 * shape["layers"] * shape["kv_width"] * context * itemsize
    weight_bytes = shape["linear_params"] * itemsize
    prefill = prefill_flops / peak
    decode = (weight_bytes * steps + kv_bytes) / bandwidth + decode_flops / peak
    return {"prefill_s": prefill, "decode_s": decode, "total_s": prefill + decode, "decode_steps": steps,
            "prefill_flops": prefill_flops, "decode_flops": decode_flops, "weight_bytes": weight_bytes}


def rollout_batch(config) -> tuple[list[str], int]:
    """(prompts, num_generations): the config's first prompts_per_step training prompts, rendered as training renders them."""
    from grpokit.pipeline.build import load_policy
    from grpokit.tasks import task_for

    _, tokenizer = load_policy(config, trainable=False)
    task = task_for(config)
    rows = task.data(tokenizer, sft=False).train[: config.grpo.prompts_per_step]
    return [row.get("prompt") or task.prompt(row, "cot", tokenizer) for row in rows], config.grpo.num_generations


def load_for_rollouts(config):
    """The policy of `config` as a training run builds it: the loaded model, with LoRA adapters when configured."""
    from grpokit.models.lora import apply_lora
    from grpokit.pipeline.build import load_policy

    model, tokenizer = load_policy(config)
    if config.model.lora.r > 0:
        model = apply_lora(model, config.model.lora)
    return model, tokenizer


def measure_generation(path: str | None, overrides: list[str], repeats: int, bandwidth: float,
                       peaks: dict[str, float], say) -> tuple[dict, list[dict]]:
    """Each (dtype, prefill) way's best time for the batch, with its bound; the two prefill ways of one dtype
    alternate, so a slow spell of a shared machine hits both. Returns ({the batch}, [each way])."""
    import torch

    from grpokit.checks import load_config
    from grpokit.rollout import SamplingParams, make_engine

    ways, batch = [], {}
    for dtype in DTYPES:
        run_config = load_config(path, [*overrides, f"--model.dtype={dtype}"])
        g = run_config.grpo
        prompts, num_generations = rollout_batch(run_config)
        model, tokenizer = load_for_rollouts(run_config)
        engine = make_engine(run_config.rollout, model, tokenizer, run_config.seed)
        shape = model_shape(model)
        itemsize = {"fp32": 4, "bf16": 2}[dtype]
        distinct = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
        batch = {"model": run_config.model.name_or_path or "tiny", "lora_r": run_config.model.lora.r,
                 "prompts": len(prompts), "num_generations": num_generations, "prompt_tokens": distinct,
                 "max_completion_length": g.max_completion_length, "temperature": g.temperature,
                 "generation_batch_size": g.generation_batch_size, "engine": run_config.rollout.engine, **shape}
        warm = SamplingParams(max_new_tokens=2, temperature=g.temperature, top_p=g.top_p)
        engine.generate(prompts[:1], 2, warm)  # first-call costs (allocator, kernels) stay out of the timing
        best: dict[bool, dict] = {}
        for _ in range(repeats):
            for shared in (False, True):
                params = SamplingParams(max_new_tokens=g.max_completion_length, temperature=g.temperature,
                                        top_p=g.top_p, batch_size=g.generation_batch_size, shared_prefill=shared)
                torch.manual_seed(run_config.seed)
                start = time.perf_counter()
                rollout = engine.generate(prompts, num_generations, params)
                seconds = time.perf_counter() - start
                if shared not in best or seconds < best[shared]["seconds"]:
                    lengths = rollout.completion_mask.sum(dim=1).tolist()
                    best[shared] = {"seconds": seconds, "completion_lengths": [int(n) for n in lengths]}
        for shared in (False, True):
            run = best[shared]
            rows = [(distinct[i // num_generations], t) for i, t in enumerate(run["completion_lengths"])]
            bound = bound_seconds(shape, distinct, rows, itemsize, bandwidth, peaks[dtype])
            tokens = sum(run["completion_lengths"])
            way = {"dtype": dtype, "shared_prefill": shared, "seconds": run["seconds"], "completion_tokens": tokens,
                   "tokens_per_s": tokens / run["seconds"], "bound": bound,
                   "fraction_of_limit": bound["total_s"] / run["seconds"]}
            ways.append(way)
            say(f"generation {dtype}, {'shared' if shared else 'per-row'} prefill: {run['seconds']:.1f} s "
                f"({way['tokens_per_s']:.0f} tokens/s); bound {bound['total_s']:.1f} s "
                f"(prefill {bound['prefill_s']:.2f}, decode {bound['decode_s']:.2f}); "
                f"at {100 * way['fraction_of_limit']:.0f}% of the limit")
        del engine, model
    return batch, ways


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
