#!/usr/bin/env bash
# The toolkit's main job end to end, on the embedded model and dataset, on a CPU, in minutes:
#   YOLOv9 tree -> patch -> shapes dataset -> PTQ calibration + short QAT -> Origin/PTQ/QAT evaluation
#   -> Q/DQ ONNX export + lint -> ONNX Runtime evaluation of the INT8 ONNX -> comparison table.
#
#   ./scripts/quickstart.sh [WORK_DIR]        (default: ${TMPDIR:-/tmp}/yolov9-qat-quickstart, outside the checkout)
#
# The YOLOv9 tree comes from $YOLOV9_DIR, or is cloned from GitHub when the network allows.
# Knobs (environment): QS_ITERS (QAT steps per epoch, default 32), QS_EPOCHS (2), QS_DEVICE (cpu).
set -euo pipefail

usage() {
    cat <<EOF
usage: scripts/quickstart.sh [WORK_DIR]

The toolkit's main job end to end on the embedded model and dataset, on a CPU, in minutes: a YOLOv9 tree copied
into WORK_DIR and patched, the shapes dataset generated, PTQ calibration and a short QAT (qat.py quantize), the
Origin / PTQ / QAT evaluation, the Q/DQ ONNX export with its lint (export_qat.py), the INT8 graph scored on ONNX
Runtime (val_trt.py), and the FP / PTQ / QAT / ONNX Runtime table.

WORK_DIR   where the tree, the data and the runs go (default: \${TMPDIR:-/tmp}/yolov9-qat-quickstart, outside
           the checkout); a tree copied there is reused while it came from the same YOLOV9_DIR.

Environment:
  YOLOV9_DIR   a YOLOv9 tree (a clone) to copy; unset: upstream is cloned from GitHub when the network allows
  QS_ITERS     QAT steps per epoch (default 32)
  QS_EPOCHS    QAT epochs (default 2)
  QS_DEVICE    the device of every stage (default cpu)
  PYTHON       the interpreter (default python3)
EOF
}
case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    -*) echo "error: unknown option $1; usage: scripts/quickstart.sh [WORK_DIR] (--help says more)." >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "error: scripts/quickstart.sh takes one WORK_DIR at most, got $#: $*." >&2; exit 2; }

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
for knob in QS_ITERS QS_EPOCHS; do  # checked before anything is created
    if ! [[ "${!knob:-1}" =~ ^[0-9]+$ ]] || [ "${!knob:-1}" -lt 1 ]; then
        echo "error: $knob=${!knob} is out of range: it must be an integer of at least 1." >&2
        exit 2
    fi
done
WORK_ARG=${1:-${TMPDIR:-/tmp}/yolov9-qat-quickstart}
WORK=$(mkdir -p "$WORK_ARG" && cd "$WORK_ARG" && pwd -P)
ITERS=${QS_ITERS:-32}
EPOCHS=${QS_EPOCHS:-2}
DEVICE=${QS_DEVICE:-cpu}
PY=${PYTHON:-python3}
WEIGHTS=$REPO/weights/gelan-qs-shapes.pt
TREE=$WORK/yolov9
RUN=$WORK/runs/quickstart
IMGSZ=256
UPSTREAM=github.com/WongKinYiu/yolov9

say() { printf '\n==> %s\n' "$*"; }
die() { echo "error: $*" >&2; exit 1; }

say "1/6 YOLOv9 tree"
# The copy in $TREE is reused only while it came from the same place: $SOURCE records where that was.
SOURCE=$WORK/yolov9.source
had=$(cat "$SOURCE" 2>/dev/null || true)
if [ -n "${YOLOV9_DIR:-}" ]; then
    [ -f "$YOLOV9_DIR/models/yolo.py" ] || die "YOLOV9_DIR=$YOLOV9_DIR is not a YOLOv9 tree (no models/yolo.py); point it at a clone."
    want=$(cd "$YOLOV9_DIR" && pwd -P)
else
    want=$UPSTREAM
fi
if [ -f "$TREE/.yolov9-qat-manifest" ] && { [ -z "${YOLOV9_DIR:-}" ] || [ "$had" = "$want" ]; }; then
    echo "reusing $TREE (from ${had:-an unrecorded source}; set YOLOV9_DIR to another clone for a new copy)"
