#!/usr/bin/env bash
# Install what yolov9-qat needs, with pip only (no sudo, no apt). Safe to run again.
#
# torch and torchvision are never installed, upgraded or downgraded once present: every pip
# command runs with a constraints file that pins them to the installed versions, so a package
# that wants another torch makes pip stop with a conflict instead of changing torch.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
readonly HERE
# TREx was removed from NVIDIA/TensorRT in 11.1 (its README: replaced by Nsight Deep Learning Designer); v11.0 is
# the last tag that ships it (TREx 0.2.1). It reads TensorRT 10 engine layer information only.
readonly TREX_URL="git+https://github.com/NVIDIA/TensorRT.git@v11.0#subdirectory=tools/experimental/trt-engine-explorer"
readonly NVIDIA_INDEX="https://pypi.nvidia.com"
readonly TRT_STUBS="tensorrt-stubs"
# OpenVINO runs the Q/DQ ONNX on CPUs with INT8 kernels (val_trt.py --backend openvino, scripts/benchmark_cpu.py);
# a ~60 MB wheel from PyPI that brings only numpy and openvino-telemetry.
readonly OPENVINO="openvino"
# The peers benchmarks/peers.py runs beside this toolkit: OpenVINO's NNCF (its PTQ, as Ultralytics runs it). NVIDIA
# ModelOpt's ONNX PTQ, the other peer, comes with nvidia-modelopt (requirements.txt).
readonly NNCF="nncf"
PROG=${0##*/}

usage() {
    # what --dev installs, read from the file it installs (names only, comma-separated)
    local dev
    dev=$(grep -Ev '^[[:space:]]*(#|$)' "$HERE/requirements-dev.txt" | sed 's/[[:space:]<>=!~;[].*//' | paste -sd, - \
        | sed 's/,/, /g')
    cat <<EOF
usage: $PROG [--yolov9 DIR] [--dev] [--openvino] [--peers] [--tensorrt] [--trex] [--python PY] [--dry-run]

Installs with pip what yolov9-qat needs on top of YOLOv9's own requirements
($HERE/requirements.txt: nvidia-modelopt, onnx, onnxruntime, ...). An installed torch and
torchvision are kept as they are.

options:
  --yolov9 DIR  also install YOLOv9's own DIR/requirements.txt (without its torch and torchvision
                lines when torch is installed, and without opencv-python: opencv-python-headless
                provides cv2)
  --dev         also install what the tests need, $HERE/requirements-dev.txt:
                $dev;
                and $TRT_STUBS (type stubs for the TensorRT check; installed with --no-deps: it declares a
                dependency on tensorrt, which installs only on GPU hosts)
  --openvino    also install OpenVINO ($OPENVINO from PyPI), which runs the exported Q/DQ ONNX on CPUs with INT8
                kernels (val_trt.py --backend openvino, scripts/benchmark_cpu.py)
  --peers       also install what benchmarks/peers.py needs to run the quantizers users would pick instead:
                NNCF ($NNCF from PyPI) and OpenVINO (ModelOpt's ONNX PTQ comes with nvidia-modelopt)
  --tensorrt    also install the TensorRT Python wheels matching the CUDA of the installed torch
                (tensorrt-cu12, tensorrt-cu13, ... from $NVIDIA_INDEX), unless TensorRT is
                already present (e.g. in an NGC container)
  --trex        also install TensorRT Engine Explorer (trex 0.2.1, for engine graphs of TensorRT 10;
                optional) from github.com/NVIDIA/TensorRT at tag v11.0, the last that ships it
                (TensorRT 11.1 removed it; Nsight Deep Learning Designer replaces it)
  --python PY   the Python interpreter to install for (default: python3)
  --dry-run     print the pip commands instead of running them
  -h, --help    show this help

Without --tensorrt, TensorRT is not touched; an installed one is reported with its version.
exit status: 0 done, 1 a step failed (named in one 'error: ...' sentence), 2 wrong usage.
EOF
}

die() {
    echo "error: $*" >&2
    exit 1
}

usage_error() {
    echo "error: $* (see $PROG --help)." >&2
    exit 2
}

# step NAME HINT CMD...: runs CMD (or prints it with --dry-run); stops the script naming the step.
step() {
    local name=$1 hint=$2
    shift 2
    echo "==> $name"
    printf '+'
    printf ' %q' "$@"
    printf '\n'
    [ "$DRY_RUN" -eq 0 ] || return 0
    local started=$SECONDS rc=0
    "$@" || rc=$?
    if [ $rc -ne 0 ]; then
        die "step '$name' failed (exit $rc): $hint"
    fi
    echo "    ($name: $((SECONDS - started)) s)"
}

py() {
    "$PY" "$@"
}

# ---------------------------------------------------------------------------------------------

YOLOV9=
DEV=0
OPENVINO_FLAG=0
PEERS=0
TENSORRT=0
TREX=0
DRY_RUN=0
PY=python3

while [ $# -gt 0 ]; do
    case $1 in
        -h | --help) usage; exit 0 ;;
        --yolov9)
            [ $# -ge 2 ] && [ -n "$2" ] || usage_error "--yolov9 needs a directory"
            YOLOV9=$2; shift ;;
        --yolov9=*) YOLOV9=${1#*=}; [ -n "$YOLOV9" ] || usage_error "--yolov9 needs a directory" ;;
        --python)
            [ $# -ge 2 ] && [ -n "$2" ] || usage_error "--python needs an interpreter"
            PY=$2; shift ;;
        --python=*) PY=${1#*=}; [ -n "$PY" ] || usage_error "--python needs an interpreter" ;;
        --dev) DEV=1 ;;
        --openvino) OPENVINO_FLAG=1 ;;
        --peers) PEERS=1; OPENVINO_FLAG=1 ;;
        --tensorrt) TENSORRT=1 ;;
        --trex) TREX=1 ;;
        --dry-run) DRY_RUN=1 ;;
        -*) usage_error "unknown option $1" ;;
        *) usage_error "unexpected argument '$1'" ;;
    esac
    shift
