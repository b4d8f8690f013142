#!/usr/bin/env bash
# The tables of docs/CPU.md ("Deploying on CPUs") in one command: GELAN-C (c) and YOLOv9-t (t) from ../shared/weights,
# each calibrated on coco369 and exported FP32 and INT8, their mAP on coco334 on ONNX Runtime and OpenVINO, and their
# CPU speed (benchmarks/cpu_deploy.py). Writes OUT/cpu-deploy.json, .md and .png (and the graphs in OUT/c, OUT/t).
#
#   YOLOV9_DIR=/path/to/yolov9 benchmarks/cpu_deploy.sh OUT [more benchmarks/cpu_deploy.py flags]
#
# YOLOV9_DIR: a YOLOv9 tree with ELAN1 / AConv (a clone, or ../shared/tools/make-yolov9-tree.sh with
# YOLOV9_STANDIN=yolo9); it is copied and patched in a temporary folder, never changed. The data and weights come
# from YOLOV9_QAT_SHARED (default: ../shared beside the repository). Needs OpenVINO (install_dependencies.sh
# --openvino). Later flags win, e.g. --threads 2, --batch 1 4, --no-map, --device cpu.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
die() { echo "error: $*" >&2; exit 1; }

[ $# -ge 1 ] && [ -n "$1" ] || { echo "error: usage: benchmarks/cpu_deploy.sh OUT [benchmarks/cpu_deploy.py flags]." >&2; exit 2; }
OUT_ARG=$1
shift
SHARED=${YOLOV9_QAT_SHARED:-$REPO/../shared}
PY=${PYTHON:-python3}
[ -n "${YOLOV9_DIR:-}" ] || die "YOLOV9_DIR is not set: point it at a YOLOv9 tree with ELAN1 (a clone)."
[ -f "$YOLOV9_DIR/models/common.py" ] || die "YOLOV9_DIR=$YOLOV9_DIR is not a YOLOv9 tree (no models/common.py)."
grep -q "^class ELAN1(" "$YOLOV9_DIR/models/common.py" \
    || die "YOLOV9_DIR=$YOLOV9_DIR has no ELAN1, which yolov9-t needs: use a clone of WongKinYiu/yolov9 (or the yolo9 stand-in)."
for f in weights/gelan-c-coco334.pt weights/yolov9-t-coco.pt datasets/coco-qat.yaml datasets/coco334 datasets/coco369; do
    [ -e "$SHARED/$f" ] || die "$SHARED/$f not found: set YOLOV9_QAT_SHARED to the shared/ folder."
done
SHARED=$(cd "$SHARED" && pwd -P)
OUT=$(mkdir -p "$OUT_ARG" && cd "$OUT_ARG" && pwd -P)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/yolov9-qat-cpu-deploy.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/yolov9"
cp -a "$YOLOV9_DIR/." "$WORK/yolov9/"
chmod -R u+w "$WORK/yolov9"
bash "$REPO/patch_yolov9.sh" "$WORK/yolov9" >/dev/null
sed "s#^path: .*#path: $SHARED/datasets#" "$SHARED/datasets/coco-qat.yaml" >"$WORK/coco-qat.yaml"

cd "$WORK/yolov9"
"$PY" "$REPO/benchmarks/cpu_deploy.py" --model "c=$SHARED/weights/gelan-c-coco334.pt" \
    --model "t=$SHARED/weights/yolov9-t-coco.pt" --data "$WORK/coco-qat.yaml" --imgsz 640 --out "$OUT" "$@"
