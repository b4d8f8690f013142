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

USAGE="usage: $0 ONNX ENGINE [--min B] [--opt B] [--max B] [--imgsz N] [--fp16-only] [--graph]"
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    cat <<EOF
$USAGE

Builds the TensorRT engine ENGINE from the exported ONNX with trtexec, with the flags the installed TensorRT takes
(TensorRT <= 10: --fp16 --int8; TensorRT 11: --stronglyTyped, the precisions coming from the ONNX's Q/DQ nodes).
Writes ENGINE whole, ENGINE.json (TensorRT version, stride, class names, image size) and ENGINE.build.log.

  ONNX          the graph export_qat.py wrote (--dynamic for a batch range)
  ENGINE        the engine file to write
  --min/--opt/--max B   the optimization profile's batch sizes (default 1 / the max / 16)
  --imgsz N     the height and width of a graph exported with dynamic ones
  --fp16-only   the FP16 baseline (no INT8) on TensorRT <= 10
  --graph       also ENGINE.layer.json and ENGINE.profile.json (layer info and profile, for engine graphs)
More options: python3 scripts/trtexec_cli.py build --help. Needs trtexec (on PATH, or TRTEXEC).
EOF
    exit 0
fi
if [ "$#" -lt 2 ]; then
    echo "$USAGE" >&2
    exit 2
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec python3 "$ROOT/scripts/trtexec_cli.py" build "$@"