done

# Check everything that can be checked before installing anything.
command -v "$PY" >/dev/null 2>&1 || die "Python interpreter '$PY' not found (pass another with --python)."
py -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
    || die "$PY is Python $(py -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'); yolov9-qat needs Python >= 3.10."
py -m pip --version >/dev/null 2>&1 || die "pip is not available for $PY (install it with: $PY -m ensurepip --upgrade)."
[ -f "$HERE/requirements.txt" ] || die "$HERE/requirements.txt is missing (is this a complete yolov9-qat checkout?)."
[ "$DEV" -eq 0 ] || [ -f "$HERE/requirements-dev.txt" ] \
    || die "$HERE/requirements-dev.txt is missing (is this a complete yolov9-qat checkout?)."
if [ -n "$YOLOV9" ]; then
    [ -e "$YOLOV9" ] || die "--yolov9 $YOLOV9 does not exist: pass the path of a YOLOv9 clone."
    [ -d "$YOLOV9" ] || die "--yolov9 $YOLOV9 is not a directory: pass the path of a YOLOv9 clone."
    [ -f "$YOLOV9/requirements.txt" ] || die "--yolov9 $YOLOV9 has no requirements.txt: pass the path of a YOLOv9 clone."
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# torch as installed: "VERSION CUDA" (CUDA is "cpu" for a CPU build), or nothing.
torch_info=$(py -c '
try:
    import torch
except Exception:
    pass
else:
    print(torch.__version__, getattr(torch.version, "cuda", None) or "cpu")
' 2>/dev/null | tail -n 1) || torch_info=
torch_version=${torch_info%% *}
torch_cuda=${torch_info##* }

# Pin what is installed of torch and torchvision (their distribution versions, which pip
# compares: torch.__version__ may carry a local label such as +cu130 that the metadata lacks),
# so that no pip command here changes them.
constraints=$tmp/constraints.txt
py - "$constraints" 2>/dev/null <<'EOF' || true
import re
import sys
from importlib import metadata
lines = []
for name in ("torch", "torchvision"):
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        continue
    if re.fullmatch(r"[0-9][0-9A-Za-z.!+_-]*", version):
        lines.append(f"{name}=={version}")
with open(sys.argv[1], "w") as f:
    f.write("".join(line + "\n" for line in lines))
EOF
pip_install=("$PY" -m pip install)
if [ -s "$constraints" ]; then
    pip_install+=(-c "$constraints")
    echo "keeping $(paste -sd ' ' "$constraints" | sed 's/ /, /g') as installed (pip may not change them)"
elif [ -z "$torch_version" ]; then
    echo "note: torch is not installed: pip will install the default PyTorch build; install the build for your CUDA first (https://pytorch.org/get-started) if you need another one"
fi

# ---------------------------------------------------------------------------------------------
# 1. Python packages: the toolkit's requirements (and YOLOv9's), resolved together.

requirement_args=(-r "$HERE/requirements.txt")
name="toolkit requirements"
if [ -n "$YOLOV9" ]; then
    filtered=$tmp/yolov9-requirements.txt
    : >"$filtered"
    dropped=()
    while IFS= read -r line || [ -n "$line" ]; do
        req=${line%%#*}
        pkg=
        if [[ $req =~ ^[[:space:]]*([A-Za-z0-9][A-Za-z0-9._-]*) ]]; then
            pkg=${BASH_REMATCH[1],,}
            pkg=${pkg//[._]/-}
        fi
        case $pkg in
            torch | torchvision | torchaudio)
                if [ -n "$torch_version" ]; then
                    dropped+=("${req//[[:space:]]/} (torch $torch_version is installed and is kept)")
                    continue
                fi
                ;;
            opencv-python)
                dropped+=("${req//[[:space:]]/} (opencv-python-headless provides cv2)")
                continue
                ;;
        esac
        printf '%s\n' "$line" >>"$filtered"
    done <"$YOLOV9/requirements.txt"
    for d in "${dropped[@]}"; do
        echo "leaving out of $YOLOV9/requirements.txt: $d"
    done
    if [ "$DRY_RUN" -eq 1 ]; then
        echo "would install from $YOLOV9/requirements.txt: $(sed -e 's/#.*//' -e 's/[[:space:]]//g' -e '/^$/d' "$filtered" | paste -sd ' ' | sed 's/ /, /g')"
    fi
    requirement_args+=(-r "$filtered")
    name="toolkit and YOLOv9 requirements"
fi
if [ "$DEV" -eq 1 ]; then
    requirement_args+=(-r "$HERE/requirements-dev.txt")
    name="$name and test tools"
fi
step "$name" "pip could not install them (see its output above); if it reports a conflict with torch, install a torch that satisfies it first, this script never changes torch." \
    "${pip_install[@]}" "${requirement_args[@]}"

if [ "$DEV" -eq 1 ]; then
    step "$TRT_STUBS (--no-deps)" "pip could not install $TRT_STUBS; only the TensorRT type check (tests/test_typecheck.py) needs it." \
        "${pip_install[@]}" --no-deps "$TRT_STUBS"
fi

# ---------------------------------------------------------------------------------------------
# 2. OpenVINO (only when asked; --dev has it in requirements-dev.txt).

openvino_version() {
    py -c 'import openvino; print(openvino.get_version().split("-")[0])' 2>/dev/null | tail -n 1
}

if [ "$OPENVINO_FLAG" -eq 1 ]; then
    if ov=$(openvino_version) && [ -n "$ov" ]; then
        echo "==> OpenVINO"
        echo "OpenVINO $ov is already installed (import openvino works): not installing another."
    else
        step "OpenVINO ($OPENVINO)" \
            "pip could not install $OPENVINO from PyPI (see its output above); without it, score the graphs with val_trt.py --backend onnxruntime." \
            "${pip_install[@]}" "$OPENVINO"
    fi
fi

# The peers' NNCF (only when asked; --dev has it in requirements-dev.txt).
if [ "$PEERS" -eq 1 ]; then
    if nncf=$(py -c 'import nncf; print(nncf.__version__)' 2>/dev/null | tail -n 1) && [ -n "$nncf" ]; then
        echo "==> NNCF"
        echo "NNCF $nncf is already installed (import nncf works): not installing another."
    else
        step "NNCF ($NNCF)" \
            "pip could not install $NNCF from PyPI (see its output above); without it, run benchmarks/peers.py with --peers modelopt-max modelopt-entropy." \
            "${pip_install[@]}" "$NNCF"
    fi
fi

# ---------------------------------------------------------------------------------------------
# 3. TensorRT (only when asked).

tensorrt_version() {
    py -c 'import tensorrt; print(tensorrt.__version__)' 2>/dev/null | tail -n 1
}

if [ "$TENSORRT" -eq 1 ]; then
    if trt=$(tensorrt_version) && [ -n "$trt" ]; then
        echo "==> TensorRT"
        echo "TensorRT $trt is already installed (import tensorrt works): not installing another."
    else
        [ -n "$torch_version" ] || die "--tensorrt picks the TensorRT build matching torch's CUDA, but torch is not installed: install a CUDA build of torch first."
        [ "$torch_cuda" != cpu ] || die "--tensorrt picks the TensorRT build matching torch's CUDA, but torch $torch_version is a CPU build (torch.version.cuda is None): install a CUDA build of torch, or TensorRT by hand."
        package=tensorrt-cu${torch_cuda%%.*}
        step "TensorRT ($package, for torch's CUDA $torch_cuda)" \
            "pip could not install $package: the NVIDIA package host ($NVIDIA_INDEX) could not be reached or has no wheel for this platform; install TensorRT another way: run in an NGC container (nvcr.io/nvidia/pytorch or nvcr.io/nvidia/tensorrt ship it) or download the TensorRT tarball from https://developer.nvidia.com/tensorrt and pip install the tensorrt-*.whl in its python/ folder." \
            "${pip_install[@]}" --extra-index-url "$NVIDIA_INDEX" "$package"
    fi
fi

# ---------------------------------------------------------------------------------------------
# 4. TensorRT Engine Explorer (only when asked).

if [ "$TREX" -eq 1 ]; then
    if py -c 'import trex' >/dev/null 2>&1; then
        echo "==> TensorRT Engine Explorer"
        echo "TensorRT Engine Explorer (trex) is already installed."
    else
        step "TensorRT Engine Explorer (trex)" \
            "pip could not install it from github.com/NVIDIA/TensorRT (no access to GitHub, or git is missing); it is optional, engine graphs are skipped without it; install it later with: $PY -m pip install '$TREX_URL'." \
            "${pip_install[@]}" "$TREX_URL"
    fi
fi

# ---------------------------------------------------------------------------------------------
# Report

if [ "$DRY_RUN" -eq 1 ]; then
    echo "dry run: nothing was installed."
fi
if [ -n "$torch_version" ]; then
    echo "torch: $torch_version (CUDA: $torch_cuda)"
fi
if ov=$(openvino_version) && [ -n "$ov" ]; then
    echo "OpenVINO: $ov (import openvino)"
else
    echo "OpenVINO: not installed (needed only to run the ONNX on CPUs with INT8 kernels: rerun with --openvino)"
fi
if trt=$(tensorrt_version) && [ -n "$trt" ]; then
    echo "TensorRT: $trt (import tensorrt)"
else
    echo "TensorRT: not installed (needed only to build and run engines: rerun with --tensorrt, or use an NGC container)"
fi
