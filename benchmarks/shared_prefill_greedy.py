"""Greedy completions with shared prefill against the expanded batch, on a config's held-out questions.

    python benchmarks/shared_prefill_greedy.py                    # the SmolLM2 example, its 300 questions
    python benchmarks/shared_prefill_greedy.py --dtype bf16 --json out.json

Each held-out question (rendered as training renders it) is decoded greedily twice over through
rollout.engine=hf: once as a group of G rows whose prompt is prefilled once and whose KV cache is copied
to the rows (rollout.shared_prefill), once one row per question with its own prefill (the expanded
batch's rows are that row, G times). Reported: how many of the G x N shared rows equal their question's
own-prefill completion token for token, and the first that differ, with the step where they part.
The model is the config's (LoRA adapters at their initialisation leave the base model's outputs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/smollm2_word_arithmetic.yaml")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--group", type=int, default=2, help="G rows per question with shared prefill")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import torch

    from grpokit.bench.generation import load_for_rollouts
    from grpokit.checks import load_config
    from grpokit.rollout import SamplingParams, make_engine
    from grpokit.tasks import task_for

    config = load_config(args.config, [f"--model.dtype={args.dtype}"])
    model, tokenizer = load_for_rollouts(config)
    task = task_for(config)
    rows = task.data(tokenizer, sft=False).heldout[: args.questions]
    prompts = [row.get("prompt") or task.prompt(row, "cot", tokenizer) for row in rows]
    engine = make_engine(config.rollout, model, tokenizer, config.seed)
    g = config.grpo

    def greedy(group: int, shared: bool):
        params = SamplingParams(max_new_tokens=g.max_completion_length, temperature=0.0,
                                batch_size=g.generation_batch_size, shared_prefill=shared)
        started = time.perf_counter()
        out = engine.generate(prompts, group, params)
        completion_ids = out.input_ids[:, out.prompt_length:]
        ids = [row[mask.bool()].tolist() for row, mask in zip(completion_ids, out.completion_mask)]
        return ids, out.completions, time.perf_counter() - started

    with torch.no_grad():
        own_ids, own_text, own_s = greedy(1, False)
        shared_ids, shared_text, shared_s = greedy(args.group, True)
    differ = []
    for i, ids in enumerate(shared_ids):
        q = i // args.group
        if ids != own_ids[q]:
            step = next((t for t, (a, b) in enumerate(zip(ids, own_ids[q])) if a != b), min(len(ids), len(own_ids[q])))
            differ.append({"question": q, "row": i % args.group, "token": step,
                           "shared": shared_text[i], "own": own_text[q]})
    result = {"config": args.config, "dtype": args.dtype, "questions": len(prompts), "group": args.group,
              "rows": len(shared_ids), "identical": len(shared_ids) - len(differ),
              "own_prefill_s": round(own_s, 1), "shared_prefill_s": round(shared_s, 1),
              "command": "python benchmarks/shared_prefill_greedy.py " + " ".join(sys.argv[1:]), "differ": differ[:10]}
    print(f"{result['identical']} of {result['rows']} shared-prefill rows ({len(prompts)} questions x G={args.group}, "
          f"{args.dtype}) equal their question's own-prefill greedy completion token for token "
          f"({own_s:.0f} s own prefill, {shared_s:.0f} s shared)")
    for d in differ[:5]:
        print(f"  question {d['question']} row {d['row']} parts at token {d['token']}:\n    shared {d['shared']!r}\n"
              f"    own    {d['own']!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
