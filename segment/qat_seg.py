"""Quantization-aware training for YOLOv9 segmentation models (INT8, TensorRT-ready): box and mask mAP.

    python3 segment/qat_seg.py quantize  --weights gelan-c-seg.pt --data data/coco.yaml
    python3 segment/qat_seg.py sensitive --weights gelan-c-seg.pt --data data/coco.yaml --num-image 1000
    python3 segment/qat_seg.py eval      --weights runs/qat_seg/exp/weights/qat_best_gelan-c-seg.pt --data data/coco.yaml

The same commands, flags and outputs as qat.py; the dataset needs polygon labels. Reports show Box and
Mask P, R, mAP50 and mAP50-95; the mask mAP50-95 names the checkpoints and picks the best QAT epoch.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the YOLOv9 root
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import qat  # noqa: E402  (applies the compatibility layer on import)
from utils.qat.core.errors import run_cli  # noqa: E402


def get_args_parser():
    return qat.get_args_parser(task="segment", prog="segment/qat_seg.py", description=__doc__)


if __name__ == "__main__":
    run_cli(lambda: qat.main(get_args_parser().parse_args()))
