"""utils/qat/core/yolov9.py: what every YOLOv9 head returns, reduced to its main branch in one place; the head families.

The forwards are written out as upstream models/yolo.py returns them (shapes made small), so every family is
covered without building a model; tests/test_reparam.py and tests/test_export.py run the real heads.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 -m pytest` from the repository root has it already
    sys.path.append(str(REPO))

from utils.qat.core import yolov9  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402

B, NC, NM, A = 2, 3, 4, 5
AUX, MAIN, PROTOS = torch.zeros(B, 4 + NC, A), torch.ones(B, 4 + NC, A), torch.full((B, NM, 8, 8), 2.0)
LEVELS = [torch.zeros(B, 1, 2, 2)] * 3
SEG_MAIN = torch.ones(B, 4 + NC + NM, A)


@pytest.mark.parametrize("raw", [
    MAIN,  # Detect / DDetect / TripleDDetect in export mode
    (MAIN, LEVELS),  # Detect / DDetect eval: (pred, levels); TripleDDetect eval: (pred_main, levels)
    [AUX, MAIN],  # DualDDetect export: the branches
    ([AUX, MAIN], [LEVELS, LEVELS]),  # DualDDetect eval
    ([AUX, AUX, MAIN], [LEVELS] * 3),  # TripleDetect eval
], ids=["export", "eval", "dual-export", "dual-eval", "triple-eval"])
def test_detect_outputs_are_the_main_branch(raw):
    (pred,) = yolov9.outputs(raw, "detect")
    assert pred is MAIN


@pytest.mark.parametrize("raw", [
    (SEG_MAIN, PROTOS),  # Segment / DSegment export
    (SEG_MAIN, (LEVELS, torch.zeros(B, NM, A), PROTOS)),  # Segment / DSegment eval
    (SEG_MAIN, (LEVELS, torch.zeros(B, NM, A), PROTOS, torch.zeros(B, 1, 8, 8))),  # Panoptic eval (+ semantic)
], ids=["export", "eval", "panoptic-eval"])
def test_segment_outputs_are_pred_and_protos(raw):
    pred, protos = yolov9.outputs(raw, "segment")
    assert pred is SEG_MAIN and protos is PROTOS
    (boxes,) = yolov9.outputs(raw, "detect")  # a segmentation model read as a detector: its pred (with coefficients)
    assert boxes is SEG_MAIN


def test_exported_outputs_by_rank_in_any_order():
    assert yolov9.exported_outputs([PROTOS, SEG_MAIN], "segment") == (SEG_MAIN, PROTOS)
    assert yolov9.exported_outputs([MAIN], "detect") == (MAIN,)


class _Model(nn.Module):
    def __init__(self, head: nn.Module):
        super().__init__()
        self.model = nn.Sequential(nn.Identity(), head)


def _head(name: str) -> nn.Module:
    return type(name, (nn.Module,), {})()


@pytest.mark.parametrize("name,family,dual", [
    ("DDetect", "detect", False), ("DualDDetect", "dual detect", True), ("TripleDetect", "dual detect", True),
    ("DSegment", "segment", False), ("DualDSegment", "dual segment", True), ("Classify", None, False),
])
def test_families_from_the_head_class_name(name, family, dual):
    model = _Model(_head(name))
    assert (yolov9.head_name(model), yolov9.family(model), yolov9.is_dual(model)) == (name, family, dual)


def test_task_of_model():
    assert yolov9.task_of_model(_Model(_head("DualDSegment"))) == "segment"  # no known model class: the head says
    assert yolov9.task_of_model(_Model(_head("Classify"))) == "unknown"
    assert yolov9.head(nn.Linear(1, 1)) is None and yolov9.head_name(nn.Linear(1, 1)) == ""


def test_stride_of_a_model_and_of_an_artifact():
    model = _Model(_head("DDetect"))
    with pytest.raises(QATError, match="has no stride"):
        yolov9.model_stride(model)
    model.stride = torch.tensor([8.0, 16.0, 32.0])
    assert yolov9.model_stride(model) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert yolov9.artifact_stride(64, "m.onnx", "its metadata") == 64
    with pytest.warns(UserWarning, match=r"m\.onnx's metadata is missing or has no usable stride \(a power of two "
                                         r"up to 128\); assuming 32"):
        assert yolov9.artifact_stride(None, "m.onnx", "m.onnx's metadata") == 32
