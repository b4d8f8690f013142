#!/usr/bin/env bash
# Evaluate QAT weights with TensorRT, the reference's command:
#
#   ./scripts/val_trt.sh <weights> <data yaml> <image_size> [--generate-graph]
#
# 1. exports W.onnx (python3 export_qat.py --weights W --include onnx --dynamic --simplify --imgsz N; on
#    TensorRT 11, which builds strongly typed networks only, with --half: FP16 for the parts that are not
#    quantized comes from the ONNX there, converted by ModelOpt AutoCast),
# 2. builds W.engine with scripts/generate_trt_engine.sh (trtexec, TensorRT-version-aware flags),
# 3. with --generate-graph: also exports the layer info and profile and renders W.engine.svg
#    (TREx when installed: ./install_dependencies.sh --trex; a plain Graphviz drawing otherwise),
# 4. evaluates: python3 val_trt.py --engine-file W.engine --data D --imgsz N.
# Run it from the top of a patched YOLOv9 tree (any folder works: paths are resolved first).
# Environment: VAL_TRT_MAX_BATCH (engine profile max batch, default 32).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PROG=${0##*/}

die() {
    echo "error: $*" >&2
    exit 2
}

usage() {
    echo "usage: $PROG <weights> <data yaml> <image_size> [--generate-graph]" >&2
    exit 2
}

help() {
    cat <<EOF
usage: $PROG <weights> <data yaml> <image_size> [--generate-graph]

Evaluates QAT weights with TensorRT, the reference project's command, from the top of a patched YOLOv9 tree:
  1. exports <weights> to ONNX (export_qat.py --include onnx --dynamic --simplify --imgsz <image_size>; --half on
     TensorRT 11, which builds strongly typed networks only),
  2. builds the engine with scripts/generate_trt_engine.sh (trtexec),
  3. with --generate-graph: also the engine's layer info and profile, drawn as <weights>.engine.svg,
  4. scores it: val_trt.py --engine-file <engine> --data <data yaml> --imgsz <image_size>.

<weights>      a quantized checkpoint (qat.py quantize's qat_best_*.pt)
<data yaml>    the dataset yaml whose val split is scored (e.g. data/coco.yaml)
<image_size>   the export and evaluation size (at least 32, e.g. 640)
Environment: VAL_TRT_MAX_BATCH (the engine profile's largest batch, default 32). Needs TensorRT and trtexec.
EOF
}

case "${1:-}" in -h|--help) help; exit 0 ;; esac
[ "$#" -ge 3 ] && [ "$#" -le 4 ] || usage
generate_graph=false
if [ "$#" -eq 4 ]; then
    [ "$4" = "--generate-graph" ] || usage
    generate_graph=true
fi
[ -f "$1" ] || die "weights file $1 not found; pass the QAT checkpoint (e.g. runs/qat/exp/weights/qat_best.pt)."
[ -f "$2" ] || die "data yaml $2 not found; pass a dataset yaml such as data/coco.yaml."
[[ "$3" =~ ^[0-9]+$ ]] && [ "$3" -ge 32 ] || die "image size $3 is out of range: it must be an integer of at least 32 (e.g. 640)."
[[ "${VAL_TRT_MAX_BATCH:-32}" =~ ^[0-9]+$ ]] && [ "${VAL_TRT_MAX_BATCH:-32}" -ge 1 ] \
    || die "VAL_TRT_MAX_BATCH=$VAL_TRT_MAX_BATCH is out of range: it must be an integer of at least 1 (default 32)."

weights=$(cd "$(dirname "$1")" && pwd -P)/$(basename "$1")
data=$(cd "$(dirname "$2")" && pwd -P)/$(basename "$2")
img_size=$3
max_batch=${VAL_TRT_MAX_BATCH:-32}
base="${weights%.*}"
onnx_file="$base.onnx"
engine="$base.engine"

cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Fail before the (long) export when TensorRT is not usable here; trtexec's version picks the export.
trt_info=$(python3 "$ROOT/scripts/trtexec_cli.py" check)
trt_version=$(printf '%s\n' "$trt_info" | sed -n 's/^trtexec version: //p')
half_flag=()
if [ "${trt_version%%.*}" -ge 11 ] 2>/dev/null; then
    half_flag=(--half)
fi

echo "exporting $onnx_file for TensorRT ${trt_version:-?}: python3 export_qat.py --weights $weights --include onnx --dynamic --simplify --imgsz $img_size ${half_flag[*]}"
python3 export_qat.py --weights "$weights" --include onnx --dynamic --simplify --imgsz "$img_size" "${half_flag[@]}"
[ -f "$onnx_file" ] || die "export_qat.py did not write $onnx_file; see its output above."

graph_flag=()
$generate_graph && graph_flag=(--graph)
bash "$ROOT/scripts/generate_trt_engine.sh" "$onnx_file" "$engine" --min 1 --opt "$max_batch" --max "$max_batch" \
    --imgsz "$img_size" "${graph_flag[@]}"
[ -f "$engine" ] || die "no engine was written to $engine; see the trtexec log $engine.build.log."

if $generate_graph; then
    [ -f "$engine.layer.json" ] || die "trtexec did not write $engine.layer.json; see $engine.build.log."
    # Draws with TREx when it is installed, else a plain Graphviz drawing (and says how to install TREx).
    python3 -m utils.qat.trt.engine_graph "$engine.layer.json" --profile "$engine.profile.json" --out "$engine.svg"
fi

python3 val_trt.py --engine-file "$engine" --data "$data" --imgsz "$img_size"
