#!/usr/bin/env bash
# grpokit on one CUDA GPU in at most 8 minutes, each step within its own time limit. Every step
# runs even when another failed; each prints one PASS/FAIL/SKIP line; OUT/summary.json holds
# every number and OUT/gpu_check.log every step's output; the exit status is 1 if any step failed.
# The timed steps have the GPU alone; demo and real (accuracy targets, small models) run side by side.
#   setup      30 s  install --wheels, import torch, transformers, peft, pydantic, math_verify, grpokit; CUDA;
#                    the MFU peak by the device's name (H200 790, H100 989, H100 PCIe 756 TFLOP/s bf16)
#   packing    20 s  flash_attention_2 (when installed): packed against padded log-probs with two packed rows a
#                    forward, and that grpokit pads (grpo.pack_rows=auto) where they differ; SKIP without it
#   generate   95 s  a random-init Qwen2 with Qwen2-0.5B's shapes and a character tokenizer built offline (the
#                    policy the GRPO steps train); completion tokens/s, 64 completions of 1,024 tokens in bf16,
#                    plain `generate` (hf) beside the static-cache engine (hf_static): target >= 10,000 tokens/s
#                    for the fast one
#   grpo_lora  95 s  GRPO steps, 16 prompts x 4 completions of 1,024 tokens, LoRA r=16, bf16 compute, the
#                    fast engine: step time (rollout, log-probs, update), peak memory, perf/padding_frac
#                    where logged; target <= 15 s a step
#   grpo_full  85 s  the same model full fine-tuned: the update's MFU (6 x parameters x trained tokens /
#                    update seconds / peak); target >= 30%
#   demo      155 s  `grpokit demo` on CUDA in the default precision: gain >= +15 points
#   real      155 s  SmolLM2-135M-Instruct: SFT on GSM8K's training set (60 steps of 64: half an epoch), eval
#                    on 500 test questions (greedy, pass@4), GRPO for as many steps as fit (SIGTERM at the
#                    time that leaves room for the second eval), eval again: the table, the paired 95% interval
#                    of the greedy gain (target: above zero), reward curve, step time, peak memory. Needs
#                    --real-dir (below); without it, SKIP in one line. In the full check it has 155 s beside
#                    the demo, room for few GRPO steps: `--steps real --cap real=440` gives it the 8 minutes.
#
# On the GPU machine (Python 3.12 with torch, transformers, peft, tokenizers, safetensors, pyyaml,
# tqdm, matplotlib; no pydantic or math-verify, no network):
#   1. here, once: `make gpu-wheels` downloads grpokit's missing dependencies as wheels for
#      Python 3.12 on manylinux x86-64 into .whl/ (git ignores it; about 3 MiB);
#   2. for the real step: `bash benchmarks/gpu_payload.sh pack --gsm8k DIR` packs the model and GSM8K
#      into .gpu-payload/ in parts under 60 MiB, sent one part per call (its header says how);
#   3. run from the repository root there, carrying .whl, with $OUT the folder that comes back:
#        bash benchmarks/gpu_check.sh --wheels .whl --out $OUT [--real-dir /tmp/grpokit-real/real]
#      The script installs the wheels (pip --no-index --target, into its work folder) and puts src/
#      on PYTHONPATH itself: grpokit need not be installed there. Give the command 10 minutes.
# Options: --steps generate,grpo_lora (some steps only), --cap real=400 (another step time limit; the
# 8 minutes still hold unless --deadline says otherwise), --engines hf,hf_static (the generate step's
# engines; the last is the fast path), --peak-tflops N, --work DIR (models and runs; default a new /tmp
# folder), --device cpu (the tiny dry run that `make test-slow` runs: tests/test_gpu_check.py).
# PYTHON picks the interpreter (default python3). `python3 benchmarks/gpu_check.py --help` lists everything.
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
