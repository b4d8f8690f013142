"""utils/qat/core/artifact.py: the metadata an exported model carries, read the same way from every writer."""
from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 -m pytest` from the repository root has it already
    sys.path.append(str(REPO))

from utils.qat.core.artifact import (ArtifactMeta, is_end2end, parse_names, parse_stride, read_props,  # noqa: E402
                                task_from_outputs, write_props)


@pytest.mark.parametrize("text", [
    '{"0": "person", "1": "bicycle"}',  # this toolkit's export (JSON)
    "{0: 'person', 1: 'bicycle'}",  # upstream YOLOv9's export.py: str(model.names) of a dict
    "['person', 'bicycle']",  # ... of a list
    '["person", "bicycle"]',
])
def test_names_from_json_or_python_literal(text):
    assert parse_names(text) == {0: "person", 1: "bicycle"}


@pytest.mark.parametrize("text", [None, "", "person", "{0: person}", "__import__('os').getcwd()", "42", "{'a': 'b'}"])
def test_unreadable_names_are_absent_and_never_run(text):
    assert parse_names(text) is None


def test_stride():
    assert parse_stride("32") == parse_stride("32.0") == parse_stride(32) == parse_stride("[8, 16, 32]") == 32
    assert parse_stride(None) is None and parse_stride("tensor([32.])") is None and parse_stride("0") is None


def test_task_from_outputs_without_metadata():
    """What a graph or engine serves when its metadata does not say: prototypes (rank 4) or det_masks mean
    segmentation, whatever the output names."""
    assert task_from_outputs(["output0"], [3]) == "detect"
    assert task_from_outputs(["output0", "output1"], [3, 4]) == "segment"
    assert task_from_outputs(["preds", "protos"], [3, 4]) == "segment"  # renamed outputs: the rank says it
    e2e = ["num_dets", "det_boxes", "det_scores", "det_classes"]
    assert task_from_outputs(e2e, [2, 3, 2, 2]) == "detect"
    assert task_from_outputs(e2e + ["det_masks"], [2, 3, 2, 2, 3]) == "segment"


def test_onnx_props_and_engine_sidecar_round_trip():
    meta = ArtifactMeta(stride=32, names={0: "person", 1: "car"}, task="segment", imgsz=[640, 480])
    model = onnx.ModelProto()
    write_props(model, {**meta.props(), "quantized": "true"})
    props = read_props(model)
    assert props["names"] == '{"0": "person", "1": "car"}' and props["stride"] == "32" and props["quantized"] == "true"
    assert ArtifactMeta.read(props) == meta
    assert ArtifactMeta.read(meta.sidecar()) == meta
    assert ArtifactMeta.read({}) == ArtifactMeta()


def test_end2end_outputs():
    assert is_end2end(["num_dets", "det_boxes", "det_scores", "det_classes", "det_masks"])
    assert not is_end2end(["num_dets", "output0"])
