"""One measurement of `grpokit bench memory --measure`: a few GRPO steps on a Llama of the given
size, in this process (or in each process under torchrun), and the peak memory of those steps.

Peak memory: on CUDA, torch.cuda.max_memory_allocated over the steps; on the CPU, the peak
resident set size (VmHWM) over the steps, after resetting it once the models are built and
sharded (Linux: /proc/self/clear_refs), so loading the weights before sharding does not count,
less the process's resident size before any model was built (Python, torch and their
libraries: the same in every setup). Each process writes {"rank", "world_size",
"peak_bytes", "baseline_bytes", ...} to OUT/rank{r}.json.

    python -m grpokit.bench.memory_probe --out DIR [--lora-r 16] [--hidden-size 768 ...]
    torchrun --nproc_per_node=2 -m grpokit.bench.memory_probe --out DIR ...
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from pathlib import Path

import torch


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return
    # glibc keeps freed blocks resident (the full weights each process built before sharding, for
    # one): hand them back first, so the peak counts live memory, as max_memory_allocated does on CUDA.
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak then includes the allocator's cache
        pass
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets VmHWM to the current resident size
        f.write("5")


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: CPU peak memory needs Linux")


def resident_bytes(device: torch.device) -> int:
    """What this process holds before any model: 0 on CUDA (allocations only), else VmRSS."""
    if device.type == "cuda":
        return 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def length_reward(prompts, completions, **_):
    """Varies within a group, so every step has a gradient."""
    return [len(c) / 16 for c in completions]


def main(argv: list[str] | None = None) -> int:
    from grpokit import distributed
    from grpokit.config import GRPOConfig, LoraConfig
    from grpokit.data import arithmetic
    from grpokit.models import build_char_tokenizer, build_tiny_model
    from grpokit.models.lora import apply_lora
    from grpokit.models.loading import resolve_device, resolve_dtype
    from grpokit.models.sharding import shard_model
    from grpokit.rewards import WeightedReward
    from grpokit.train.grpo import GRPOTrainer, frozen_copy

    parser = argparse.ArgumentParser(prog="python -m grpokit.bench.memory_probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for rank{r}.json")
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--intermediate-size", type=int, default=3072)
    parser.add_argument("--lora-r", type=int, default=0, help="0 = full fine-tune")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="global batch of prompts")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    distributed.init()
    device = resolve_device(args.device) if not distributed.is_initialized() or not torch.cuda.is_available() \
        else torch.device("cuda", torch.cuda.current_device())
    baseline = resident_bytes(device)
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = build_tiny_model(tokenizer, hidden_size=args.hidden_size, num_layers=args.num_layers,
                             num_heads=args.num_heads, intermediate_size=args.intermediate_size, seed=0)
    model = model.to(device=device, dtype=resolve_dtype("auto", device))
    params = sum(p.numel() for p in model.parameters())
    ref = None
    if args.lora_r:
        model = apply_lora(model, LoraConfig(r=args.lora_r, alpha=2 * args.lora_r))
    else:
        ref = frozen_copy(model)
    if distributed.world_size() > 1:
        shard_model(model)
        if ref is not None:
            shard_model(ref)
    rows = arithmetic.make_rows(arithmetic.sample_questions(64, 0, arithmetic.ChainTask(), "train"))
    config = GRPOConfig(num_generations=args.num_generations, prompts_per_step=args.prompts_per_step,
                        max_completion_length=args.max_completion_length, learning_rate=1e-5, warmup_steps=0)
    out = Path(args.out)
    trainer = GRPOTrainer(model, tokenizer, [WeightedReward("length", length_reward)], rows, config, out / "run",
                          ref_model=ref, progress=False)
    import gc

    gc.collect()
    distributed.barrier()
    reset_peak(device)
    started = time.perf_counter()
    for _ in range(args.steps):
        trainer.step()
    record = {"rank": distributed.rank(), "world_size": distributed.world_size(), "params": params,
              "lora_r": args.lora_r, "device": str(device), "peak_bytes": peak_bytes(device) - baseline,
              "baseline_bytes": baseline, "seconds": time.perf_counter() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{distributed.rank()}.json").write_text(json.dumps(record))
    distributed.barrier()
    distributed.shutdown()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
