"""The COCO-trained YOLOv9-t (../shared/weights/yolov9-t-coco.pt) end to end at 224 px, as users run it: qat.py
quantize (the default calibration and head search on one batch, one QAT epoch of two steps), export_qat.py, then
val_trt.py on ONNX Runtime, on 8 real COCO training photos and 16 validation photos.

A real model on real photos: the scores must be those of a detector (a random or broken one scores about 0), INT8
must stay near the FP model, and ONNX Runtime running the exported INT8 graph must score what PyTorch scores for
the same checkpoint. The model is built of ELAN1 blocks (gelan-t's), which the faithful stand-in lacks: CI runs
this file against the yolo9 stand-in (``-m models``).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import ELSEWHERE, SHARED, coco_data, run_tool, tree_has

pytestmark = [pytest.mark.models, pytest.mark.slow, pytest.mark.e2e]

WEIGHTS = SHARED / "weights" / "yolov9-t-coco.pt"
IMGSZ = "224"


@pytest.fixture(scope="module")
def data(tmp_path_factory, shared, coco_names) -> Path:
    """8 coco369 training photos (calibration and QAT), 16 coco334 validation photos (every score)."""
    return coco_data(tmp_path_factory.mktemp("real-data"), shared, coco_names, 8, 16)


@pytest.fixture(scope="module")
def quantized(yolov9_tree, data, tmp_path_factory) -> tuple[Path, dict]:
    """qat.py quantize on the real model, run once: (its run folder, report.json)."""
    if not tree_has(yolov9_tree, "ELAN1"):
        pytest.skip(f"{WEIGHTS.name} is built of ELAN1 blocks (upstream models/common.py), which this YOLOv9 tree "
                    f"lacks; {ELSEWHERE}")
    project = tmp_path_factory.mktemp("real-runs")
    r = run_tool(yolov9_tree, "qat.py", "quantize", "--weights", str(WEIGHTS), "--data", str(data),
                 "--device", "cpu", "--imgsz", IMGSZ, "--batch-size", "4", "--calib-batches", "1",
                 "--epochs", "1", "--iters", "2", "--workers", "0", "--project", str(project), "--name", "t",
                 "--exist-ok")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return project / "t", json.loads((project / "t" / "report.json").read_text())


def _score(m: dict) -> tuple[float, float]:
    ap, ap50 = m["AP"], m["AP50"]
    assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in (ap, ap50)), m
    assert 0 <= ap <= ap50 <= 1, m
    return ap, ap50


def test_quantize_keeps_the_real_models_accuracy(quantized):
    """Origin scores like a COCO-trained detector (0.36 AP on these 16 photos at 224 px when written); PTQ and QAT
    stay within 0.1 AP of it (-0.03 and -0.02 when written)."""
    run, report = quantized
    models = {m["name"]: m for m in report["models"]}
    assert list(models) == ["Origin", "PTQ", "QAT"]
    assert all(m["images"] == 16 for m in models.values())
    origin, ptq, qat = (_score(models[name]) for name in ("Origin", "PTQ", "QAT"))
    print(f"yolov9-t-coco at {IMGSZ} px, AP / AP50: Origin {origin}, PTQ {ptq}, QAT {qat}")
    assert origin[0] > 0.2 and origin[1] > 0.3
    assert abs(ptq[0] - origin[0]) < 0.1 and abs(qat[0] - origin[0]) < 0.1
    assert models["Origin"]["weights"] == str(WEIGHTS)
    assert Path(models["QAT"]["weights"]) == run / "weights" / "qat_best_yolov9-t-coco.pt"


def test_onnxruntime_scores_the_int8_export_like_pytorch(yolov9_tree, quantized, data):
    """export_qat.py writes a clean INT8 graph of the QAT checkpoint; val_trt.py on ONNX Runtime scores it within
    0.03 AP / AP50 of the PyTorch evaluation of that checkpoint in report.json (0.011 / 0.014 when written:
    ONNX Runtime's integer convolutions round unlike fake quantization)."""
    run, report = quantized
    best = run / "weights" / "qat_best_yolov9-t-coco.pt"
    r = run_tool(yolov9_tree, "export_qat.py", "--weights", str(best), "--include", "onnx", "--dynamic",
                 "--simplify", "--imgsz", IMGSZ)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Q/DQ lint: clean" in r.stdout, r.stdout
    onnx_path = best.with_suffix(".onnx")
    r = run_tool(yolov9_tree, "val_trt.py", "--onnx", str(onnx_path), "--backend", "onnxruntime", "--data", str(data),
                 "--imgsz", IMGSZ, "--batch-size", "4", "--workers", "0", "--project", str(run), "--name", "ort",
                 "--exist-ok")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads((run / "ort" / "results.json").read_text())
    assert got["backend"] == "ONNX Runtime" and got["images"] == 16
    ort_ap, ort_ap50 = _score(got)
    qat_ap, qat_ap50 = _score(next(m for m in report["models"] if m["name"] == "QAT"))
    print(f"INT8 AP / AP50: PyTorch (fake quant) {qat_ap:.4f} / {qat_ap50:.4f}, ONNX Runtime {ort_ap:.4f} / "
          f"{ort_ap50:.4f}")
    assert abs(ort_ap - qat_ap) < 0.03 and abs(ort_ap50 - qat_ap50) < 0.03
