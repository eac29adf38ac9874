"""Peak CPU memory of per-token log-probs: all-logits forward vs the chunked completion-only path.

    python benchmarks/logprob_memory.py [--rows 16] [--prompt 16] [--completion 256] [--chunk-size 1024]

A randomly initialised Qwen2 with Qwen2's 151,936-token vocabulary (hidden 256, 2 layers, tied
embeddings) scores rows x completion tokens after a left-padded prompt. Each measurement runs in
a fresh subprocess: its cost is the peak resident set size minus the resident size after the model
and batch are built, so the weights and the interpreter are not counted. The peak is the kernel's
VmHWM, reset (/proc/self/clear_refs) before the pass so building the model cannot set it; getrusage's
ru_maxrss would not do, as it keeps the parent's resident size from before exec.

  naive    the model's forward with logits at every position, sliced to the completion
           afterwards (token_logprobs before chunking).
  chunked  token_logprobs: backbone only, LM head over completion positions in tiles of
           --chunk-size positions, each tile checkpointed when gradients are on.

  training   forward with entropy, then backward of a masked mean of log-probs (a policy step).
  reference  forward under torch.no_grad (reference or old-policy log-probs).

Both methods' log-probs (and, for training, every parameter's gradient) are compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from grpokit.models.logprobs import position_ids_for, token_logprobs

VOCAB = 151_936
TEMPERATURE = 0.7
METHODS = ("naive", "chunked")
MODES = ("training", "reference")


def naive_token_logprobs(model, input_ids, attention_mask, prompt_length, temperature, with_entropy):
    """Log-probs from the forward's logits at all P + T positions, sliced afterwards."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_for(attention_mask),
                use_cache=False)
    logits = out.logits[:, prompt_length - 1 : -1].float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, input_ids[:, prompt_length:].unsqueeze(-1)).squeeze(-1) - log_norm
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logp, entropy


def build(args):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=512, max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(1)
    length = args.prompt + args.completion
    ids = torch.randint(2, VOCAB, (args.rows, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(args.rows):
        left_pad = row % (args.prompt // 2)  # prompts of different lengths, left-padded
        ids[row, :left_pad], mask[row, :left_pad] = 0, 0
        end = args.prompt + args.completion - (row * 37) % (args.completion // 2)  # completions right-padded
        ids[row, end:], mask[row, end:] = 0, 0
    return model, ids, mask


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Lower the kernel's peak-RSS mark to the current RSS (Linux); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The process's peak resident size since start or since the last reset_peak_rss()."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args) -> None:
    model, ids, mask = build(args)
    training = args.mode == "training"
    model.train(training)
    gc.collect()
    reset = reset_peak_rss()
    baseline = current_rss_bytes()
    start = time.perf_counter()
    with torch.set_grad_enabled(training):
        if args.method == "naive":
            logp, _ = naive_token_logprobs(model, ids, mask, args.prompt, TEMPERATURE, with_entropy=training)
        else:
            logp, _ = token_logprobs(model, ids, mask, args.prompt, TEMPERATURE, micro_batch_size=args.rows,
                                     with_entropy=training, chunk_size=args.chunk_size)
        if training:
            completion_mask = mask[:, args.prompt :].float()
            (-(logp * completion_mask).sum() / completion_mask.sum()).backward()
    seconds = time.perf_counter() - start
    peak = peak_rss_bytes()
    result = {"peak_bytes": peak - baseline, "peak_reset": reset, "seconds": seconds}
    saved = {"logp": logp.detach()}
    if training:
        saved.update({name: p.grad for name, p in model.named_parameters()})
    torch.save(saved, args.save)
    print(json.dumps(result))


def run_worker(args, method: str, mode: str, save: Path) -> dict:
    command = [sys.executable, __file__, "--worker", method, mode, "--save", str(save),
               "--rows", str(args.rows), "--prompt", str(args.prompt), "--completion", str(args.completion),
               "--chunk-size", str(args.chunk_size)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{method}/{mode} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def max_difference(a: dict, b: dict) -> tuple[float, float]:
    logp = (a["logp"] - b["logp"]).abs().max().item()
    grads = [(a[k] - b[k]).abs().max().item() / max(1.0, b[k].abs().max().item()) for k in a if k != "logp"]
    return logp, max(grads, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.method, args.mode = args.worker
        worker(args)
        return

    mib = 2**20
    print(f"Qwen2, vocab {VOCAB:,}, hidden 256, 2 layers; {args.rows} rows x ({args.prompt} prompt + "
          f"{args.completion} completion) tokens; chunk {args.chunk_size} positions; temperature {TEMPERATURE}")
    all_logits = args.rows * (args.prompt + args.completion) * VOCAB * 4 / mib
    print(f"one float32 [rows, P+T, vocab] logits tensor: {all_logits:,.0f} MiB; "
          f"one float32 [chunk, vocab] tile: {args.chunk_size * VOCAB * 4 / mib:,.0f} MiB")
    print(f"embedding (tied with the LM head): {VOCAB * 256 * 4 / mib:,.0f} MiB; "
          "both methods hold its gradient in training")
    print()
    print(f"{'mode':<10} {'naive MiB':>10} {'chunked MiB':>12} {'ratio':>6} {'naive s':>8} {'chunked s':>10} "
          f"{'max |dlogp|':>12} {'max rel dgrad':>14}")
    worst_logp, worst_ratio = 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            results = {m: run_worker(args, m, mode, Path(tmp) / f"{m}-{mode}.pt") for m in METHODS}
            for m, r in results.items():
                if not r["peak_reset"]:
                    print(f"warning: {m}/{mode} could not reset its peak RSS; the figure may be the build's peak")
            saved = {m: torch.load(Path(tmp) / f"{m}-{mode}.pt") for m in METHODS}
            dlogp, dgrad = max_difference(saved["chunked"], saved["naive"])
            naive, chunked = (results[m]["peak_bytes"] / mib for m in METHODS)
            ratio = chunked / naive
            worst_logp, worst_ratio = max(worst_logp, dlogp), max(worst_ratio, ratio)
            grad_column = f"{dgrad:>14.2e}" if mode == "training" else f"{'-':>14}"
            print(f"{mode:<10} {naive:>10,.0f} {chunked:>12,.0f} {ratio:>6.3f} {results['naive']['seconds']:>8.1f} "
                  f"{results['chunked']['seconds']:>10.1f} {dlogp:>12.2e} {grad_column}")
    print()
    agree, small = worst_logp <= 1e-5, worst_ratio <= 0.25
    print(f"log-probs agree within 1e-5: {'yes' if agree else 'NO'} (max {worst_logp:.2e}); "
          f"chunked/naive <= 0.25: {'yes' if small else 'NO'} (worst {worst_ratio:.3f})")
    if not (agree and small):
        sys.exit(1)


if __name__ == "__main__":
    main()
