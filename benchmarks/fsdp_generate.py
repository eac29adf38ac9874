"""HF generate on an FSDP2 policy, 2 processes (gloo, CPU): decoding tokens/s with every unit
all-gathered once per generate call (grpokit's sampler) against once per decoded token (transformers'
generate on a sharded model as it is, processes stepping together with synced_gpus), side by side.

    python benchmarks/fsdp_generate.py [--layers 4] [--hidden 256] [--prompts 32] [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.multiprocessing as mp
from transformers import GenerationConfig

from grpokit import distributed
from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.models.sharding import shard_model
from grpokit.rollout import SamplingParams, sample_groups


def per_token(model, tokenizer, prompts: list[str], tokens: int) -> int:
    """transformers' generate on the sharded model: each forward all-gathers every layer."""
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        out = model.generate(**enc, generation_config=config, synced_gpus=True)
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts)


def once_per_call(model, tokenizer, prompts: list[str], tokens: int) -> int:
    out = sample_groups(model, tokenizer, prompts, 1, SamplingParams(max_new_tokens=tokens, temperature=0))
    return int(out.completion_lengths.sum())


def worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    distributed.init(timeout_s=600)
    try:
        tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
        model = build_tiny_model(tokenizer, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                                 intermediate_size=4 * args.hidden, seed=0)
        model.generation_config.eos_token_id = None  # every sequence decodes all its tokens in both modes
        shard_model(model)
        prompts = [f"Q: {i}+{i % 7}-{i % 3}\n" for i in range(args.prompts)]
        for name, run in (("per token", per_token), ("once per call", once_per_call)):
            for _ in range(args.repeats):
                distributed.barrier()
                start = time.perf_counter()
                tokens = run(model, tokenizer, prompts, args.tokens)
                seconds = time.perf_counter() - start
                if rank == 0:
                    results.append((name, tokens * world / seconds))
    finally:
        distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=32, help="per process")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().list()
    mp.spawn(worker, args=(2, port, args, results), nprocs=2, join=True)
    best = {name: max(rate for n, rate in results if n == name) for name, _ in results}
    for name, rate in best.items():
        print(f"{name:>14}: {rate:8.0f} tokens/s (2 processes, best of {args.repeats})")
    print(f"once per call / per token: {best['once per call'] / best['per token']:.2f}x")


if __name__ == "__main__":
    main()
