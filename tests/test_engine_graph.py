"""utils/qat/trt/engine_graph.py on layer-information fixtures (tests/data/trtexec/*.layer.json).

The fixtures are WRITTEN FROM THE DOCUMENTED FORMAT of ``trtexec --exportLayerInfo`` /
IEngineInspector with ``--profilingVerbosity=detailed`` (TensorRT 10 "Bindings", TensorRT 11
"I/O Tensors", its layer tensors with ``Format`` and ``DataType`` split as the 11.0 migration overview
announces), not captured from an engine: TensorRT cannot be installed here. The summary, the DOT text and
(where Graphviz's ``dot`` is installed) the SVG are produced for real; TREx is not installed here, so its
path is exercised against a stand-in ``trex`` package laid out as TREx 0.1.8+ is (``to_dot``,
``render_dot`` and ``layer_type_formatter`` in ``trex.graphing``, not at the top level).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 -m pytest` from the repository root has it already
    sys.path.append(str(REPO))

from utils.qat.trt import engine_graph as eg  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402

DATA = REPO / "tests" / "data" / "trtexec"
LAYERS10 = DATA / "yolov9_qat.engine.layer.json"
LAYERS11 = DATA / "yolov9_qat_trt11.engine.layer.json"
PROFILE = DATA / "yolov9_qat.engine.profile.json"


@pytest.mark.parametrize("fmt, dtype", [
    ("Thirty-two wide channel vectorized row major Int8 format.", "INT8"),
    ("Four wide channel vectorized row major Int8 format", "INT8"),
    ("Channel major FP16 format where channel % 8 == 0", "FP16"),
    ("Two wide channel vectorized row major FP16 format", "FP16"),
    ("Row major linear FP32", "FP32"),
    ("Row major linear FP32 format (kLINEAR)", "FP32"),
    ("Row major linear Int32", "INT32"),
    ("Row major linear BF16 format", "BF16"),
    ("Half", "FP16"),
    ("", "unknown"),
    (None, "unknown"),
])
def test_datatype(fmt, dtype):
    assert eg.datatype(fmt) == dtype


@pytest.mark.parametrize("path", [LAYERS10, LAYERS11])
def test_precision_summary(path):
    s = eg.precision_summary(eg.load_layer_info(path))
    assert s["detailed"] and s["layers"] == 13 and s["reformat_layers"] == 2
    assert s["by_output_dtype"] == {"INT8": 8, "FP16": 3, "FP32": 2}
    assert s["compute_layers"] == 10  # no reformats, no constants
    assert list(s["compute_by_output_dtype"].items()) == [("INT8", 7), ("FP16", 2), ("FP32", 1)]
    assert s["weights_by_dtype"] == {"INT8": 6, "FP16": 2}
    assert s["int8_share"] == pytest.approx(0.7)
    assert (s["inputs"], s["outputs"]) == (["images"], ["output0"])
    md = eg.summary_markdown(s)
    assert "| INT8 | 7 | 70.0% |" in md and "reformat layers: 2" in md and "INT8 6, FP16 2" in md


def test_dot_text():
    dot = eg.to_dot(eg.load_layer_info(LAYERS10), title="yolov9_qat.engine")
    assert dot.startswith('digraph "yolov9_qat.engine" {') and dot.rstrip().endswith("}")
    assert len(re.findall(r"^  L\d+ \[label=", dot, flags=re.M)) == 13
    assert 'in0 -> L0 [label="FP32 1x3x640x640"];' in dot
    assert 'L0 -> L1 [label="INT8 1x3x640x640"];' in dot
    assert "L12 -> out0;" in dot and "L8 -> L9" in dot and "L8 -> L10" in dot
    assert 'fillcolor="#76b900"' in dot and "dashed" in dot  # INT8 color, reformats dashed
    # quotes and backslashes in layer names are escaped
    doc = {"Layers": [{"Name": 'a "quoted" \\ name', "LayerType": "Myelin", "Inputs": [], "Outputs": []}]}
    assert r'a \"quoted\" \\ name' in eg.to_dot(doc)


def test_render_plain_graphviz(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trex", None)  # TREx not importable
    res = eg.render_graph(LAYERS10, tmp_path / "g.svg")
    assert "install with ./install_dependencies.sh --trex" in res.message
    assert res.dot == tmp_path / "g.dot" and res.dot.read_text().startswith("digraph")
    if shutil.which("dot"):
        assert res.renderer == "graphviz" and res.svg == tmp_path / "g.svg"
        svg = res.svg.read_text()
        assert "<svg" in svg and "CaskConvolution INT8" in svg and "output0" in svg
    else:
        assert res.renderer == "none" and res.svg is None
        assert f"dot -Tsvg {tmp_path / 'g.dot'} -o {tmp_path / 'g.svg'}" in res.message


def test_render_without_dot_binary_keeps_the_dot_file(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "trex", None)
    monkeypatch.setattr(eg.shutil, "which", lambda name: None)
    res = eg.render_graph(LAYERS11, tmp_path / "g.svg", use_trex=False)
    assert res.renderer == "none" and res.svg is None and res.dot is not None and res.dot.is_file()
    assert "Graphviz `dot` is not installed" in res.message and "apt-get install graphviz" in res.message


def _stand_in_trex(calls: list, fail: bool = False) -> tuple[types.ModuleType, types.ModuleType]:
    """``trex`` and ``trex.graphing`` as TREx 0.1.8-0.2.1 lay them out: EnginePlan at the top level (trex/__init__.py
    imports engine_plan), the graphing functions only in trex.graphing."""
    trex = types.ModuleType("trex")
    trex.__path__ = []  # a package
    graphing = types.ModuleType("trex.graphing")

    class EnginePlan:
        def __init__(self, graph_file, profiling_file=None):
            if fail:
                raise KeyError("Bindings")
            calls.append(("EnginePlan", graph_file, profiling_file))

    def layer_type_formatter(layer):
        return {}

    def to_dot(plan, formatter, **kw):
        calls.append(("to_dot", formatter is layer_type_formatter, kw))
        return "graph"

    def render_dot(graph, engine_name, output_format):
        calls.append(("render_dot", graph, engine_name, output_format))
        Path(f"{engine_name}.{output_format}").write_text("<svg/>")
        return f"{engine_name}.{output_format}"

    trex.EnginePlan = EnginePlan
    graphing.layer_type_formatter, graphing.to_dot, graphing.render_dot = layer_type_formatter, to_dot, render_dot
    trex.graphing = graphing
    return trex, graphing


def _install_trex(monkeypatch, calls: list, fail: bool = False) -> None:
    trex, graphing = _stand_in_trex(calls, fail)
    monkeypatch.setitem(sys.modules, "trex", trex)
    monkeypatch.setitem(sys.modules, "trex.graphing", graphing)


def test_render_with_trex_api(tmp_path, monkeypatch):
    calls: list = []
    _install_trex(monkeypatch, calls)
    monkeypatch.setattr(eg.shutil, "which", lambda name: "/usr/bin/dot")
    res = eg.render_graph(LAYERS10, tmp_path / "g.svg", PROFILE)
    assert res.renderer == "trex" and res.svg == tmp_path / "g.svg" and res.svg.read_text() == "<svg/>"
    assert calls[0] == ("EnginePlan", str(LAYERS10), str(PROFILE))
    assert calls[1][0] == "to_dot" and calls[1][1] is True
    assert calls[2] == ("render_dot", "graph", str(tmp_path / "g"), "svg")
    # TREx failing on a plan: fall back to the plain drawing and say why
    _install_trex(monkeypatch, [], fail=True)
    monkeypatch.setattr(eg.shutil, "which", lambda name: None if name == "dot" else shutil.which(name))
    res = eg.render_graph(LAYERS10, tmp_path / "h.svg", PROFILE)
    assert res.renderer == "none" and "TREx needs Graphviz" in res.message


def test_trex_is_not_used_on_tensorrt_11_layer_json(tmp_path, monkeypatch):
    """TREx reads 'Bindings' and 'Format/Datatype' only, and left TensorRT in 11.1: the plain drawing, and the
    message names what replaces it."""
    calls: list = []
    _install_trex(monkeypatch, calls)
    monkeypatch.setattr(eg.shutil, "which", lambda name: "/usr/bin/dot" if name == "dot" else None)
    monkeypatch.setattr(eg, "_render_with_dot", lambda dot, svg: None)
    res = eg.render_graph(LAYERS11, tmp_path / "g.svg")
    assert calls == [] and res.renderer == "graphviz"
    assert "TREx reads TensorRT 10 layer information only" in res.message and "Nsight Deep Learning Designer" in res.message


def test_tensorrt_11_split_datatype_fields():
    doc = eg.load_layer_info(LAYERS11)
    tensors = [t for lay in doc["Layers"] if isinstance(lay, dict) for t in lay.get("Outputs", [])]
    assert tensors and not any("Format/Datatype" in t for t in tensors) and all("DataType" in t for t in tensors)
    assert eg.tensor_dtype({"Format": "Thirty-two wide channel vectorized row major format", "DataType": "Int8"}) == "INT8"
    assert eg.tensor_dtype({"Format/Datatype": "Channel major FP16 format where channel % 8 == 0"}) == "FP16"
    assert eg.tensor_dtype({"Format": "Row major linear FP32 format (kLINEAR)"}) == "FP32"
    assert eg.tensor_dtype({"Format": "Row major linear format"}) == "unknown"


def test_names_only_layer_info(tmp_path, monkeypatch):
    p = tmp_path / "names.layer.json"
    p.write_text(json.dumps({"Layers": ["/model.0/conv/Conv", "/model.1/conv/Conv"], "Bindings": ["images", "out"]}))
    s = eg.precision_summary(eg.load_layer_info(p))
    assert not s["detailed"] and s["layers"] == 2 and s["by_output_dtype"] == {"unknown": 2}
    assert "profilingVerbosity=detailed" in eg.summary_markdown(s)
    dot = eg.to_dot(eg.load_layer_info(p))
    assert 'L1 [label="/model.1/conv/Conv"];' in dot and "->" not in dot


def test_bad_inputs(tmp_path):
    with pytest.raises(QATError, match="not found"):
        eg.load_layer_info(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(QATError, match="not valid JSON"):
        eg.load_layer_info(bad)
    bad.write_text('{"count": 3}')
    with pytest.raises(QATError, match="no 'Layers'"):
        eg.load_layer_info(bad)


def test_cli(tmp_path):
    r = subprocess.run([sys.executable, "-m", "utils.qat.trt.engine_graph", str(LAYERS10), "--profile", str(PROFILE),
                        "--out", str(tmp_path / "e.svg"), "--no-trex"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "| INT8 | 7 | 70.0% |" in r.stdout
    assert (tmp_path / "e.dot").is_file()
    r = subprocess.run([sys.executable, "-m", "utils.qat.trt.engine_graph", str(tmp_path / "missing.layer.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: layer-info file")
