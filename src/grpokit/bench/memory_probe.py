"""One measurement of `grpokit bench memory --measure`: a few steps on a Llama of the given size, in
this process (or in each process under torchrun), and the peak memory of those steps.

Workloads: `setups` (default), GRPO steps with real sampling (full or LoRA, one or more processes);
`grpo` and `sft`, long-sequence steps that measure training memory at a fixed length: GRPO on
completions of exactly --completion-length random tokens (RandomTokens stands in for sampling, whose
own memory grpo.generation_batch_size bounds), or SFT on examples of that many random tokens, with a
vocabulary of --vocab-size and the token budget --max-tokens.

Peak memory: on CUDA, torch.cuda.max_memory_allocated over the steps; on the CPU, the peak
resident set size (VmHWM) over the steps, after resetting it once the models are built and
sharded (Linux: /proc/self/clear_refs), so loading the weights before sharding does not count,
less the process's resident size before any model was built (Python, torch and their
libraries: the same in every setup). Each process writes {"rank", "world_size",
"peak_bytes", "baseline_bytes", ...} to OUT/rank{r}.json.

    python -m grpokit.bench.memory_probe --out DIR [--lora-r 16] [--hidden-size 768 ...]
    python -m grpokit.bench.memory_probe --out DIR --workload sft --batch 4 --completion-length 1024
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

from grpokit import distributed
from grpokit.config import GRPOConfig, LoraConfig, SFTConfig
from grpokit.data import arithmetic
from grpokit.models import build_char_tokenizer, build_tiny_model
from grpokit.models.loading import resolve_device
from grpokit.models.precision import resolve_dtype
from grpokit.models.lora import apply_lora
from grpokit.models.sharding import shard_model
from grpokit.rewards import WeightedReward
from grpokit.models.reference import frozen_copy
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.sft import TokenizedExamples, train_on_examples
from grpokit.types import Rollout


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


class RandomTokens:
    """A rollout engine that samples nothing: each completion is random token ids, `completion_length`
    of them, or a length drawn per row from [min_length, completion_length], after `prompt_length`
    random prompt tokens. For measuring (and testing) the training step at chosen lengths without
    paying for generation. Ids avoid the tokenizer's pad and EOS tokens."""

    copies_weights = False

    def __init__(self, tokenizer, vocab_size: int, prompt_length: int, completion_length: int,
                 min_length: int | None = None, seed: int = 0):
        self.pad, self.eos = tokenizer.pad_token_id, tokenizer.eos_token_id
        self.vocab_size, self.prompt_length, self.completion_length = vocab_size, prompt_length, completion_length
        self.min_length = completion_length if min_length is None else min_length
        self.generator = torch.Generator().manual_seed(seed)

    def generate(self, prompts, num_generations, params, rows=None, seeds=None):
        n, p, t = len(prompts) * num_generations, self.prompt_length, self.completion_length
        low = max(self.pad, self.eos) + 1
        ids = torch.randint(low, self.vocab_size, (n, p + t), generator=self.generator)
        lengths = torch.randint(self.min_length, t + 1, (n,), generator=self.generator)
        completion_mask = (torch.arange(t) < lengths.unsqueeze(1)).long()
        ids[:, p:] = ids[:, p:].masked_fill(completion_mask == 0, self.pad)
        attention_mask = torch.cat([torch.ones(n, p, dtype=torch.long), completion_mask], dim=1)
        completions = [" ".join(map(str, ids[i, p : p + int(lengths[i])].tolist())) for i in range(n)]
        return Rollout(prompts=[q for q in prompts for _ in range(num_generations)], completions=completions,
                       input_ids=ids, attention_mask=attention_mask, completion_mask=completion_mask,
                       truncated=lengths == t, prompt_length=p, group_size=num_generations,
                       rows=[r for r in (rows or []) for _ in range(num_generations)])

    def sync_weights(self, model, state_dict=None) -> None:
        pass


