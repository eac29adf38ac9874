#!/usr/bin/env bash
# The vLLM rollout engine on one CUDA GPU, in under 5 minutes:
#   1. the demo with rollout.engine=vllm and sleep mode on (GRPO must lift held-out accuracy);
#   2. generation tokens/s of a random-init Qwen2 with Qwen2-0.5B's shapes in bf16, hf vs vllm;
#   3. GRPO step time of that policy, grpokit+hf vs grpokit+vllm (perf/step_time_s, median);
#   4. that policy in bf16 under FSDP2 (torchrun, world size 1) with LoRA and gradient checkpointing:
#      4 GRPO steps, their step time and the adapter checkpoint.
# Needs a venv with a CUDA torch, vllm and grpokit (`pip install -e .[vllm]`); PYTHON picks it.
# Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${1:-$(mktemp -d /tmp/grpokit-gpu-check.XXXXXX)}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
STEP_ARGS=(--grpo.max_steps=4 --prompts_per_step=8 --num_generations=8 --max_completion_length=128
           --num_eval_questions=8 --eval.k=2 --eval.before=false --quiet)

"$PY" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; \
print(f'torch {torch.__version__}, vllm {vllm.__version__}, {torch.cuda.get_device_name(0)}')"

echo "== 1. demo, rollout.engine=vllm, sleep mode on"
start=$SECONDS
timeout 200 "$PY" -m grpokit.cli demo --rollout.engine=vllm --rollout.sleep_mode=true --model.device=cuda \
    --seed 0 --quiet --output-dir "$OUT/demo"
"$PY" - "$OUT/demo/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
gain = s["grpo_accuracy"] - s["sft_accuracy"]
print(f"demo: sft {s['sft_accuracy']:.3f} -> grpo {s['grpo_accuracy']:.3f} (gain {gain:+.3f}, "
      f"target >= +0.150: {'met' if gain >= 0.15 else 'MISSED'}), {s['wall_seconds']:.0f} s")
EOF
echo "demo stage: $((SECONDS - start)) s"

echo "== 2. generation, Qwen2 0.5b shapes, bf16, 64 prompts x 128 new tokens"
timeout 120 "$PY" benchmarks/rollout_engines.py --sizes 0.5b --device cuda --dtype bfloat16 --kv-cache-gb 4 \
    --threads 4

echo "== 3. GRPO step time, same policy, 8 prompts x 8 completions x 128 tokens, 4 steps"
"$PY" benchmarks/rollout_engines.py --save-model 0.5b "$OUT/qwen2-0.5b"
for engine in hf vllm; do
    timeout 90 "$PY" -m grpokit.cli train --model.name_or_path="$OUT/qwen2-0.5b" --model.device=cuda \
        --model.dtype=bf16 --rollout.engine="$engine" --rollout.kv_cache_gb=4 \
        --output_dir="$OUT/step-$engine" "${STEP_ARGS[@]}"
done
"$PY" - "$OUT" <<'EOF'
import json, statistics, sys
for engine in ("hf", "vllm"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/step-{engine}/metrics.jsonl")]
    steps = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r][1:]  # the first step warms up
    rollout = [r["perf/rollout_time_s"] for r in rows if "perf/rollout_time_s" in r][1:]
    print(f"grpokit+{engine}: step {statistics.median(steps):.2f} s (median of {len(steps)}), "
          f"of which rollout {statistics.median(rollout):.2f} s")
EOF
echo "== 4. FSDP2 (world size 1), LoRA r=16, gradient checkpointing, bf16, same policy and batch"
timeout 150 "$PY" -m torch.distributed.run --nproc_per_node=1 -m grpokit train \
    --model.name_or_path="$OUT/qwen2-0.5b" --model.dtype=bf16 --distributed.fsdp=on \
    --model.lora.r=16 --model.lora.alpha=32 --model.gradient_checkpointing=true \
    --output_dir="$OUT/fsdp-lora" "${STEP_ARGS[@]}"
"$PY" - "$OUT/fsdp-lora" <<'EOF'
import json, os, statistics, sys
rows = [json.loads(line) for line in open(f"{sys.argv[1]}/metrics.jsonl")]
steps = [r["perf/step_time_s"] for r in rows][1:]
adapter = os.path.join(sys.argv[1], "checkpoints", "step-4", "adapter_model.safetensors")
print(f"FSDP2 + LoRA + gradient checkpointing: {len(rows)} steps, step {statistics.median(steps):.2f} s "
      f"(median after the first); adapter saved: {os.path.isfile(adapter)}")
EOF
echo "total: $SECONDS s; results under $OUT"
