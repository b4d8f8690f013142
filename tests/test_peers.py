"""benchmarks/peers.py: the quantizers users would pick instead (NVIDIA ModelOpt's ONNX PTQ, OpenVINO NNCF) run
beside this toolkit's from one FP checkpoint and scored by the one evaluator, each difference from FP with its
interval. Real code end to end on the embedded model; nothing is mocked."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QS = REPO / "weights" / "gelan-qs-shapes.pt"
PTQ_ARGS = "--device cpu --batch-size 8 --calib-batches 1 --calib-method max --head-amax calibrated --workers 0 --hyp none"


def _peers(tree: Path, *argv: str) -> dict:
    """benchmarks/peers.py's main in this process, from the top of the tree (as it is run)."""
    spec = importlib.util.spec_from_file_location("peers", REPO / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    here = os.getcwd()
    os.chdir(tree)
    try:
        spec.loader.exec_module(module)
        return module.main(module.get_args_parser().parse_args([str(a) for a in argv]))
    finally:
        os.chdir(here)


def test_peers_side_by_side(yolov9_tree, shapes, tmp_path):
    """At 64 px on the shapes set: the FP graph, this toolkit's PTQ (qat.py quantize --ptq-only, exported), ModelOpt's
    ONNX PTQ (its command line) and NNCF's (IR and ONNX) from the same 16 images. Every ONNX graph is scored on ONNX
    Runtime with its interval against FP there; the IR is not (OpenVINO only), and OpenVINO scores the quantized graphs
    only where this CPU computes INT8 as written. The INT8 convolutions are counted through Concat/Split as the
    runtimes carry 8-bit data: each quantizes nearly all of them, this toolkit all but the DFL's."""
    from utils.qat.evaluation.openvino_probe import openvino_int8_exact
    out = tmp_path / "out"
    doc = _peers(yolov9_tree, "--weights", QS, "--data", shapes, "--peers", "modelopt-max", "nncf", "nncf-onnx",
                 "--ptq", "--ptq-args", PTQ_ARGS, "--backend", "onnxruntime", "openvino", "--imgsz", "64",
                 "--calib-images", "16", "--workers", "0", "--out", out, "--label", "qs")
    from parts import portable  # benchmarks/parts/, on the path once peers.py is loaded
    assert json.loads((out / "qs.json").read_text()) == json.loads(portable.text(json.dumps(doc), work=out))
    names = [r["name"] for r in doc["rows"]]
    assert names == ["FP", f"this toolkit, PTQ {PTQ_ARGS}", "NVIDIA ModelOpt ONNX PTQ, max",
                     "OpenVINO NNCF PTQ (IR), MIXED, as Ultralytics", "OpenVINO NNCF PTQ (ONNX), MIXED"]
    assert doc["calibration"]["images"] == 16 and doc["images"] == 16
    fp, ours, modelopt, ir, nncf_onnx = doc["rows"]
    assert 0.05 < fp["scores"]["onnxruntime"]["AP"] <= 1
    assert abs(fp["scores"]["openvino"]["AP"] - fp["scores"]["onnxruntime"]["AP"]) < 0.01  # FP: f32 on both
    exact = openvino_int8_exact()
    for row in (ours, modelopt, ir, nncf_onnx):
        assert row["quantize_s"] > 0
        quantized, convs = map(int, row["int8_convolutions"].split("/"))
        assert convs > 10 and quantized >= 0.9 * convs, row
        if row is ours:
            assert quantized == convs - 1  # every one but the DFL's
            assert 0 < row["calibration_s"] < row["quantize_s"]  # its run also scores FP and PTQ
        ort, ov = row["scores"]["onnxruntime"], row["scores"]["openvino"]
        if row is ir:
            assert ort == {"skipped": "an OpenVINO IR: OpenVINO only"}
        else:
            lo, hi = ort["vs_fp"]["interval"]
            assert 0 < ort["AP"] <= 1 and lo <= hi and ort["tie"] == (lo <= 0 <= hi)
            assert ort["vs_fp"]["AP"] == round(ort["AP"] - fp["scores"]["onnxruntime"]["AP"], 4) or \
                abs(ort["vs_fp"]["AP"] - (ort["AP"] - fp["scores"]["onnxruntime"]["AP"])) < 2e-4
            assert ort["vs_fp_shown"].startswith(f"{ort['vs_fp']['AP']:+.4f} [")
        if exact:
            assert 0 < ov["AP"] <= 1 and "vs_fp" in ov
        else:
            assert ov == {"skipped": "OpenVINO does not compute INT8 as written on this CPU"}
    assert abs(ours["scores"]["onnxruntime"]["AP"] - fp["scores"]["onnxruntime"]["AP"]) < 0.1
    # this toolkit against each peer scored on the same runtime, paired on the images
    on_ort = [v for v in doc["versus"] if v["runtime"] == "onnxruntime"]
    assert [v["peer"] for v in on_ort] == [modelopt["name"], nncf_onnx["name"]]
    for v, peer in zip(on_ort, (modelopt, nncf_onnx)):
        assert v["ours"] == ours["name"] and v["tie"] == (v["interval"][0] <= 0 <= v["interval"][1])
        want = ours["scores"]["onnxruntime"]["AP"] - peer["scores"]["onnxruntime"]["AP"]
        assert abs(v["AP"] - want) < 2e-4
    assert len(doc["versus"]) == (2 + 3 if exact else 2)
    assert doc["within"] == []  # one graph of ours
    # two settings of ours told apart the same way: the NNCF ONNX graph's stored statistics taken as a second graph
    # of ours give, against our first, the difference against that peer with its sign turned
    from utils.qat.evaluation.resample import load_images
    spec = importlib.util.spec_from_file_location("peers", REPO / "benchmarks" / "peers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    second = {**nncf_onnx, "name": "ours, another setting", "tool": "yolov9-qat"}
    kept = {(ours["name"], "onnxruntime"): load_images(out / "qs-work" / "1-onnxruntime.npz"),
            (second["name"], "onnxruntime"): load_images(out / "qs-work" / "4-onnxruntime.npz")}
    (told,) = module.within([fp, ours, second], kept)
    (against,) = [v for v in on_ort if v["peer"] == nncf_onnx["name"]]
    assert told["ours"] == second["name"] and told["first"] == ours["name"] and told["tie"] == against["tie"]
    assert abs(told["AP"] + against["AP"]) < 2e-4
    assert "| this toolkit | against | runtime | difference |" in module.render({**doc, "within": [told]})
    assert len(list((out / "qs-work").glob("*-onnxruntime.npz"))) == 4  # FP, ours, ModelOpt, NNCF's ONNX
    md = (out / "qs.md").read_text()
    assert "| quantizer | runtime | mAP50-95 | mAP50 | vs FP | INT8 convolutions | quantize s |" in md
    assert md.count("\n| NVIDIA ModelOpt ONNX PTQ, max |") == 2 and "paired-bootstrap interval" in md
    assert "| this toolkit | peer | runtime | difference |" in md
    assert (out / "qs.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "qs-work" / "nncf.xml").is_file() and (out / "qs-work" / "nncf.bin").is_file()


@pytest.mark.parametrize("argv, says", [
    (["--ours", "no-equals-sign"], "--ours no-equals-sign is not NAME=GRAPH"),
    (["--ours", "x=missing.onnx"], "--ours x: missing.onnx not found"),
    (["--weights", "missing.pt"], "--weights missing.pt not found"),
])
def test_peers_refuses_in_one_sentence(yolov9_tree, shapes, tmp_path, argv, says):
    from utils.qat.core.errors import QATError
    base = {"--weights": str(QS), "--data": str(shapes), "--out": str(tmp_path / "out")}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    with pytest.raises(QATError, match=says.replace(".", r"\.")):
        _peers(yolov9_tree, *[x for kv in base.items() for x in kv], "--peers")
    assert not (tmp_path / "out").exists()
