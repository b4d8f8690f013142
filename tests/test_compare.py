"""scripts/compare_trt.sh / utils.qat.trt.compare: TensorRT against ONNX Runtime with Polygraphy.

TensorRT cannot run here, so the TensorRT side is tested through the command line it builds. Everything
else runs for real with Polygraphy: the ONNX Runtime reference run (``polygraphy run --onnxrt
--save-outputs``) on the embedded model and real shapes images, and the comparison itself, with
``--onnxrt`` standing in for ``--trt`` in the second command (same data loader, tolerances,
``--load-outputs``/``--save-outputs`` and verdict): the FP16+INT8 graph (a legitimate difference) must
MATCH the FP32+INT8 one, a graph fed images a tenth as bright must not.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import REPO

pytest.importorskip("onnxruntime")
polygraphy_missing = pytest.mark.skipif(
    subprocess.run(["which", "polygraphy"], capture_output=True).returncode != 0
    and not (Path(sys.executable).with_name("polygraphy")).is_file(),
    reason="polygraphy is not installed (pip install polygraphy; ./install_dependencies.sh installs it)")

WEIGHTS = REPO / "weights" / "gelan-qs-shapes.pt"


def _compare(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO / "scripts" / "compare_trt.sh"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module")
def graphs(yolov9_tree, tmp_path_factory):
    """The embedded model quantized (PTQ max, 2 batches of noise-free shapes) and exported FP32+INT8 and
    FP16+INT8 (--half, AutoCast), dynamic, 256 px; plus a broken copy of the FP32 graph (input a tenth as bright)."""
    import torch

    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.model import checkpoint
    from utils.qat.onnx.onnx_export import export_onnx
    out = tmp_path_factory.mktemp("compare")
    fp = checkpoint.load_fp(WEIGHTS)
    g = torch.Generator().manual_seed(0)
    calib = [torch.rand(4, 3, 256, 256, generator=g) for _ in range(2)]
    qmodel, info = quantize(fp, calib, QuantConfig(method="max", head_amax="calibrated"), example=calib[0][:1])
    qmodel.names = fp.names
    paths = {}
    for name, half in (("fp32", False), ("fp16", True)):
        paths[name] = out / f"qs-{name}.onnx"
        export_onnx(qmodel, paths[name], imgsz=256, dynamic=True, half=half)
    m = onnx.load(str(paths["fp32"]))
    first = [n for n in m.graph.node if "images" in n.input]
    m.graph.node.insert(0, helper.make_node("Mul", ["images", "dim_const"], ["images_dimmed"], name="/broken/Mul"))
    m.graph.initializer.append(helper.make_tensor("dim_const", TensorProto.FLOAT, [], [0.1]))
    for n in first:
        n.input[:] = ["images_dimmed" if i == "images" else i for i in n.input]
    paths["broken"] = out / "qs-broken.onnx"
    onnx.save(m, str(paths["broken"]))
    return paths


def test_commands_per_tensorrt_version(tmp_path):
    from utils.qat.trt.compare import commands
    onnx_path, work = tmp_path / "m.onnx", tmp_path / "w"
    ref, trt10 = commands(onnx_path, work, outputs=["output0"], trt_version="10.3")
    assert ref == ["polygraphy", "run", str(onnx_path), "--onnxrt", "--data-loader-script",
                   f"{work / 'data_loader.py'}:load_data", "--save-outputs", str(work / "onnxrt.json")]
    assert trt10[:5] == ["polygraphy", "run", str(onnx_path), "--trt", "--fp16"] and "--int8" in trt10
    assert trt10[trt10.index("--load-outputs") + 1] == str(work / "onnxrt.json")
    tol = trt10[trt10.index("--check-error-stat"):]
    assert tol == ["--check-error-stat", "quantile", "--error-quantile", "0.99", "--atol", "output0:15.0",
                   "--rtol", "1e-5"]
    _, strong = commands(onnx_path, work, outputs=["output0"], trt_version="10.13", strongly_typed=True)
    assert "--strongly-typed" in strong and "--fp16" not in strong
    _, trt11 = commands(onnx_path, work, outputs=["output0", "output1"], trt_version="11.1", plugins=["lib.so"])
    assert not {"--fp16", "--int8", "--strongly-typed"} & set(trt11)  # strongly typed only; precisions from the ONNX
    assert trt11[trt11.index("--plugins") + 1] == "lib.so" and "output1:1.0" in trt11
    _, eng = commands(onnx_path, work, outputs=["output0"], engine=tmp_path / "m.engine")
    assert eng[:6] == ["polygraphy", "run", str(tmp_path / "m.engine"), "--model-type", "engine", "--trt"]
    assert commands(onnx_path, work, outputs=["output0"])[1] is None  # no TensorRT version: reference only


@pytest.mark.slow
def test_dry_run_and_clear_refusals(tmp_path, graphs, shapes):
    images = shapes.parent / "images" / "val"
    r = _compare(str(graphs["fp32"]), "--images", str(images), "--imgsz", "256", "--batch", "2", "--dry-run",
                 "--trt-version", "11.1", "--work", str(tmp_path / "w"))
    assert r.returncode == 0, r.stderr
    ref, trt = (shlex.split(line) for line in r.stdout.strip().splitlines())
    assert "--onnxrt" in ref and "--trt" in trt and "--fp16" not in trt
    assert np.load(tmp_path / "w" / "inputs.npy").shape == (2, 3, 256, 256)
    assert "def load_data" in (tmp_path / "w" / "data_loader.py").read_text()
    e2e = tmp_path / "e2e.onnx"
    g = helper.make_graph([helper.make_node("Identity", ["images"], ["num_dets"])], "g",
                          [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])],
                          [helper.make_tensor_value_info("num_dets", TensorProto.FLOAT, [1, 3, 64, 64])])
    onnx.save(helper.make_model(g), str(e2e))
    for args, message in (
            ((str(tmp_path / "none.onnx"),), "ONNX file"),
            ((str(e2e),), "End2End graph"),
            ((str(graphs["fp32"]), "--images", str(images), "--batch", "100"), "needs 100"),
            ((str(graphs["fp32"]), "--engine", str(tmp_path / "none.engine")), "engine file"),
            ((str(graphs["fp32"]), "--plugins", str(tmp_path / "none.so")), "plugin library"),
    ):
        r = _compare(*args, "--work", str(tmp_path / "w2"))
        assert r.returncode == 2 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1


@polygraphy_missing
def test_onnx_runtime_side_and_verdicts(tmp_path, graphs, shapes):
    """The reference run for real, then the TensorRT command with --onnxrt in place of --trt (TensorRT cannot run
    here): the FP16+INT8 graph matches, the graph fed images a tenth as bright does not."""
    from utils.qat.trt.compare import commands, report
    images = shapes.parent / "images" / "val"
    work = tmp_path / "w"
    r = _compare(str(graphs["fp32"]), "--images", str(images), "--imgsz", "256", "--batch", "4", "--reference-only",
                 "--work", str(work))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASSED" in r.stdout and (work / "onnxrt.json").is_file() and (work / "onnxrt.log").is_file()
    verdicts = {}
    for name in ("fp16", "broken"):
        _, cmd = commands(graphs[name], work, outputs=["output0"], trt_version="11.1")
        cmd = [c if c != "--trt" else "--onnxrt" for c in cmd]
        cmd[0] = str(Path(sys.executable).with_name("polygraphy")) if Path(sys.executable).with_name(
            "polygraphy").is_file() else "polygraphy"
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        ok, line = report(work, ["output0"], run.returncode == 0)
        verdicts[name] = (ok, line, json.loads((work / "verdict.json").read_text()))
    ok, line, doc = verdicts["fp16"]
    assert ok and line.startswith("verdict: MATCH: Polygraphy PASSED"), line
    assert doc["detections"]["confident"] > 0 and doc["detections"]["same_class"] >= 0.98
    ok, line, doc = verdicts["broken"]
    assert not ok and line.startswith("verdict: MISMATCH"), line
