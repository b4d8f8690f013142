#!/usr/bin/env bash
# Thin wrapper: scripts/benchmark_trt.sh --fp16 FP16.onnx --int8 QAT.onnx [--batch 1 4 8 12] [--out DIR]
# (all options: python3 scripts/benchmark_trt.py --help)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
exec python3 "$ROOT/scripts/benchmark_trt.py" "$@"
