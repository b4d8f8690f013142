#!/usr/bin/env bash
# Does the TensorRT engine compute what the ONNX graph does? Polygraphy runs both, TensorRT and ONNX Runtime,
# on the same inputs and compares them output by output with INT8-suited tolerances, then checks that the
# confident detections keep their class and box; it prints one `verdict: MATCH|MISMATCH ...` line.
#
#   scripts/compare_trt.sh ONNX [--engine ENGINE] [--images DIR] [--imgsz N] [--batch B] [--plugins LIB.so]
#                               [--reference-only] [--dry-run --trt-version 11.1]
#
# Needs Polygraphy (pip install polygraphy) and, for the TensorRT side, a GPU host with TensorRT; the ONNX
# Runtime side (--reference-only) runs anywhere. Exit status: 0 match, 1 mismatch, 2 wrong usage or input.
# All options: python3 -m utils.qat.trt.compare --help.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)

if [ "$#" -lt 1 ]; then
    echo "usage: $0 ONNX [--engine ENGINE] [--images DIR] [--imgsz N] [--batch B] [--plugins LIB.so] [--dry-run]" >&2
    exit 2
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec python3 -m utils.qat.trt.compare "$@"
