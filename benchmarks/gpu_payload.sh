#!/usr/bin/env bash
# The GPU check's real step needs SmolLM2-135M-Instruct (`make models`: about 540 MB of fp32
# safetensors) and GSM8K's train and test files (about 5 MB), more than the 64 MiB of files one call
# to the GPU machine carries. This packs them into parts under 60 MiB and joins them there.
#
#   here:   bash benchmarks/gpu_payload.sh pack --gsm8k DIR [--model models/smollm2-135m-instruct]
#           DIR holds GSM8K's train.jsonl and test.jsonl. The weights are saved in bf16 (about 270 MB:
#           half the size; the GPU computes in bf16 anyway, model.dtype auto), config, tokenizer and
#           GSM8K beside them, all in one gzipped tar (about 200 MB) split into 4 parts
#           .gpu-payload/real.tar.part-NN (git ignores .gpu-payload/), with its sha256 and number of
#           parts in .gpu-payload/real.tar.sha256 and real.tar.parts. It prints the parts.
#   there:  one call per part, each carrying that part only (`carry: [".gpu-payload/real.tar.part-00"]`),
#           one after another while the machine stays warm (files outside $OUT stay there until it
#           goes back, 30 s after a call ends):
#             bash benchmarks/gpu_payload.sh receive
#           copies the part(s) it finds under .gpu-payload/ to /tmp/grpokit-real/. The last call
#           carries the last part, real.tar.sha256, real.tar.parts and .whl, and runs:
#             bash benchmarks/gpu_payload.sh receive && bash benchmarks/gpu_payload.sh join &&
#             bash benchmarks/gpu_check.sh --wheels .whl --out $OUT --real-dir /tmp/grpokit-real/real
#           `join` checks that every part arrived (the sha256 of the whole) and unpacks
#           /tmp/grpokit-real/real/{model,gsm8k}. A machine that went back in between has lost the
#           parts: `join` says which are missing, and they are sent again.
# Options of pack: --out DIR (default .gpu-payload), --part-size SIZE (split -b; default 56m, so a
# part, the working tree and the wheels fit one call). PYTHON (default .venv/bin/python) converts.
set -euo pipefail
cd "$(dirname "$0")/.."
RECEIVED=${GPU_PAYLOAD_DIR:-/tmp/grpokit-real}  # where parts are gathered and unpacked there
usage() { sed -n '2,25p' "$0" >&2; exit 2; }

pack() {
  local gsm8k="" model=models/smollm2-135m-instruct out=.gpu-payload part_size=56m
  while [ $# -gt 0 ]; do
    case "$1" in
      --gsm8k) gsm8k="$2"; shift 2 ;;
      --model) model="$2"; shift 2 ;;
      --out) out="$2"; shift 2 ;;
      --part-size) part_size="$2"; shift 2 ;;
      *) echo "gpu_payload.sh pack: unknown option $1" >&2; usage ;;
    esac
  done
  [ -n "$gsm8k" ] || { echo "gpu_payload.sh pack: give --gsm8k DIR (the folder of GSM8K's train.jsonl and test.jsonl)" >&2; exit 2; }
  for f in "$gsm8k/train.jsonl" "$gsm8k/test.jsonl"; do
    [ -f "$f" ] || { echo "gpu_payload.sh pack: $f is missing: --gsm8k names the folder holding train.jsonl and test.jsonl" >&2; exit 2; }
  done
  [ -f "$model/config.json" ] && [ -f "$model/model.safetensors" ] || {
    echo "gpu_payload.sh pack: $model has no config.json and model.safetensors: run \`make models\` (or give --model)" >&2; exit 2; }
  stage=$(mktemp -d)  # global: the EXIT trap reads it
  trap 'rm -rf "$stage"' EXIT
  mkdir -p "$stage/real/model" "$stage/real/gsm8k"
  cp "$gsm8k/train.jsonl" "$gsm8k/test.jsonl" "$stage/real/gsm8k/"
  # every file but the weights as it is; the weights (and config's dtype) in bf16
  find "$model" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$stage/real/model/" \;
  "${PYTHON:-.venv/bin/python}" - "$model" "$stage/real/model" <<'PY'
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

source, dest = Path(sys.argv[1]), Path(sys.argv[2])
tensors = load_file(source / "model.safetensors")
save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()},
          dest / "model.safetensors", metadata={"format": "pt"})
config = json.loads((source / "config.json").read_text())
config["dtype"] = "bfloat16"
(dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
print(f"{len(tensors)} tensors, {sum(v.numel() for v in tensors.values()) / 1e6:.1f}M values, saved in bf16")
PY
  rm -rf "$out"
  mkdir -p "$out"
  tar -C "$stage" -czf "$stage/real.tar" real  # gzip: bf16 weights shrink by about a quarter, one call fewer
  (cd "$stage" && sha256sum real.tar) > "$out/real.tar.sha256"
  split -b "$part_size" -d -a 2 "$stage/real.tar" "$out/real.tar.part-"
  ls "$out"/real.tar.part-* | wc -l > "$out/real.tar.parts"
  du -b "$out"/*
  echo "$(cat "$out/real.tar.parts") parts in $out: send each in its own call (this script's header says how)"
}

receive() {
  mkdir -p "$RECEIVED"
  local found=0
  for f in .gpu-payload/real.tar.part-* .gpu-payload/real.tar.sha256 .gpu-payload/real.tar.parts; do
    [ -f "$f" ] || continue
    cp "$f" "$RECEIVED/"
    found=1
  done
  [ "$found" = 1 ] || { echo "gpu_payload.sh receive: nothing under .gpu-payload/: carry one part in the call" >&2; exit 1; }
  echo "in $RECEIVED: $(cd "$RECEIVED" && ls real.tar.part-* 2>/dev/null | tr '\n' ' ')"
}

join() {
  cd "$RECEIVED" 2>/dev/null || { echo "gpu_payload.sh join: $RECEIVED does not exist: send the parts first" >&2; exit 1; }
  [ -f real.tar.sha256 ] && [ -f real.tar.parts ] || {
    echo "gpu_payload.sh join: real.tar.sha256 or real.tar.parts not received: carry them with the last part" >&2; exit 1; }
  local expected have
  expected=$(cat real.tar.parts)
  have=$(ls real.tar.part-* 2>/dev/null | wc -l)
  if [ "$have" != "$expected" ]; then
    local missing=""
    for i in $(seq -f '%02g' 0 $((expected - 1))); do [ -f "real.tar.part-$i" ] || missing="$missing part-$i"; done
    echo "gpu_payload.sh join: $have of $expected parts here; missing:$missing (send them again)" >&2
    exit 1
  fi
  cat real.tar.part-* > real.tar
  sha256sum -c --quiet real.tar.sha256 || { echo "gpu_payload.sh join: real.tar does not match its sha256: send the parts again" >&2; exit 1; }
  rm -rf real && tar -xzf real.tar && rm real.tar
  echo "unpacked $RECEIVED/real: --real-dir $RECEIVED/real"
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  receive) receive ;;
  join) join ;;
  *) usage ;;
esac
