"""utils.qat.onnx.onnx_qdq (dedupe, simplify) and utils.qat.onnx.onnx_lint (Q/DQ lint, summary) on hand-built
ONNX graphs, plus one real modelopt export. Pure ONNX (no YOLOv9 tree needed); the modelopt test is skipped
without modelopt."""
from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from utils.qat.onnx import onnx_qdq
from utils.qat.onnx.onnx_lint import FINDING_KINDS, format_lint, lint, qdq_summary
from utils.qat.onnx.onnx_qdq import dedupe_qdq, simplify

ort = pytest.importorskip("onnxruntime")

RNG = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------
# a tiny graph builder: scales / zero points as initializers ("init") or Constant nodes ("const")
# ---------------------------------------------------------------------------------------------

class G:
    def __init__(self, style: str = "init"):
        self.style = style
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.n = 0

    def _uid(self, stem: str) -> str:
        self.n += 1
        return f"{stem}_{self.n}"

    def const(self, arr, stem: str = "c") -> str:
        """A scale / zero point: initializer or Constant node, by the builder's style."""
        name = self._uid(stem)
        t = numpy_helper.from_array(np.asarray(arr), name)
        if self.style == "const":
            self.nodes.append(helper.make_node("Constant", [], [name], name=name + "_node", value=t))
        else:
            self.inits.append(t)
        return name

    def init(self, arr, stem: str = "w") -> str:
        name = self._uid(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), name))
        return name

    def input(self, name: str, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def output(self, name: str) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
        return name

    def op(self, op: str, inputs, name: str | None = None, **attrs) -> str:
        name = name or self._uid(op)
        out = name + "_out"
        self.nodes.append(helper.make_node(op, list(inputs), [out], name=name, **attrs))
        return out

    def q(self, x, scale, zp=0, zp_dtype=np.int8, axis=None, name=None, zp_name=None, scale_name=None):
        s = scale_name or self.const(np.asarray(scale, np.float32), "scale")
        z = zp_name or self.const(np.full(np.shape(scale), zp, zp_dtype), "zp")
        kw = {} if axis is None else {"axis": axis}
        return self.op("QuantizeLinear", [x, s, z], name, **kw), s, z

    def dq(self, x, s, z, axis=None, name=None):
        kw = {} if axis is None else {"axis": axis}
        return self.op("DequantizeLinear", [x, s, z], name, **kw)

    def qdq(self, x, scale, name: str | None = None, zp=0, zp_dtype=np.int8) -> str:
        """Q -> DQ sharing one scale / zero point (the torch exporter's form)."""
        name = name or self._uid("qdq")
        qo, s, z = self.q(x, scale, zp, zp_dtype, name=name + "/Q")
        return self.dq(qo, s, z, name=name + "/DQ")

    def weight(self, k, c, kh=3, form="qdq", per_channel=True, axis=0, name=None, transpose=False):
        """A quantized conv weight: 'qdq' (Q->DQ of a float initializer, modelopt's form), 'int8'
        (DQ of an int8 initializer) or 'float' (not quantized)."""
        name = name or self._uid("weight")
        shape = (c, k, kh, kh) if transpose else (k, c, kh, kh)
        w = RNG.normal(0, 0.3, shape).astype(np.float32)
        if form == "float":
            return self.init(w, name)
        ch = shape[axis]
        if per_channel:
            amax = np.abs(np.moveaxis(w, axis, 0)).reshape(ch, -1).max(1)
            scale = (amax / 127).astype(np.float32)
            bshape = [1] * 4
            bshape[axis] = ch
            ax = axis
        else:
            scale = np.float32(np.abs(w).max() / 127)
            bshape, ax = [1] * 4, None
        s = self.const(scale, "wscale")
        z = self.const(np.zeros(np.shape(scale), np.int8), "wzp")
        kw = {} if ax is None else {"axis": ax}
        if form == "int8":
            wi = np.clip(np.round(w / np.reshape(scale, bshape)), -128, 127).astype(np.int8)
            return self.op("DequantizeLinear", [self.init(wi, name), s, z], name + "/DQ", **kw)
        qo = self.op("QuantizeLinear", [self.init(w, name), s, z], name + "/Q", **kw)
        return self.op("DequantizeLinear", [qo, s, z], name + "/DQ", **kw)

    def conv(self, x, k, c, name, kh=3, transpose=False, **wkw):
        w = self.weight(k, c, kh, name=name + ".weight", transpose=transpose, **wkw)
        b = self.init(RNG.normal(0, 0.1, k).astype(np.float32), "bias")
        return self.op("ConvTranspose" if transpose else "Conv", [x, w, b], name,
                       pads=[kh // 2] * 4 if not transpose else [0] * 4, kernel_shape=[kh, kh])

    def model(self, opset: int = 17) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", self.inputs, self.outputs, self.inits)
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        m.ir_version = 8
        # outputs were declared without a shape: take onnx's inferred one (the checker wants one)
        ig = onnx.shape_inference.infer_shapes(m).graph
        inferred = {v.name: v for v in list(ig.value_info) + list(ig.output)}
        for o in m.graph.output:
            if o.name in inferred and inferred[o.name].type.tensor_type.HasField("shape"):
                o.type.CopyFrom(inferred[o.name].type)
            elif not o.type.tensor_type.HasField("shape"):
                o.type.tensor_type.shape.SetInParent()  # rank unknown to onnx: declare an empty shape
        onnx.checker.check_model(m)
        return m


STYLES = ["init", "const"]


def _ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _counts(model: onnx.ModelProto) -> tuple[int, int]:
    ops = [n.op_type for n in model.graph.node]
    return ops.count("QuantizeLinear"), ops.count("DequantizeLinear")


def _scales(model: onnx.ModelProto) -> list[tuple]:
    g = onnx_qdq.QDQGraph(model)
    out = []
    for n in g.nodes:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            s = g.value(n.input[1])
            out.append((n.op_type, tuple(np.asarray(s, np.float32).ravel().tolist())))
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# the clean, fully quantized graph
# ---------------------------------------------------------------------------------------------

def clean_graph(style: str = "init", batch="batch") -> onnx.ModelProto:
    """Q/DQ input -> Conv (per-channel weight DQ) -> Relu -> Q/DQ -> Concat with an equally scaled
    quantized branch -> Q/DQ -> MaxPool -> Q/DQ -> Conv -> residual Add (both inputs Q/DQ) ->
    Q/DQ -> nearest Resize -> Q/DQ -> Conv -> output."""
    g = G(style)
    x = g.input("images", [batch, 3, 8, 8])
    d0 = g.qdq(x, 0.03, "/in/qdq")
    c1 = g.op("Relu", [g.conv(d0, 4, 3, "/b1/Conv")], "/b1/Relu")
    c2 = g.op("Relu", [g.conv(d0, 4, 3, "/b2/Conv", form="int8")], "/b2/Relu")
    s = 0.02
    cat = g.op("Concat", [g.qdq(c1, s, "/cat/in0"), g.qdq(c2, s, "/cat/in1")], "/cat/Concat", axis=1)
    mp = g.op("MaxPool", [g.qdq(cat, s, "/cat/out")], "/pool/MaxPool", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    dm = g.qdq(mp, s, "/pool/out")
    c3 = g.op("Relu", [g.conv(dm, 8, 8, "/b3/Conv")], "/b3/Relu")
    add = g.op("Add", [g.qdq(c3, 0.025, "/res/in0"), dm], "/res/Add")
    rs = g.op("Resize", [g.qdq(add, 0.05, "/up/in"), "", g.init(np.array([1, 1, 2, 2], np.float32), "sc")],
              "/up/Resize", mode="nearest")
    g.op("Conv", [g.qdq(rs, 0.05, "/up/out"), g.weight(2, 8, 1, name="/head/Conv.weight")], "/head/Conv",
         kernel_shape=[1, 1])
    g.output("/head/Conv_out")
    return g.model()


@pytest.mark.parametrize("style", STYLES)
def test_clean_graph_lints_clean_and_runs(style):
    m = clean_graph(style)
    rep = lint(m)
    assert rep["total"] == 0, format_lint(rep)
    assert rep["findings"] == {}
    assert rep["stats"]["conv"] == 4 and rep["stats"]["quantized_conv"] == 4
    assert rep["stats"]["quantize_linear"] == 11 and rep["stats"]["dequantize_linear"] == 12
    json.dumps(rep)
    assert "\n" not in format_lint(rep) and "clean" in format_lint(rep)
    (y,) = _ort_run(m, {"images": RNG.normal(size=(2, 3, 8, 8)).astype(np.float32)})
    assert y.shape == (2, 2, 16, 16) and np.isfinite(y).all()


def test_lint_accepts_path(tmp_path):
    p = tmp_path / "m.onnx"
    onnx.save(clean_graph(), str(p))
    assert lint(p)["total"] == 0 and lint(str(p))["total"] == 0


# ---------------------------------------------------------------------------------------------
# one trigger and one clean counterpart per finding kind
# ---------------------------------------------------------------------------------------------

def conv_input(style, bad, transpose=False):
    g = G(style)
    x = g.input("x", [1, 3, 8, 8])
    src = x if bad else g.qdq(x, 0.03)
    g.conv(src, 4, 3, "/m/Conv", transpose=transpose, axis=1 if transpose else 0)
    g.output("/m/Conv_out")
    return g.model(), "conv_input_not_quantized", ["/m/Conv"]


def conv_weight(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.03)
    g.conv(x, 4, 3, "/m/Conv", form="float" if bad else "qdq")
    g.output("/m/Conv_out")
    return g.model(), "conv_weight_not_quantized", ["/m/Conv"]


def weight_per_tensor(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.03)
    g.conv(x, 4, 3, "/m/Conv", per_channel=not bad)
    g.conv(x, 1, 3, "/one/Conv", per_channel=False)  # a single output channel: per-tensor is per-channel
    g.output("/m/Conv_out")
    g.output("/one/Conv_out")
    return g.model(), "weight_scale_not_per_channel", ["/m/Conv.weight/DQ"]


def weight_wrong_axis(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 4, 8, 8]), 0.03)
    g.conv(x, 4, 4, "/m/Conv", axis=1 if bad else 0, form="int8")  # [4,4,3,3]: axis 1 has 4 scales too
    g.output("/m/Conv_out")
    return g.model(), "weight_scale_not_per_channel", ["/m/Conv.weight/DQ"]


def zero_point_nonzero(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.03, "/in", zp=3 if bad else 0)
    g.conv(x, 4, 3, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "nonzero_zero_point", ["/in/Q", "/in/DQ"]


def zero_point_uint8(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.03, "/in", zp_dtype=np.uint8 if bad else np.int8)
    g.conv(x, 4, 3, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "nonzero_zero_point", ["/in/Q", "/in/DQ"]


def scale_not_positive(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.0 if bad else 0.03, "/in")  # e.g. an FP16 scale that underflowed
    g.conv(x, 4, 3, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "nonpositive_scale", ["/in/Q", "/in/DQ"]


def concat_inputs(style, bad):
    g = G(style)
    a = g.qdq(g.input("a", [1, 3, 8, 8]), 0.02)
    b = g.qdq(g.input("b", [1, 3, 8, 8]), 0.04 if bad else 0.02)
    cat = g.op("Concat", [a, b], "/cat/Concat", axis=1)
    g.conv(g.qdq(cat, 0.02), 4, 6, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "concat_scale_mismatch", ["/cat/Concat"]


def concat_output(style, bad):
    g = G(style)
    a = g.qdq(g.input("a", [1, 3, 8, 8]), 0.02)
    b = g.qdq(g.input("b", [1, 3, 8, 8]), 0.02)
    cat = g.op("Concat", [a, b], "/cat/Concat", axis=1)
    g.conv(g.qdq(cat, 0.02 * (1 + 1e-4) if bad else 0.02 * (1 + 1e-8)), 4, 6, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "concat_scale_mismatch", ["/cat/Concat"]


def maxpool(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.02)
    mp = g.op("MaxPool", [x], "/pool/MaxPool", kernel_shape=[2, 2], strides=[2, 2])
    g.conv(g.qdq(mp, 0.03 if bad else 0.02), 4, 3, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "maxpool_scale_mismatch", ["/pool/MaxPool"]


def resize(style, bad):
    g = G(style)
    x = g.qdq(g.input("x", [1, 3, 8, 8]), 0.02)
    rs = g.op("Resize", [x, "", g.init(np.array([1, 1, 2, 2], np.float32), "sc")], "/up/Resize", mode="nearest")
    g.conv(g.qdq(rs, 0.03 if bad else 0.02), 4, 3, "/m/Conv")
    # a linear Resize changes values: different scales around it are legitimate
    rl = g.op("Resize", [x, "", g.init(np.array([1, 1, 2, 2], np.float32), "sc")], "/lin/Resize", mode="linear")
    g.conv(g.qdq(rl, 0.05), 4, 3, "/l/Conv")
    g.output("/m/Conv_out")
    g.output("/l/Conv_out")
    return g.model(), "resize_scale_mismatch", ["/up/Resize"]


def residual_add(style, bad):
    g = G(style)
    d0 = g.qdq(g.input("x", [1, 4, 8, 8]), 0.02)
    c = g.op("Sigmoid", [g.conv(d0, 4, 4, "/m/Conv")], "/m/Sigmoid")  # the other input: a non-Conv op
    other = c if bad else g.qdq(c, 0.01)
    g.op("Add", [d0, other], "/res/Add")
    # decode-like Adds are never flagged: DQ + constant, DQ + graph input, float + float
    g.op("Add", [d0, g.init(RNG.normal(size=(1, 4, 1, 1)).astype(np.float32), "anchors")], "/dec/Add")
    g.op("Add", [g.input("y", [1, 4, 8, 8]), d0], "/dec/Add2")
    g.op("Add", [c, g.op("Relu", [c])], "/dec/Add3")
    for o in ("/res/Add_out", "/dec/Add_out", "/dec/Add2_out", "/dec/Add3_out"):
        g.output(o)
    return g.model(), "add_single_quantized_input", ["/res/Add"]


def orphan_q(style, bad):
    g = G(style)
    x = g.input("x", [1, 3, 8, 8])
    g.conv(g.qdq(x, 0.02, "/in"), 4, 3, "/m/Conv")
    if bad:
        g.q(x, 0.05, name="/lost/Q")
    g.output("/m/Conv_out")
    return g.model(), "orphan_qdq", ["/lost/Q"]


def orphan_dq(style, bad):
    g = G(style)
    x = g.input("x", [1, 3, 8, 8])
    qo, s, z = g.q(x, 0.02, name="/in/Q")
    g.conv(g.dq(qo, s, z, name="/in/DQ"), 4, 3, "/m/Conv")
    if bad:
        g.dq(qo, s, z, name="/dangling/DQ")
    g.output("/m/Conv_out")
    return g.model(), "orphan_qdq", ["/dangling/DQ"]


def q_without_dq(style, bad):
    g = G(style)
    x = g.input("x", [1, 3, 8, 8])
    qo, s, z = g.q(x, 0.02, name="/in/Q")
    if bad:
        g.op("Cast", [qo], "/raw/Cast", to=TensorProto.FLOAT)  # int8 -> float by hand, not a DQ
        g.output("/raw/Cast_out")
    g.conv(g.dq(qo, s, z, name="/in/DQ"), 4, 3, "/m/Conv")
    g.output("/m/Conv_out")
    return g.model(), "orphan_qdq", ["/in/Q"]


def unquantized_consumer(style, bad):
    g = G(style)
    c = g.conv(g.qdq(g.input("x", [1, 3, 8, 8]), 0.02), 4, 3, "/m/Conv")
    d = g.qdq(c, 0.02, "/head")
    if bad:  # DQ -> Reshape -> Sigmoid: nothing quantized downstream
        g.op("Sigmoid", [g.op("Reshape", [d, g.init(np.array([1, 4, 64], np.int64), "shape")], "/head/Reshape")],
             "/head/Sigmoid")
        g.output("/head/Sigmoid_out")
    else:  # DQ -> Reshape -> MatMul (through a data-movement op to a quantizable op)
        r = g.op("Reshape", [d, g.init(np.array([1, 4, 64], np.int64), "shape")], "/head/Reshape")
        g.op("MatMul", [r, g.init(RNG.normal(size=(64, 2)).astype(np.float32), "mm")], "/head/MatMul")
        g.output("/head/MatMul_out")
    return g.model(), "qdq_on_unquantized_consumer", ["/head/DQ"]


def duplicate(style, bad):
    g = G(style)
    x = g.input("x", [1, 3, 8, 8])
    a = g.qdq(x, 0.02, "/a/in")
    b = g.qdq(x, 0.02, "/b/in") if bad else a
    g.conv(a, 4, 3, "/a/Conv")
    g.conv(b, 4, 3, "/b/Conv")
    g.output("/a/Conv_out")
    g.output("/b/Conv_out")
    return g.model(), "duplicate_qdq", ["/b/in/Q"]


CASES = {
    "conv_input": conv_input,
    "conv_transpose_input": lambda s, b: conv_input(s, b, transpose=True),
    "conv_weight": conv_weight,
    "weight_per_tensor": weight_per_tensor,
    "weight_wrong_axis": weight_wrong_axis,
    "zero_point_nonzero": zero_point_nonzero,
    "zero_point_uint8": zero_point_uint8,
    "scale_not_positive": scale_not_positive,
    "concat_inputs": concat_inputs,
    "concat_output": concat_output,
    "maxpool": maxpool,
    "resize": resize,
    "residual_add": residual_add,
    "orphan_q": orphan_q,
    "orphan_dq": orphan_dq,
    "q_without_dq": q_without_dq,
    "unquantized_consumer": unquantized_consumer,
    "duplicate": duplicate,
}


def test_every_kind_has_a_case():
    kinds = {CASES[c]("init", True)[1] for c in CASES}
    assert kinds == set(FINDING_KINDS)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_finding_triggers(case, style):
    m, kind, nodes = CASES[case](style, True)
    rep = lint(m)
    assert kind in rep["findings"], format_lint(rep)
    assert rep["findings"][kind]["nodes"] == nodes
    assert rep["findings"][kind]["count"] == len(nodes)
    assert rep["total"] == sum(f["count"] for f in rep["findings"].values())
    json.loads(json.dumps(rep))
    text = format_lint(rep)
    assert kind in text and text.count("\n") >= 2


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_clean_counterpart(case, style):
    m, kind, _ = CASES[case](style, False)
    rep = lint(m)
    assert rep["total"] == 0, format_lint(rep)


def test_allow_fp_patterns():
    """An FP conv named like YOLOv9's DFL conv is allowed by default; other FP convs only on request."""
    g = G()
    x = g.input("x", [1, 16, 8, 8])
    g.op("Conv", [g.op("Softmax", [x], "/model.22/dfl/Softmax", axis=1),
                  g.init(np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1))], "/model.22/dfl/conv/Conv")
    g.conv(x, 4, 16, "/model.21/Conv", form="float")
    g.output("/model.22/dfl/conv/Conv_out")
    g.output("/model.21/Conv_out")
    m = g.model()
    rep = lint(m)
    assert rep["findings"]["conv_input_not_quantized"]["nodes"] == ["/model.21/Conv"]
    assert rep["stats"]["fp_conv_allowed"] == 1
    assert lint(m, allow_fp=("*dfl*", "/model.21/*"))["total"] == 0
    assert lint(m, allow_fp=())["findings"]["conv_input_not_quantized"]["count"] == 2


# ---------------------------------------------------------------------------------------------
# dedupe_qdq
# ---------------------------------------------------------------------------------------------

def duplicated_graph(style="init", noop_casts=False) -> onnx.ModelProto:
    """One tensor quantized three times with the same scale (as the torch exporter leaves it when
    tied input quantizers meet one tensor); with ``noop_casts`` the later Qs read it through
    Cast(to=FLOAT) chains, the way modelopt 0.47's export emits them."""
    g = G(style)
    x = g.input("x", [1, 3, 8, 8])
    r = g.op("Relu", [x], "/r/Relu")
    srcs = [r, r, r]
    if noop_casts:
        c1 = g.op("Cast", [r], "/a/input_quantizer/Cast", to=TensorProto.FLOAT)
        srcs = [r, c1, g.op("Cast", [c1], "/b/input_quantizer/Cast", to=TensorProto.FLOAT)]
    ys = [g.conv(g.qdq(srcs[0], 0.02, "/a/in"), 4, 3, "/a/Conv"),
          g.conv(g.qdq(srcs[1], 0.02, "/b/in"), 4, 3, "/b/Conv"),
          g.op("MaxPool", [g.qdq(srcs[2], 0.02, "/p/in")], "/p/MaxPool", kernel_shape=[3, 3], pads=[1] * 4)]
    g.conv(g.qdq(r, 0.03, "/c/in"), 4, 3, "/c/Conv")  # different scale: not a duplicate
    ys.append("/c/Conv_out")
    cat = g.op("Concat", ys[:2], "/cat/Concat", axis=1)
    for o in (cat, ys[2], ys[3]):
        g.output(o)
    return g.model()


@pytest.mark.parametrize("noop_casts", [False, True])
@pytest.mark.parametrize("style", STYLES)
def test_dedupe_removes_duplicates_bitwise_equal(style, noop_casts):
    m = duplicated_graph(style, noop_casts)
    before = onnx.ModelProto()
    before.CopyFrom(m)
    rep = lint(m)
    assert rep["findings"]["duplicate_qdq"]["nodes"] == ["/b/in/Q", "/p/in/Q"]
    out, n = dedupe_qdq(m)
    assert m == before, "the input model must not be modified"
    assert n == 4  # two Q and their two DQ
    assert _counts(m) == (7, 7) and _counts(out) == (5, 5)  # 4 + 3 weight Q/DQ -> 2 + 3
    onnx.checker.check_model(out)
    assert lint(out)["total"] == 0, format_lint(lint(out))
    assert not any(x.op_type == "Cast" for x in out.graph.node), "no-op casts left dangling"
    feeds = {"x": RNG.normal(size=(1, 3, 8, 8)).astype(np.float32) * 3}
    for a, b in zip(_ort_run(m, feeds), _ort_run(out, feeds)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    again, n2 = dedupe_qdq(out)
    assert n2 == 0 and again == out


def test_dedupe_clean_graph_is_noop():
    m = clean_graph()
    out, n = dedupe_qdq(m)
    assert n == 0 and out == m


def test_dedupe_keeps_graph_output_dq():
    """A duplicate whose output is a graph output stays (its name is part of the interface)."""
    g = G()
    x = g.input("x", [1, 3, 4, 4])
    a = g.qdq(x, 0.02, "/a")
    b = g.qdq(x, 0.02, "/b")
    g.output(a)
    g.output(b)
    m = g.model()
    out, n = dedupe_qdq(m)
    assert n == 1  # /b/Q merged into /a/Q; both DQ make graph outputs and stay
    assert {o.name for o in out.graph.output} <= {o for nd in out.graph.node for o in nd.output}
    feeds = {"x": RNG.normal(size=(1, 3, 4, 4)).astype(np.float32)}
    for p, q in zip(_ort_run(m, feeds), _ort_run(out, feeds)):
        assert np.array_equal(p, q)


# ---------------------------------------------------------------------------------------------
# simplify / summary
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("style", STYLES)
def test_simplify_keeps_qdq(style):
    m = clean_graph(style)
    s = simplify(m)
    assert _counts(s) == _counts(m)
    assert _scales(s) == _scales(m)
    assert lint(s)["total"] == 0
    feeds = {"images": RNG.normal(size=(1, 3, 8, 8)).astype(np.float32)}
    for a, b in zip(_ort_run(m, feeds), _ort_run(s, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_simplify_merges_duplicates_first():
    m = duplicated_graph("const", noop_casts=True)
    s = simplify(m)
    assert _counts(s) == (5, 5)
    assert lint(s)["total"] == 0


def test_simplify_raises_plain_exception_on_lost_qdq(monkeypatch):
    import onnxslim

    def drop_qdq(model, **kw):  # a slimmer that folds Q/DQ away
        return onnx.load_from_string(model.SerializeToString())
    m = clean_graph()
    orig = onnx_qdq._qdq_signature
    calls = []

    def sig(model):
        calls.append(1)
        s = orig(model)
        return s if len(calls) == 1 else {k: v[:-1] for k, v in s.items()}
    monkeypatch.setattr(onnxslim, "slim", drop_qdq)
    monkeypatch.setattr(onnx_qdq, "_qdq_signature", sig)
    with pytest.raises(RuntimeError, match="Q/DQ"):
        simplify(m)
    assert len(calls) == 3  # the input, then the default slim and the retry without constant folding


def test_qdq_summary():
    s = qdq_summary(clean_graph())
    json.dumps(s)
    assert s["qdq_pairs"] == 11 and s["quantize_linear"] == 11 and s["dequantize_linear"] == 12
    assert s["conv"] == 4 and s["quantized_conv"] == 4 and s["opset"] == 17
    assert s["inputs"] == [{"name": "images", "shape": ["batch", 3, 8, 8], "dtype": "float"}]
    assert s["outputs"][0]["name"] == "/head/Conv_out"
    s2 = qdq_summary(simplify(clean_graph(batch=2)))
    assert s2["inputs"][0]["shape"] == [2, 3, 8, 8] and s2["outputs"][0]["shape"] == [2, 2, 16, 16]


def test_modules_do_not_import_torch():
    import subprocess
    import sys
    code = ("import sys, utils.qat.onnx.onnx_qdq, utils.qat.onnx.onnx_lint; assert"
            " 'torch' not in sys.modules and 'onnxslim' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(onnx_qdq.__file__).rsplit("/utils/", 1)[0])


# ---------------------------------------------------------------------------------------------
# real exporter output: modelopt fake quant -> torch.onnx.export (TorchScript exporter)
# ---------------------------------------------------------------------------------------------

INT8_CFG = {
    "quant_cfg": [
        {"quantizer_name": "*", "enable": False},
        {"quantizer_name": "*weight_quantizer", "cfg": {"num_bits": 8, "axis": 0, "narrow_range": False}},
        {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": 8, "axis": None, "narrow_range": False}},
    ],
    "algorithm": "max",
}


@pytest.fixture(scope="module")
def modelopt_exports(tmp_path_factory):
    torch = pytest.importorskip("torch")
    mtq = pytest.importorskip("modelopt.torch.quantization")
    nn = torch.nn
    torch.manual_seed(0)

    class ConvNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.c3 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, 2, 1), nn.Conv2d(8, 4, 1)

        def forward(self, x):
            return self.c3(torch.relu(self.c2(torch.relu(self.c1(x)))))

    class BranchNet(nn.Module):  # one tensor feeding two quantized convs and a quantized MaxPool
        def __init__(self):
            super().__init__()
            self.c1, self.a, self.b = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
            self.pool = nn.MaxPool2d(3, 1, 1)

        def forward(self, x):
            y = torch.relu(self.c1(x))
            return torch.cat([self.a(y), self.b(y)], 1), self.pool(y)

    x = torch.randn(2, 3, 16, 16)
    root = tmp_path_factory.mktemp("mo")
    paths = {}
    for name, net in (("conv", ConvNet()), ("branch", BranchNet())):
        net = net.eval()
        mtq.quantize(net, INT8_CFG, forward_loop=lambda mdl: mdl(x))
        p = root / f"{name}.onnx"
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(net, (x,), str(p), dynamo=False, opset_version=17, input_names=["images"],
                              dynamic_axes={"images": {0: "batch"}})
        paths[name] = p
    return paths, x.numpy()


def test_modelopt_conv_export_lints_clean(modelopt_exports):
    paths, x = modelopt_exports
    m = onnx.load(str(paths["conv"]))
    rep = lint(m)
    assert rep["total"] == 0, format_lint(rep)
    assert rep["stats"]["conv"] == rep["stats"]["quantized_conv"] == 3
    assert rep["stats"]["quantize_linear"] == rep["stats"]["dequantize_linear"] == 6
    # modelopt's form: weight Q->DQ of the float initializer, scales / zero points in Constant nodes
    g = onnx_qdq.QDQGraph(m)
    wq = [n for n in g.nodes if n.op_type == "QuantizeLinear" and n.input[0] in g.init]
    assert len(wq) == 3 and all(n.input[1] in g.const_nodes for n in g.nodes if n.op_type == "QuantizeLinear")
    s = simplify(m)
    assert _counts(s) == _counts(m) and _scales(s) == _scales(m) and lint(s)["total"] == 0
    summary = qdq_summary(s)
    assert summary["inputs"][0]["shape"] == ["batch", 3, 16, 16] and summary["qdq_pairs"] == 6


def test_modelopt_branch_export_dedupes(modelopt_exports):
    paths, x = modelopt_exports
    m = onnx.load(str(paths["branch"]))
    rep = lint(m)
    # max calibration of one tensor gives the same amax for every quantizer reading it
    assert set(rep["findings"]) == {"duplicate_qdq"}, format_lint(rep)
    out, n = dedupe_qdq(m)
    assert n == 2 * rep["findings"]["duplicate_qdq"]["count"]
    assert lint(out)["total"] == 0
    for a, b in zip(_ort_run(m, {"images": x}), _ort_run(out, {"images": x})):
        assert np.array_equal(a, b)
    s = simplify(m)
    assert _counts(s) == _counts(out) and _scales(s) == _scales(out) and lint(s)["total"] == 0
