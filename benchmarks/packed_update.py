"""The GRPO update with packed rows against padded rows, side by side on the real checkpoint.

    OMP_NUM_THREADS=2 python benchmarks/packed_update.py [--prompts 3] [--group 4] [--repeats 2]

A GSM8K-like batch on SmolLM2-135M-Instruct (models/smollm2-135m-instruct, built by `make models`):
--prompts real GSM8K questions (tests/fixtures) through the chat template, --group completions each,
whose lengths are drawn from a long-tailed (log-normal) distribution between 20 and 400 tokens,
median --median. Prompts are left-padded and completions right-padded, as rollouts hold them.

After an untimed padded update of one group (first-call allocations), each repeat runs the update
both ways, alternating which goes first: Trainer.update_policy (the micro-batches, forward, backward
and optimizer step the loop runs; grpo.max_tokens_per_micro_batch and grpo.micro_batch_size at their
defaults), then the no-grad log-prob pass of pi_old over the same rows. It prints, for each layout,
the median seconds, the tokens the forwards computed, the share of them that were padding
(perf/padding_frac), and the packed/padded ratios: the time ratio against the computed-token ratio
says how far the time follows the padding removed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from grpokit.config import GRPOConfig
from grpokit.micro_batches import RowLayout
from grpokit.models import load_model_and_tokenizer
from grpokit.rewards import WeightedReward
from grpokit.models.logprobs import token_logprobs
from grpokit.train.algorithm import Batch
from grpokit.train.grpo import GRPOTrainer
from grpokit.train.packing import packs_apart
from grpokit.types import Rollout

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "models" / "smollm2-135m-instruct"
QUESTIONS = ROOT / "tests" / "fixtures" / "gsm8k_train_sample.jsonl"


def completion_lengths(n: int, median: float, seed: int) -> list[int]:
    """n lengths from a log-normal distribution (sigma 0.8: a long tail), clipped to [20, 400]."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(torch.randn(n, generator=g) * 0.8) * median
    return draws.round().clamp(20, 400).long().tolist()


def gsm8k_like_rollout(tokenizer, prompts: int, group: int, median: float, seed: int) -> Rollout:
    """Real questions' chat prompts; completions of drawn lengths (random ids from the ordinary vocabulary,
    since the time does not depend on which tokens they are), the last one EOS."""
    questions = [json.loads(line)["question"] for line in QUESTIONS.read_text().splitlines()[:prompts]]
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False) for q in questions]
    prompt_ids = [list(p["input_ids"]) if isinstance(p, dict) else list(p) for p in prompt_ids]
    lengths = completion_lengths(prompts * group, median, seed)
    g = torch.Generator().manual_seed(seed + 1)
    p, t = max(map(len, prompt_ids)), max(lengths)
    n = prompts * group
    ids = torch.full((n, p + t), tokenizer.pad_token_id)
    mask = torch.zeros((n, p + t), dtype=torch.long)
    for i in range(n):
        prompt, length = prompt_ids[i // group], lengths[i]
        completion = torch.randint(1000, 40000, (length,), generator=g)
        completion[-1] = tokenizer.eos_token_id
        ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        ids[i, p : p + length] = completion
        mask[i, p - len(prompt) : p + length] = 1
    completion_mask = mask[:, p:].clone()
    return Rollout(prompts=[""] * n, completions=[""] * n, input_ids=ids, attention_mask=mask,
                   completion_mask=completion_mask, truncated=torch.zeros(n, dtype=torch.bool), prompt_length=p,
                   group_size=group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--median", type=float, default=120.0, help="median completion length in tokens")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not MODEL.is_dir():
        sys.exit(f"{MODEL.relative_to(ROOT)} absent: run `make models` (downloads once, then offline)")
    torch.manual_seed(args.seed)
    model, tokenizer = load_model_and_tokenizer(str(MODEL), dtype="fp32", device="cpu")
    rollout = gsm8k_like_rollout(tokenizer, args.prompts, args.group, args.median, args.seed)
    if not packs_apart(model, rollout, tokenizer.pad_token_id, 16384, False):
        sys.exit("the checkpoint's attention does not keep packed rows apart here: nothing to compare")
    config = GRPOConfig(num_generations=args.group, prompts_per_step=args.prompts, learning_rate=1e-7, beta=0.04,
                        warmup_steps=0)
    with tempfile.TemporaryDirectory() as run_dir:
        no_reward = WeightedReward("none", lambda prompts, completions, **_: [0.0] * len(completions))
        trainer = GRPOTrainer(model, tokenizer, [no_reward], [{"prompt": "unused"}], config, run_dir, seed=0,
                              progress=False)
        g = torch.Generator().manual_seed(args.seed + 2)
        advantages = torch.randn(rollout.num_samples, generator=g)
        loss_mask = rollout.completion_mask.float()
        with torch.no_grad():
            ref_logp = token_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.prompt_length,
                                      config.temperature, pack=True)[0]
        warm = rollout.take(torch.arange(args.group))  # one group, untimed: the first backward's allocations
        trainer.layout = RowLayout.of(False, warm.attention_mask, warm.prompt_length)
        trainer.update_policy(Batch(warm, None, loss_mask[: args.group], ref_logp[: args.group], None, tokenizer, True,
                                    layout=trainer.layout), advantages[: args.group])
        results = {"padded": [], "packed": []}
        for repeat in range(args.repeats):
            order = ["padded", "packed"] if repeat % 2 == 0 else ["packed", "padded"]
            for name in order:
                trainer.layout = RowLayout.of(name == "packed", rollout.attention_mask, rollout.prompt_length)
                started = time.perf_counter()
                trainer.update_policy(Batch(rollout, None, loss_mask, ref_logp, None, tokenizer, True,
                                            layout=trainer.layout), advantages)
                update_s = time.perf_counter() - started
                update_tokens = trainer.layout.computed
                trainer.layout = RowLayout.of(name == "packed", rollout.attention_mask, rollout.prompt_length)
                started = time.perf_counter()
                trainer.logprobs(model, rollout)
                logprob_s = time.perf_counter() - started
                results[name].append((update_s, update_tokens, logprob_s, trainer.layout.computed))
                print(f"repeat {repeat + 1} {name}: update {update_s:.2f} s, log-probs {logprob_s:.2f} s", flush=True)
    lengths = rollout.attention_mask.sum(1)
    print(f"\nSmolLM2-135M-Instruct fp32 on CPU ({torch.get_num_threads()} threads), {rollout.num_samples} rows "
          f"({args.prompts} GSM8K prompts x {args.group}), prompt + completion "
          f"{int(lengths.min())}..{int(lengths.max())} tokens (mean {float(lengths.float().mean()):.0f}); "
          f"median of {args.repeats} alternating repeats")
    print(f"{'layout':8} {'update s':>9} {'tokens computed':>16} {'padding_frac':>13} {'log-probs s':>12}")
    summary = {}
    for name, runs in results.items():
        update_s = statistics.median(r[0] for r in runs)
        logprob_s = statistics.median(r[2] for r in runs)
        tokens = runs[0][1]
        summary[name] = (update_s, tokens.computed, logprob_s)
        print(f"{name:8} {update_s:9.2f} {tokens.computed:16,d} {tokens.padding_frac:13.3f} {logprob_s:12.2f}")
    (pu, pt, pl), (ku, kt, kl) = summary["padded"], summary["packed"]
    print(f"packed / padded: update time {ku / pu:.2f}, tokens computed {kt / pt:.2f}, log-prob time {kl / pl:.2f}")


if __name__ == "__main__":
    main()
