"""The rollout engines side by side: generation throughput of `hf` vs `vllm`, and greedy equivalence.

Throughput (one run, alternating subprocesses hf, vllm, hf, vllm, ... so drift in machine load
hits both engines alike):

    python benchmarks/rollout_engines.py --sizes 1m,8m,113m --repeats 2

prints a Markdown table of generation tokens/s for random-init Qwen2 policies, 64 prompts x 128
new tokens at temperature 1. The policies' untied output head has a zero row for EOS and larger
other rows, so EOS is (almost) never drawn and every completion runs its full length: both
engines do the same work, and the table shows the mean completion length to prove it.

Equivalence (needs a run directory with checkpoints/sft, e.g. from `grpokit demo`):

    python benchmarks/rollout_engines.py --equivalence runs/demo

greedy completions of the demo's 500 held-out questions from both engines on that pi_SFT;
prints how many differ and, for each, both completions and the hf policy's top-2 logit gap at
the first differing token (a near tie that float rounding can flip).

Run it in the vLLM venv (`make .venv-vllm`) with PYTHONPATH=src, HF_HUB_OFFLINE=1 and
VLLM_ENABLE_V1_MULTIPROCESSING=0. `--save-model SIZE DIR` writes a policy of a size below so
that `grpokit train --model.name_or_path=DIR` can time full steps (benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# name -> (hidden, layers, heads, kv heads, intermediate, vocabulary); "char" is the printable-ASCII
# character vocabulary, an int a character vocabulary of that many tokens (Qwen2-0.5B's size).
SIZES = {
    "tiny": (64, 2, 2, 2, 128, "char"),  # the CPU dry run of benchmarks/gpu_check.sh (head_dim 32: vLLM on CPU has no 16)
    "1m": (128, 4, 4, 2, 512, "char"),
    "8m": (256, 8, 8, 4, 1024, "char"),
    "113m": (768, 12, 12, 12, 3072, "char"),
    "0.5b": (896, 24, 14, 2, 4864, 151936),
}
EOS_FREE_LOGIT_STD = 4.0  # output-head logit scale that makes a zero EOS logit ~never sampled


def build_tokenizer(vocabulary):
    from grpokit.models import build_char_tokenizer
    from grpokit.pipeline.build import ASCII_ALPHABET

    if vocabulary == "char":
        return build_char_tokenizer(ASCII_ALPHABET)
    # One token per character: printable ASCII, then code points past it (no surrogates) up to the size.
    extra = (chr(c) for c in range(0xA1, 0x10FFFF) if not 0xD800 <= c < 0xE000)
    alphabet = ASCII_ALPHABET + "".join(next(extra) for _ in range(vocabulary - 3 - len(ASCII_ALPHABET)))
    return build_char_tokenizer(alphabet)


def build_policy(size: str, seed: int = 0, tied: bool = False):
    """A random-init Qwen2 policy of `size` whose completions run to max_new_tokens. `tied`
    shares the output head with the input embeddings, as Qwen2-0.5B does (the EOS row, zero,
    is then EOS's input embedding too)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    hidden, layers, heads, kv_heads, intermediate, vocabulary = SIZES[size]
    tokenizer = build_tokenizer(vocabulary)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=2048,
        tie_word_embeddings=tied, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    with torch.no_grad():  # the final norm leaves unit-scale features, so logit std = row std * sqrt(hidden)
        head = model.lm_head.weight
        head.normal_(0.0, EOS_FREE_LOGIT_STD / hidden**0.5)
        head[tokenizer.eos_token_id] = 0.0
    return model, tokenizer


def bench_prompts(n: int) -> list[str]:
    import random

    rng = random.Random(0)
    return [f"Q: {rng.randint(1, 99)}+{rng.randint(1, 99)}-{rng.randint(1, 9)}\n" for _ in range(n)]


def worker(args) -> None:
    """One engine, one size: build, warm up, time one generate; print a JSON line."""
    import torch

    from grpokit.rollout import SamplingParams
    from grpokit.rollout.engine import HFEngine

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = build_policy(args.size)
    model = model.to(device=args.device, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    if args.worker == "vllm":
        from grpokit.rollout.vllm import VLLMEngine

        engine = VLLMEngine(model, tokenizer, max_model_len=args.new_tokens + 32, kv_cache_gb=args.kv_cache_gb,
                            dtype=args.dtype, gpu_memory_utilization=0.5)
    else:
        engine = HFEngine(model, tokenizer)
    build_s = time.perf_counter() - start
    prompts = bench_prompts(args.prompts)
    seeds = list(range(len(prompts)))
    engine.generate(prompts[:4], 1, SamplingParams(max_new_tokens=8, batch_size=len(prompts)), seeds=seeds[:4])
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, batch_size=len(prompts))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    rollout = engine.generate(prompts, 1, params, seeds=seeds)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = int(rollout.completion_mask.sum())
    print(json.dumps({"engine": args.worker, "size": args.size, "params": n_params, "tokens": tokens,
                      "seconds": seconds, "tokens_per_s": tokens / seconds, "build_s": build_s,
                      "mean_length": tokens / len(prompts), "threads": torch.get_num_threads()}))
    if hasattr(engine, "close"):
        engine.close()


def run_worker(engine: str, size: str, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--size", size,
               "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
               "--device", args.device, "--dtype", args.dtype, "--kv-cache-gb", str(args.kv_cache_gb)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{engine} at {size} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {engine:4s} {size:5s} {result['tokens_per_s']:9.1f} tokens/s "
          f"({result['tokens']} tokens in {result['seconds']:.1f} s)", file=sys.stderr, flush=True)
    return result


def throughput(args) -> None:
    results: dict[tuple[str, str], list[dict]] = {}
    for size in args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"--sizes: unknown size {size!r}; choose from {', '.join(SIZES)}")
        for _ in range(args.repeats):
            for engine in ("hf", "vllm"):
                results.setdefault((size, engine), []).append(run_worker(engine, size, args))
    print(f"\n{args.prompts} prompts x {args.new_tokens} new tokens, temperature 1, {args.dtype} on {args.device}, "
          f"{args.threads} thread(s), median of {args.repeats} run(s); tokens/s of generation alone\n")
    print("| model | parameters | hf tokens/s | vllm tokens/s | vllm / hf | mean length hf / vllm |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        hf, vl = results[(size, "hf")], results[(size, "vllm")]
        hf_rate = statistics.median(r["tokens_per_s"] for r in hf)
        vl_rate = statistics.median(r["tokens_per_s"] for r in vl)
        print(f"| Qwen2 {size} | {hf[0]['params'] / 1e6:.1f}M | {hf_rate:.0f} | {vl_rate:.0f} | "
              f"{vl_rate / hf_rate:.2f}x | {hf[0]['mean_length']:.1f} / {vl[0]['mean_length']:.1f} |")


def equivalence(args) -> None:
    """Greedy completions of the held-out demo questions from both engines on RUN_DIR's pi_SFT."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpokit.config import read_config as load_config
    from grpokit.rollout import SamplingParams
    from grpokit.rollout.engine import HFEngine
    from grpokit.rollout.vllm import VLLMEngine
    from grpokit.tasks.chain import ChainTask

    torch.set_num_threads(args.threads)
    checkpoint = os.path.join(args.equivalence, "checkpoints", "sft")
    if not os.path.isdir(checkpoint):
        raise SystemExit(f"--equivalence: {checkpoint} does not exist; run `grpokit demo --output-dir RUN_DIR` first")
    config_path = os.path.join(args.equivalence, "config.yaml")
    config = load_config(config_path if os.path.isfile(config_path) else None)
    heldout = ChainTask(config).data(None, sft=False).heldout
    prompts = [row["prompt"] for row in heldout]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    params = SamplingParams(max_new_tokens=config.grpo.max_completion_length, temperature=0.0)
    start = time.perf_counter()
    hf = HFEngine(model, tokenizer).generate(prompts, 1, params)
    hf_s = time.perf_counter() - start
    engine = VLLMEngine(model, tokenizer, max_model_len=2 * hf.prompt_length + params.max_new_tokens,
                        kv_cache_gb=args.kv_cache_gb)
    start = time.perf_counter()
    vl = engine.generate(prompts, 1, params)
    vl_s = time.perf_counter() - start
    engine.close()
    differ = [i for i in range(len(prompts)) if hf.completions[i] != vl.completions[i]]
    print(f"{len(prompts)} held-out questions, greedy, max_new_tokens={params.max_new_tokens}: "
          f"{len(differ)} completions differ (hf {hf_s:.1f} s, vllm {vl_s:.1f} s)")
    for i in differ:
        hf_ids = hf.completion_ids[i][hf.completion_mask[i].bool()].tolist()
        vl_ids = vl.completion_ids[i][vl.completion_mask[i].bool()].tolist()
        at = next((k for k, (a, b) in enumerate(zip(hf_ids, vl_ids)) if a != b), min(len(hf_ids), len(vl_ids)))
        prefix = torch.tensor([hf.input_ids[i][hf.attention_mask[i].bool()][: hf.prompt_length].tolist()
                               + hf_ids[:at]])
        with torch.no_grad():
            top2 = model(prefix).logits[0, -1].float().topk(2).values
        print(f"- question {i}: {prompts[i]!r}\n  hf:   {hf.completions[i]!r}\n  vllm: {vl.completions[i]!r}\n"
              f"  first difference at token {at}; hf top-2 logit gap there {float(top2[0] - top2[1]):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1m", help=f"comma-separated, from {', '.join(SIZES)} (default 1m)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per engine and size (median reported)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per subprocess")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM's KV cache (rollout.kv_cache_gb)")
    parser.add_argument("--equivalence", metavar="RUN_DIR", help="greedy hf vs vllm on RUN_DIR/checkpoints/sft")
    parser.add_argument("--save-model", nargs=2, metavar=("SIZE", "DIR"), help="write a benchmark policy and exit")
    parser.add_argument("--worker", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    elif args.save_model:
        size, directory = args.save_model
        model, tokenizer = build_policy(size)
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        print(f"{size}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {directory}")
    elif args.equivalence:
        equivalence(args)
    else:
        throughput(args)


if __name__ == "__main__":
    main()
