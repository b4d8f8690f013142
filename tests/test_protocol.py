"""One evaluation protocol: a score does not depend on --batch-size (utils/qat/evaluation/data.py RECT_GROUP).

The embedded model is scored on shapes images cropped to many aspect ratios, so that upstream's rectangular batches
give images other letterbox shapes at batch 8 than at batch 32; ``qat.py eval`` and ``val_trt.py`` (ONNX Runtime,
dynamic graph) must give the same AP at batch 8, 16 and 32.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import cv2
import numpy as np
import pytest

from conftest import REPO, run_main

BATCHES = (8, 16, 32)
IMGSZ = 256


@pytest.fixture(scope="module")
def ragged(tmp_path_factory):
    """40 shapes val images, image i cropped to a width of 256 - 24 * (i % 7) pixels (labels cut to match)."""
    root = tmp_path_factory.mktemp("ragged")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_shapes_dataset.py"), "--out", str(root / "src"),
                    "--train", "4", "--val", "40", "--imgsz", str(IMGSZ)], check=True, capture_output=True)
    src_images = sorted((root / "src" / "images" / "val").iterdir())
    (root / "images" / "val").mkdir(parents=True)
    (root / "labels" / "val").mkdir(parents=True)
    for i, image_path in enumerate(src_images):
        image = cv2.imread(str(image_path))
        width = IMGSZ - 24 * (i % 7)
        cv2.imwrite(str(root / "images" / "val" / image_path.name), image[:, :width])
        lines = []
        label = root / "src" / "labels" / "val" / f"{image_path.stem}.txt"
        for row in np.loadtxt(label, ndmin=2):
            cls, x, y, w, h = row
            x0, x1 = max(0.0, (x - w / 2) * IMGSZ), min(float(width), (x + w / 2) * IMGSZ)
            if x1 - x0 > 4:  # keep the part of a shape that is still in the image
                lines.append(f"{int(cls)} {(x0 + x1) / 2 / width:.6f} {y:.6f} {(x1 - x0) / width:.6f} {h:.6f}")
        (root / "labels" / "val" / f"{image_path.stem}.txt").write_text("\n".join(lines) + "\n")
    names = (root / "src" / "shapes.yaml").read_text().split("names:", 1)[1]
    yaml = root / "ragged.yaml"
    yaml.write_text(f"path: {root}\ntrain: images/val\nval: images/val\nnames:{names}")
    return yaml


def test_upstream_shapes_follow_the_batch_ours_do_not(yolov9_tree, ragged):
    """The images really do get other letterboxes in upstream's batches of 8 and of 32 (so the scores below could
    differ), and in ours the same."""
    from utils.qat.evaluation.data import RECT_GROUP, dataloader, load_data_yaml
    data = load_data_yaml(ragged)

    def shapes(batch_size, group):
        loader, _ = dataloader(data, "val", IMGSZ, batch_size, 32, workers=0, group=group)
        return [tuple(im.shape[2:]) for im, *_ in loader for _ in range(len(im))]

    assert shapes(8, None) != shapes(32, None)
    assert shapes(8, RECT_GROUP) == shapes(16, RECT_GROUP) == shapes(32, RECT_GROUP) == shapes(32, None)


@pytest.mark.slow
def test_a_score_does_not_depend_on_the_batch_size(yolov9_tree, ragged, tmp_path):
    weights = tmp_path / "gelan-qs-shapes.pt"
    shutil.copy(REPO / "weights" / weights.name, weights)  # the export is written beside it
    scores = {}
    for b in BATCHES:
        out = run_main(yolov9_tree, "qat.py", "eval", "--weights", str(weights), "--allow-fp", "--data", str(ragged),
                       "--imgsz", str(IMGSZ), "--batch-size", str(b), "--device", "cpu", "--workers", "0",
                       "--project", str(tmp_path), "--name", f"eval{b}")
        scores[f"checkpoint {b}"] = json.loads((out / "results.json").read_text())["AP"]
    run_main(yolov9_tree, "export_qat.py", "--weights", str(weights), "--include", "onnx", "--dynamic",
             "--imgsz", str(IMGSZ), "--device", "cpu")
    for b in BATCHES:
        run_main(yolov9_tree, "val_trt.py", "--onnx", str(weights.with_suffix(".onnx")), "--backend", "onnxruntime",
                 "--data", str(ragged), "--imgsz", str(IMGSZ), "--batch-size", str(b), "--workers", "0",
                 "--project", str(tmp_path), "--name", f"ort{b}")
        scores[f"graph {b}"] = json.loads((tmp_path / f"ort{b}" / "results.json").read_text())["AP"]
    assert len({v for k, v in scores.items() if k.startswith("checkpoint")}) == 1, scores
    assert len({v for k, v in scores.items() if k.startswith("graph")}) == 1, scores
    assert 0.5 < scores["checkpoint 8"] <= 1, scores
