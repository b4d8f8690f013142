#!/usr/bin/env bash
# Build a TensorRT engine from an exported ONNX with trtexec, with flags for the installed TensorRT:
#   TensorRT <= 10: --fp16 --int8 (weakly typed; --fp16-only for the FP16 baseline)
#   TensorRT 11:    --stronglyTyped (precisions come from the ONNX: Q/DQ nodes, --half export)
#
#   scripts/generate_trt_engine.sh ONNX ENGINE [--min B] [--opt B] [--max B] [--imgsz N] [--fp16-only] [--graph]
#
# --graph also writes ENGINE.layer.json and ENGINE.profile.json (--exportLayerInfo, --exportProfile,
# --profilingVerbosity=detailed) for `python3 -m utils.qat.trt.engine_graph ENGINE.layer.json`.
# Writes ENGINE atomically, ENGINE.json (TensorRT version, stride, names, imgsz, ...) and
# ENGINE.build.log. More options: python3 scripts/trtexec_cli.py build --help.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)

if [ "$#" -lt 2 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    echo "usage: $0 ONNX ENGINE [--min B] [--opt B] [--max B] [--imgsz N] [--fp16-only] [--graph]" >&2
    [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ] && exit 0
    exit 2
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec python3 "$ROOT/scripts/trtexec_cli.py" build "$@"
