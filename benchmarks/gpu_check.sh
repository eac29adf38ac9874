#!/usr/bin/env bash
# grpokit on one CUDA GPU in at most 8 minutes, each step within its own time limit. Every step
# runs even when another failed; each prints one PASS/FAIL/SKIP line; OUT/summary.json holds
# every number and OUT/gpu_check.log every step's output; the exit status is 1 if any step failed.
#   setup      install --wheels, import torch, transformers, peft, pydantic, math_verify, grpokit; CUDA
#   demo       `grpokit demo` on CUDA, bf16 compute with fp32 master weights: gain >= +15 points, wall time
#   movement   benchmarks/bf16_movement.py (12 GRPO steps from the demo's pi_SFT): bf16 moves the
#              weights as fp32 does (mean |dW| ratio within 0.9..1.1)
#   policy     a random-init Qwen2 with Qwen2-0.5B's shapes and a character tokenizer built offline
#   grpo_lora  4 GRPO steps, 4 prompts x 4 completions of 1,024 tokens, FSDP2 at world size 1, LoRA r=16,
#              gradient checkpointing, bf16: peak GPU memory, step time (rollout, log-probs, update) and the
#              update's MFU (6 x parameters x tokens / update seconds / 790 TFLOP/s; benchmarks/gpu_check.py
#              says what is counted)
#   grpo_full  the same model full fine-tuned, 2 steps: peak memory, step time, MFU
#   vllm       hf vs vllm generation throughput, only where `import vllm` works; else SKIP with the reason
#   vllm_grpo  grpo_lora with rollout.engine=vllm: merged-weight push + sync probe times and the
#              engine-vs-trainer log-prob mismatch, only where `import vllm` works; else SKIP
#
# On the GPU machine (Python 3.12 with torch, transformers, peft, tokenizers, safetensors, pyyaml,
# tqdm, matplotlib; no pydantic or math-verify, no network):
#   1. here, once: `make gpu-wheels` downloads grpokit's missing dependencies as wheels for
#      Python 3.12 on manylinux x86-64 into .whl/ (git ignores it; about 3 MiB);
#   2. run from the repository root there, carrying .whl, with $OUT the folder that comes back:
#        bash benchmarks/gpu_check.sh --wheels .whl --out $OUT
#      The script installs the wheels (pip --no-index --target, into its work folder) and puts src/
#      on PYTHONPATH itself: grpokit need not be installed there. Give the command 10 minutes.
# Options: --steps demo,grpo_lora (some steps only), --cap demo=200 (another step time limit; the
# 8 minutes still hold), --work DIR (models and runs; default a new /tmp folder), --device cpu
# (the tiny dry run that `make test-slow` runs: tests/test_gpu_check.py). PYTHON picks the
# interpreter (default python3). `python3 benchmarks/gpu_check.py --help` lists everything.
set -u
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