def build_llama(vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                max_positions: int, seed: int = 0):
    """A randomly initialised Llama of this shape (offline: nothing is downloaded), ids 0 and 1 for pad and EOS."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         intermediate_size=intermediate_size, max_position_embeddings=max_positions,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def long_sequence_step(args, device: torch.device, out: Path) -> tuple[int, int, float]:
    """(parameters, peak bytes before the baseline is taken off, seconds) of args.steps long-sequence GRPO or
    SFT steps."""
    tokenizer = build_char_tokenizer(arithmetic.ALPHABET)  # pad 0, EOS 1: the ids build_llama uses
    length = args.prompt_length + args.completion_length
    model = build_llama(args.vocab_size, args.hidden_size, args.num_layers, args.num_heads, args.intermediate_size,
                        length, seed=0).to(device=device, dtype=resolve_dtype("auto", device))
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    if args.workload == "grpo":
        config = GRPOConfig(num_generations=args.num_generations, prompts_per_step=args.batch,
                            max_completion_length=args.completion_length, learning_rate=1e-5, warmup_steps=0,
                            max_tokens_per_micro_batch=args.max_tokens)
        engine = RandomTokens(tokenizer, args.vocab_size, args.prompt_length, args.completion_length)
        trainer = GRPOTrainer(model, tokenizer, [WeightedReward("length", length_reward)],
                              [{"prompt": f"q{i}"} for i in range(args.batch)], config, out / "run",
                              ref_model=frozen_copy(model), progress=False, engine=engine)
        run = lambda: [trainer.step() for _ in range(args.steps)]  # noqa: E731
    else:
        generator = torch.Generator().manual_seed(0)
        examples = [(torch.randint(2, args.vocab_size, (length,), generator=generator).tolist(), args.prompt_length)
                    for _ in range(2 * args.batch)]
        data = TokenizedExamples.of(examples)
        config = SFTConfig(batch_size=args.batch, max_steps=args.steps, warmup_steps=0, learning_rate=1e-5,
                           max_tokens_per_micro_batch=args.max_tokens)
        run = lambda: train_on_examples(model, data, tokenizer.pad_token_id, config, progress=False)  # noqa: E731
    import gc

    gc.collect()
    reset_peak(device)
    started = time.perf_counter()
    run()
    return params, peak_bytes(device), time.perf_counter() - started


def length_reward(prompts, completions, **_):
    """Varies within a group, so every step has a gradient."""
    return [len(c) / 16 for c in completions]


def main(argv: list[str] | None = None) -> int:
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
    parser.add_argument("--workload", choices=["setups", "grpo", "sft"], default="setups",
                        help="setups: GRPO steps with sampling; grpo / sft: long-sequence steps at a fixed length")
    parser.add_argument("--batch", type=int, default=2, help="grpo / sft: prompts per step or SFT examples per step")
    parser.add_argument("--vocab-size", type=int, default=32000, help="grpo / sft: the Llama's vocabulary")
    parser.add_argument("--prompt-length", type=int, default=64, help="grpo / sft: prompt tokens per row")
    parser.add_argument("--completion-length", type=int, default=1024, help="grpo / sft: completion tokens per row")
    parser.add_argument("--max-tokens", type=int, default=16384, help="grpo / sft: max_tokens_per_micro_batch")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    args = parser.parse_args(argv)
    if args.workload != "setups":
        device = resolve_device(args.device)
        baseline = resident_bytes(device)
        out = Path(args.out)
        params, peak, seconds = long_sequence_step(args, device, out)
        record = {"rank": 0, "world_size": 1, "params": params, "workload": args.workload, "batch": args.batch,
                  "device": str(device), "peak_bytes": peak - baseline, "baseline_bytes": baseline,
                  "seconds": seconds}
        out.mkdir(parents=True, exist_ok=True)
        (out / "rank0.json").write_text(json.dumps(record))
        return 0

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
    rows = arithmetic.make_rows(arithmetic.sample_questions(64, 0, arithmetic.ChainSpec(), "train"))
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
    distributed.report_crashes()
    # under torchrun: the interpreter's teardown is where a gloo thread aborts a finished probe (distributed.leave)
    distributed.exit_process(main())
