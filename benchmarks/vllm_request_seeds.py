"""What per-request seeds cost vLLM: tokens/s of one generate call of N requests, each with its own
seed (what grpokit's trainer sends: a completion does not depend on its batch) vs none (vLLM's one
generator for the whole batch). vLLM samples a request that has its own generator by itself.

    PYTHONPATH=src HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 \\
        .venv-vllm/bin/python benchmarks/vllm_request_seeds.py --requests 512 --repeats 3

The policy is grpokit's default tiny Llama (hidden 128, 4 blocks, 4 heads, random init); calls
alternate between the two modes so drift in machine load hits both alike. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.rollout import SamplingParams, request_seeds
from grpokit.rollout.vllm import VLLMEngine


def timed_generate(engine, prompts, group, params, seeds) -> tuple[float, int]:
    """(seconds, completion tokens) of one generate call."""
    start = time.perf_counter()
    rollout = engine.generate(prompts, group, params, seeds=seeds)
    return time.perf_counter() - start, int(rollout.completion_lengths.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    model = build_tiny_model(tokenizer)
    rows = arithmetic.make_rows(arithmetic.sample_questions(args.requests // args.group, 0, arithmetic.ChainSpec(),
                                                            "train"))
    prompts = [r["prompt"] for r in rows]
    engine = VLLMEngine(model, tokenizer, max_model_len=256, kv_cache_gb=0.25)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    rates: dict[str, list[float]] = {"per-request seeds": [], "no seeds (one batch generator)": []}
    try:
        timed_generate(engine, prompts, args.group, params, None)  # warm-up
        for repeat in range(args.repeats):
            seeds = request_seeds(0, repeat, list(range(len(prompts))), args.group)
            for mode, mode_seeds in zip(rates, (seeds, None)):
                seconds, tokens = timed_generate(engine, prompts, args.group, params, mode_seeds)
                rates[mode].append(tokens / seconds)
    finally:
        engine.close()
    print(f"| {len(prompts) * args.group} requests, up to {args.new_tokens} new tokens | tokens/s (median of "
          f"{args.repeats}) | runs |")
    print("|---|---|---|")
    for mode, values in rates.items():
        print(f"| {mode} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
