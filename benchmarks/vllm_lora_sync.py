"""Two ways to give a vLLM engine a LoRA policy's update, timed side by side in one run:

- merged: grpokit's push (VLLMEngine.sync_weights on the PEFT model): W + delta for every adapted
  layer, computed on the weights' device one layer at a time, loaded with vLLM's reload_weights;
- adapter: vLLM's own LoRA support (enable_lora): the adapter is saved (PEFT's save_pretrained) and
  served with a new LoRARequest; the time is the save plus the first one-token request that loads
  it, less the same request without a new adapter.

    PYTHONPATH=src HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 \\
        .venv-vllm/bin/python benchmarks/vllm_lora_sync.py --repeats 5

The policy is grpokit's default tiny Llama (hidden 128, 4 blocks, random init) with README's LoRA demo
adapter (r=16, alpha=32, all-linear).
Prints a Markdown table of the median milliseconds per sync, or the error vLLM gives for enable_lora,
and the other side of the trade: generation tokens/s of 512 requests (64 prompts x 8, up to 64 tokens,
temperature 1) from the merged weights and through the served adapter.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from grpokit.config import LoraConfig
from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.models.lora import apply_lora
from grpokit.rollout.vllm import VLLMEngine


def perturb_adapter(policy) -> None:
    """A stand-in for an optimizer step: every adapter weight moves."""
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_" in name:
                param.add_(1e-3 * torch.randn_like(param))


def time_merged(engine, policy, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        perturb_adapter(policy)
        start = time.perf_counter()
        engine.sync_weights(policy)
        times.append(time.perf_counter() - start)
    return times


def time_adapter(vllm, llm, policy, prompt, repeats: int) -> list[float]:
    from vllm.lora.request import LoRARequest

    params = vllm.SamplingParams(max_tokens=1, temperature=0.0)
    times = []
    with tempfile.TemporaryDirectory() as root:
        for step in range(1, repeats + 2):  # the first adapter load warms vLLM's LoRA path up
            perturb_adapter(policy)
            start = time.perf_counter()
            policy.save_pretrained(f"{root}/{step}")
            llm.generate([prompt], params, lora_request=LoRARequest(f"step-{step}", step, f"{root}/{step}"),
                         use_tqdm=False)
            loaded = time.perf_counter() - start
            start = time.perf_counter()
            llm.generate([prompt], params, lora_request=LoRARequest(f"step-{step}", step, f"{root}/{step}"),
                         use_tqdm=False)
            times.append(loaded - (time.perf_counter() - start))
    return times[1:]


def tokens_per_s(vllm, llm, prompts, lora_request=None) -> float:
    params = vllm.SamplingParams(max_tokens=64, temperature=1.0, n=8)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
    return sum(len(o.token_ids) for out in outputs for o in out.outputs) / (time.perf_counter() - start)


def generation_rates(vllm, merged_llm, adapter_llm, policy, repeats: int) -> dict[str, list[float]]:
    """Tokens/s from the merged weights and through the adapter, alternating."""
    from vllm.lora.request import LoRARequest

    rows = arithmetic.make_rows(arithmetic.sample_questions(64, 0, arithmetic.ChainSpec(), "train"))
    prompts = [r["prompt"] for r in rows]
    rates: dict[str, list[float]] = {"generate, merged weights": [], "generate, through the adapter": []}
    with tempfile.TemporaryDirectory() as root:
        policy.save_pretrained(root)
        request = LoRARequest("final", 10_000, root)
        tokens_per_s(vllm, adapter_llm, prompts, request)  # warm-up: loads the adapter
        for _ in range(repeats):
            rates["generate, merged weights"].append(tokens_per_s(vllm, merged_llm, prompts))
            rates["generate, through the adapter"].append(tokens_per_s(vllm, adapter_llm, prompts, request))
    return rates


def adapter_llm(engine, rank: int):
    """A second vLLM engine on the same base model, with LoRA serving on; (vllm, llm) or (None, error)."""
    import vllm

    try:
        return vllm, vllm.LLM(model=engine._checkpoint_dir.name, dtype="float32", max_model_len=128,
                              enforce_eager=True, enable_lora=True, max_lora_rank=rank, max_loras=1,
                              kv_cache_memory_bytes=2**26)
    except Exception as err:  # the CPU build may not serve LoRA: report what vLLM says
        return None, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)
    policy = apply_lora(build_tiny_model(tokenizer),
                        LoraConfig(r=args.rank, alpha=2 * args.rank, target_modules=["all-linear"]))
    engine = VLLMEngine(policy, tokenizer, max_model_len=128, kv_cache_gb=0.0625)
    rows = {}
    try:
        time_merged(engine, policy, 1)  # warm-up
        rows["merged (reload_weights)"] = time_merged(engine, policy, args.repeats)
        probe = []  # the first call takes vLLM's prompt-log-prob path cold; later ones are the per-step cost
        for _ in range(3):
            start = time.perf_counter()
            engine.check_synced(policy)
            probe.append(time.perf_counter() - start)
        vllm, llm = adapter_llm(engine, args.rank)
        if vllm is not None:
            prompt = "Q: 1+2\n"
            rows["adapter (enable_lora + LoRARequest)"] = time_adapter(vllm, llm, policy, prompt, args.repeats)
            engine.sync_weights(policy)  # the merged engine holds the adapter's final weights too
            rates = generation_rates(vllm, engine.llm, llm, policy, 3)
        else:
            error, rates = llm, {}
    finally:
        engine.close()
    print(f"| LoRA r={args.rank} on the default tiny Llama | ms per sync (median of {args.repeats}) | runs (ms) |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {1e3 * statistics.median(values):.1f} | {', '.join(f'{1e3 * v:.1f}' for v in values)} |")
    print(f"| sync probe (check_synced; first call, then 2 more) | {1e3 * statistics.median(probe[1:]):.1f} | "
          f"{', '.join(f'{1e3 * v:.1f}' for v in probe)} |")
    for name, values in rates.items():
        print(f"| {name} (tokens/s, median of 3) | {statistics.median(values):.0f} | "
              f"{', '.join(f'{v:.0f}' for v in values)} |")
    if "adapter (enable_lora + LoRARequest)" not in rows:
        print(f"\nadapter push not measured: vLLM with enable_lora=True failed to start: {error}")


if __name__ == "__main__":
    main()
