"""Where the demo's SFT and evaluation time goes; with --grpo, one GRPO step's phases too.

    python benchmarks/demo_profile.py [--steps 12] [--threads 1,2] [--eval-questions 64]
                                      [--checkpoint runs/demo/checkpoints/sft] [--grpo] [--compile]

SFT: the demo's model, data and optimizer (seed 0), one step split into making the batch,
forward, backward, gradient clipping and the optimizer (step, schedule), for each batch
layout (one right-padded example per row, as before packing; packed rows, as sft_train
builds them; with --compile, packed rows through torch.compile) and each thread count.
Every configuration trains its own copy of the same initial model on the same batches, and
they take turns step by step, so a machine whose speed drifts (other jobs) slows all of
them alike. Times are medians over --steps steps; "cpu" is the process's CPU time per step;
"cpu/wall" above 1 means several threads were busy, below 1 that the process waited for a
CPU (a busy machine: trust cpu more than wall). The losses printed last show whether a
layout or thread count changed the numbers.

Evaluation: the demo's held-out prompts (the first --eval-questions), split into prompt
tokenization, greedy `generate`, sampled `generate` (k = eval.k), decoding and scoring,
per thread count. Completion lengths decide generate's cost, so pass a trained pi_SFT with
--checkpoint (the demo saves it under runs/demo/checkpoints/sft); an untrained model never
stops early and overstates it.

GRPO (--grpo): GRPOTrainer steps on the same model, split by the timings the trainer logs
(rollout, scoring, log-probs, update), taking turns between the thread counts.

Numbers from a shared machine are noisy: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpokit.pipeline.build import load_policy, seed_everything
from grpokit.cli import DEMO_PRESET
from grpokit.config import Config
from grpokit.config import read_config as load_config  # the file's own values; no registry check
from grpokit.data import arithmetic
from grpokit.models import load_model_and_tokenizer
from grpokit.rollout import SamplingParams
from grpokit.tasks import task_for
from grpokit.train.schedule import make_optimizer, warmup_cosine
from grpokit.train.sft import TokenizedExamples, packed_batch, padded_batch, tokenize_examples

SFT_PHASES = ("batch", "forward", "backward", "clip", "optimizer")


def ms(seconds: float) -> str:
    return f"{1000 * seconds:8.1f}"


@dataclass
class SFTRun:
    """One configuration: a thread count and a batch layout, with its own model copy."""

    threads: int
    layout: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in SFT_PHASES + ("step", "cpu")})
    in_ops: float = float("nan")  # share of a profiled step's time spent inside torch operators
    forward: object = None  # the model, or torch.compile of it
    first_step: float = float("nan")  # seconds of the first step (torch.compile compiles there)
    tokens: list[int] = field(default_factory=list)  # ids computed per step, padding included
    real: list[int] = field(default_factory=list)  # ids of the examples themselves
    losses: list[float] = field(default_factory=list)

    def step(self, data: TokenizedExamples, indices: list[int], pad_id: int, timed: bool) -> None:
        torch.set_num_threads(self.threads)
        clock = time.perf_counter
        t0, c0 = clock(), time.process_time()
        make = padded_batch if self.layout == "padded" else packed_batch
        batch = make(data, indices, pad_id)
        t1 = clock()
        out = (self.model if self.forward is None else self.forward)(**batch, use_cache=False)
        t2 = clock()
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        t3 = clock()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        t4 = clock()
        self.optimizer.step()
        self.scheduler.step()
        self.losses.append(out.loss.item())
        t5 = clock()
        if len(self.losses) == 1:
            self.first_step = t5 - t0
        if timed:
            for phase, seconds in zip(SFT_PHASES + ("step",), (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
                self.times[phase].append(seconds)
            self.times["cpu"].append(time.process_time() - c0)
            self.tokens.append(batch["input_ids"].numel())
            self.real.append(sum(data.lengths[i] for i in indices))


def profile_sft(config: Config, threads: list[int], steps: int, warmup: int = 2, compile_: bool = False) -> None:
    seed_everything(config.seed)
    model, tokenizer = load_policy(config)
    sft_rows = task_for(config).data(tokenizer).sft
    started = time.perf_counter()
    data = TokenizedExamples.of(tokenize_examples(tokenizer, [(r["prompt"], r["completion"]) for r in sft_rows]))
    tokenize_seconds = time.perf_counter() - started
    runs = []
    for n in threads:
        for layout in ("padded", "packed") + (("compiled",) if compile_ else ()):
            copy_ = copy.deepcopy(model).train()
            optimizer = make_optimizer(copy_, config.sft.learning_rate, config.sft.weight_decay)
            runs.append(SFTRun(n, layout, copy_, optimizer,
                               warmup_cosine(optimizer, config.sft.warmup_steps, config.sft.max_steps),
                               forward=torch.compile(copy_, dynamic=True) if layout == "compiled" else None))
    rng = random.Random(config.seed)
    order = rng.sample(range(len(data)), len(data))
    batch_size = config.sft.batch_size
    for step in range(warmup + steps):
        indices = order[step * batch_size : (step + 1) * batch_size]
        for run in runs if step % 2 == 0 else runs[::-1]:  # take turns, alternating who goes first
            run.step(data, indices, tokenizer.pad_token_id, timed=step >= warmup)
    # One more step each under the profiler: what is not inside an operator is Python (modules,
    # autograd bookkeeping, the optimizer's loop) and dispatch.
    indices = order[(warmup + steps) * batch_size : (warmup + steps + 1) * batch_size]
    for run in runs:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            run.step(data, indices, tokenizer.pad_token_id, timed=False)
            wall = time.perf_counter() - started
        inside = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith("aten::"))
        run.in_ops = inside / 1e6 / wall

    print(f"\nSFT: {len(data)} examples tokenized once in {tokenize_seconds:.2f}s; batch {batch_size}; "
          f"median ms per step over {steps} steps")
    print(f"{'threads':>7} {'layout':>7} " + " ".join(f"{p:>9}" for p in SFT_PHASES)
          + f" {'step':>8} {'cpu':>8} {'cpu/wall':>8} {'in ops':>7} {'ids/step':>9} {'padding':>7}")
    for run in runs:
        med = {p: statistics.median(v) for p, v in run.times.items()}
        padding = 1 - sum(run.real) / sum(run.tokens)
        print(f"{run.threads:>7} {run.layout:>7} " + " ".join(f"{ms(med[p]):>9}" for p in SFT_PHASES)
              + f" {ms(med['step'])} {ms(med['cpu'])} {sum(run.times['cpu']) / sum(run.times['step']):>8.2f}"
              + f" {run.in_ops:>7.0%} {statistics.median(run.tokens):>9.0f} {padding:>7.1%}")
    print("in ops: share of one profiled step inside torch operators (the rest: Python and dispatch)\n"
          "padding: share of the ids a step computes that are padding")
    for run in runs:
        if run.layout == "compiled":
            print(f"  compiled (packed rows, torch.compile dynamic=True), {run.threads} thread(s): first step, "
                  f"which compiles, {run.first_step:.1f}s (less with a warm compile cache)")
    base = next(r for r in runs if r.layout == "padded")
    for run in runs[1:]:
        diff = max(abs(a - b) for a, b in zip(run.losses, base.losses))
        print(f"  losses of {run.threads} thread(s) {run.layout} vs {base.threads} {base.layout}: "
              f"max |difference| {diff:.2e}{' (identical)' if run.losses == base.losses else ''}")


def profile_eval(config: Config, threads: list[int], questions: int, checkpoint: str | None) -> None:
    if checkpoint:
        model, tokenizer = load_model_and_tokenizer(checkpoint, dtype="fp32", device="cpu")
    else:
        model, tokenizer = load_policy(config)
        print("\n(no --checkpoint: an untrained model never emits EOS, so generate runs to max_new_tokens)")
    rows = task_for(config).data(tokenizer).heldout[:questions]
    e, max_new = config.eval, config.grpo.max_completion_length
    prompts = [r["prompt"] for r in rows]
    print(f"\nevaluation: {len(rows)} held-out questions, greedy + {e.k} samples at T={e.temperature}, "
          f"{max_new} new tokens at most, batch {e.batch_size}; seconds")
    print(f"{'threads':>7} {'tokenize':>9} {'greedy':>8} {'sampled':>8} {'decode':>8} {'score':>8} {'total':>8} "
          f"{'greedy tok':>10} {'sampled tok':>11}")
    for n in threads:
        torch.set_num_threads(n)
        torch.manual_seed(0)
        times, widths = {}, {}
        t = time.perf_counter()
        tokenizer.padding_side = "left"
        enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        times["tokenize"] = time.perf_counter() - t
        outputs = {}
        for name, repeats, params in (("greedy", 1, SamplingParams(max_new, 0.0, 1.0, e.batch_size)),
                                      ("sampled", e.k, SamplingParams(max_new, e.temperature, 1.0, e.batch_size))):
            ids = enc["input_ids"].repeat_interleave(repeats, 0)
            mask = enc["attention_mask"].repeat_interleave(repeats, 0)
            sample = params.temperature > 0
            t = time.perf_counter()
            chunks = []
            with torch.no_grad():
                for s in range(0, len(ids), params.batch_size):
                    out = model.generate(input_ids=ids[s : s + params.batch_size],
                                         attention_mask=mask[s : s + params.batch_size], max_new_tokens=max_new,
                                         do_sample=sample, temperature=params.temperature if sample else None,
                                         top_p=None, top_k=None, eos_token_id=tokenizer.eos_token_id,
                                         pad_token_id=tokenizer.pad_token_id)
                    chunks.append(out[:, ids.shape[1] :])
            times[name] = time.perf_counter() - t
            widths[name] = max(c.shape[1] for c in chunks)
            outputs[name] = [row for c in chunks for row in c]
        t = time.perf_counter()
        texts = {name: tokenizer.batch_decode(out, skip_special_tokens=True) for name, out in outputs.items()}
        times["decode"] = time.perf_counter() - t
        t = time.perf_counter()
        for name, repeats in (("greedy", 1), ("sampled", e.k)):
            [arithmetic.extract_answer(c) == rows[i // repeats]["answer"] for i, c in enumerate(texts[name])]
        times["score"] = time.perf_counter() - t
        total = sum(times.values())
        print(f"{n:>7} {times['tokenize']:>9.3f} {times['greedy']:>8.2f} {times['sampled']:>8.2f} "
              f"{times['decode']:>8.3f} {times['score']:>8.3f} {total:>8.2f} {widths['greedy']:>10} "
              f"{widths['sampled']:>11}")
    print("greedy/sampled tok: new-token columns generate ran (it stops when every row has ended)")


def profile_grpo(config: Config, threads: list[int], steps: int, checkpoint: str | None) -> None:
    """GRPO steps at each thread count, taking turns, split by the timings the trainer logs."""
    from grpokit.pipeline.build import RunSetup, make_trainer

    if checkpoint:
        model, tokenizer = load_model_and_tokenizer(checkpoint, dtype="fp32", device="cpu")
    else:
        model, tokenizer = load_policy(config)
    rl_rows = task_for(config).data(tokenizer, sft=False).train
    phases = ("rollout", "scoring", "logprob", "update")
    settings = [str(n) for n in threads]
    times: dict[str, dict[str, list[float]]] = {n: {p: [] for p in phases + ("step", "cpu")} for n in settings}
    padding = []
    saved = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as run_dir:
        seed_everything(config.seed)
        trainer = make_trainer(RunSetup(config, Path(run_dir), task_for(config), model, tokenizer, rl_rows,
                                        progress=False))
        trainer.step()  # warm-up
        for i in range(steps * len(settings)):
            setting = settings[i % len(settings)]
            cpu = time.process_time()
            torch.set_num_threads(int(setting))
            record = trainer.step()
            times[setting]["cpu"].append(time.process_time() - cpu)
            for p in phases:
                times[setting][p].append(record[f"perf/{p}_time_s"])
            times[setting]["step"].append(record["perf/step_time_s"])
            padding.append(1 - record["completion/mean_length"] / record["completion/max_length"])
    torch.set_num_threads(saved)
    g = config.grpo
    print(f"\nGRPO: {g.prompts_per_step} prompts x {g.num_generations} samples, {g.max_completion_length} new tokens "
          f"at most; median seconds over {steps} steps per setting, taking turns")
    print(f"{'threads':>7} " + " ".join(f"{p:>8}" for p in phases + ("step", "cpu")))
    for n in settings:
        print(f"{n:>7} " + " ".join(f"{statistics.median(times[n][p]):>8.3f}" for p in phases + ("step", "cpu")))
    print(f"completion columns that are padding after the row's end: {statistics.mean(padding):.0%} "
          "(the log-prob and update passes skip most: rows go in length-sorted micro-batches cut to their longest)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12, help="timed SFT steps per configuration (and GRPO steps)")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to compare, e.g. 1,2")
    parser.add_argument("--eval-questions", type=int, default=64, help="held-out questions to evaluate (demo: 500)")
    parser.add_argument("--checkpoint", help="a saved pi_SFT for the evaluation and GRPO parts")
    parser.add_argument("--grpo", action="store_true", help="also time GRPO steps (uses the trainer unchanged)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: sft, eval")
    parser.add_argument("--compile", action="store_true", help="add packed rows through torch.compile to SFT")
    args = parser.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    config = load_config([str(DEMO_PRESET)])  # the demo's settings
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads by default; python {sys.version.split()[0]}")
    if "sft" not in skip:
        profile_sft(config, threads, args.steps, compile_=args.compile)
    if "eval" not in skip:
        profile_eval(config, threads, args.eval_questions, args.checkpoint)
    if args.grpo:
        profile_grpo(config, threads, max(1, args.steps // 4), args.checkpoint)


if __name__ == "__main__":
    main()