else
    [ -d "$TREE" ] && echo "replacing $TREE (it came from ${had:-an unrecorded source}, this run uses $want)"
    rm -rf "$TREE" "$SOURCE"
    if [ -n "${YOLOV9_DIR:-}" ]; then
        echo "copying YOLOV9_DIR=$want to $TREE"
        mkdir -p "$TREE" && cp -a "$want/." "$TREE/"
        chmod -R u+w "$TREE"
    else
        echo "YOLOV9_DIR is not set: cloning $want"
        timeout 120 git clone --depth 1 -q "https://$want.git" "$TREE" \
            || die "cloning YOLOv9 failed (no network?); set YOLOV9_DIR to a YOLOv9 clone and run again."
    fi
    echo "$want" > "$SOURCE"
fi

say "2/6 patch the tree with the yolov9-qat overlay"
bash "$REPO/patch_yolov9.sh" "$TREE"

say "3/6 embedded shapes dataset (deterministic, seed 0)"
if [ -f "$WORK/shapes/shapes.yaml" ]; then
    echo "reusing $WORK/shapes"
else
    "$PY" "$REPO/scripts/make_shapes_dataset.py" --out "$WORK/shapes" --seed 0
fi
DATA=$WORK/shapes/shapes.yaml

cd "$TREE"
say "4/6 PTQ calibration + QAT ($EPOCHS epoch(s) x $ITERS batches) of the embedded model, evaluated at each stage"
# The default recipe (augmentation, mse calibration, head scales searched, learned scales) cut to a CPU's budget: 8
# calibration batches instead of 25 and $EPOCHS x $ITERS steps instead of 5 x 100. On this small model the short
# fine-tune moves the score around PTQ by about as much as the CPU's rounding does (docs/QAT_CALIBRATION.md,
# "The quickstart"): the run shows the pipeline, and says so under its table.
"$PY" qat.py quantize --weights "$WEIGHTS" --data "$DATA" \
    --imgsz $IMGSZ --batch-size 16 --device "$DEVICE" --workers 2 --calib-batches 8 \
    --epochs "$EPOCHS" --iters "$ITERS" --project "$WORK/runs" --name quickstart --exist-ok
QAT=$RUN/weights/qat_best_gelan-qs-shapes.pt

say "5/6 Q/DQ ONNX export + lint"
# --dynamic as README's step 3: batches of 16 and the checkpoint's own input sizes, so the graph is scored as
# qat.py eval scored the checkpoint.
"$PY" export_qat.py --weights "$QAT" --include onnx --dynamic --simplify --imgsz $IMGSZ --device cpu
ONNX=${QAT%.pt}.onnx

say "6/6 INT8 ONNX Runtime evaluation of the exported graph"
"$PY" val_trt.py --onnx "$ONNX" --backend onnxruntime --data "$DATA" --imgsz $IMGSZ --batch-size 16 \
    --workers 2 --project "$WORK/runs" --name quickstart-onnx --exist-ok \
    --report "$RUN/report.json" --report-name "INT8 ONNX Runtime"

say "done"
cat "$RUN/report.md"
cat <<EOF

On this small model calibration alone keeps the score within about 0.006-0.008 of FP, and $EPOCHS x $ITERS
fine-tuning steps on a CPU move it by about +/- 0.003 around PTQ, up on some CPUs and down on others (their kernels
round differently, and 64 images cannot tell such differences apart). The QAT row shows the pipeline at work, not
what fine-tuning buys: that is measured on real models, with how sure each figure is, in README's tables.
EOF
cat <<EOF

Files:
  $RUN/report.md, report.json, qat_ap.png     the comparison (Origin / PTQ / QAT / INT8 ONNX Runtime)
  $RUN/weights/                               PTQ and QAT checkpoints
  $ONNX                                       the INT8 Q/DQ ONNX for TensorRT

Next, on your own model (from the top of a patched YOLOv9 tree):
  python3 qat.py quantize --weights yolov9-c-converted.pt --data data/coco.yaml --device 0
  python3 export_qat.py --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --include onnx --dynamic --simplify
  ./scripts/val_trt.sh runs/qat/exp/weights/qat_best_yolov9-c-converted.pt data/coco.yaml 640   (needs TensorRT)
EOF
