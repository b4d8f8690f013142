"""A Q/DQ graph rewritten so that ONNX Runtime computes it in the arithmetic ``qat.py`` scores a quantized model with.

    counts = integer_arithmetic(model)   # in place; {"convolutions": n, "pools": p, "silu": m}

ONNX Runtime runs the graph ``export_qat.py`` writes with each quantized convolution in float32 over the dequantized
values (its integer kernel, QLinearConv, needs a QuantizeLinear right after the convolution, and the SiLU stands in
between), and computes each Sigmoid with its own approximation. Both differ from PyTorch in the last bit, and a last
bit that lands on a rounding boundary of the next quantizer flips a code there: no image of YOLOv9-t kept the same
detections (docs/RESULTS.md "One model, one score"). This rewrite gives ONNX Runtime the arithmetic of
``utils.qat.quantize.integer_conv``, the same operations in the same order, so that the graph's score is the
checkpoint's (YOLOv9-t: the same mAP to the fourth digit, the same detections on 333-334 of 334 images):

    DQ(x) -> Conv <- DQ(w), b     becomes   ConvInteger(x_u8, w_u8) -> Cast(float) -> Mul(s_x * s_w[c]) -> Add(b[c])
    DQ(q) -> AveragePool          becomes   Cast(q, float) -> AveragePool -> Mul(s)      (the codes averaged, exactly)
    Sigmoid(x) -> Mul(x, .)       becomes   1 / (1 + Exp(-Cast(double)(x))) -> Cast(float) -> Mul(x, .)

The integer codes go in as uint8 with zero point 128 (the same integers, shifted): ONNX Runtime computes uint8 by
uint8 exactly on every x86 CPU (its uint8 by int8 kernel adds pairs of products in 16 bits, which saturate without
VNNI). The sum is an exact int32, the scale is the float32 product PyTorch forms, and the SiLU's sigmoid is computed
in float64 and rounded once, as ``integer_conv.ExactSiLU`` does, from its exponential (ONNX Runtime's float64
Sigmoid loses relative precision for negative inputs: 2.0562219e-11 for 2.0562314e-11 at -24.6). Convolutions
whose input is not quantized per tensor with zero point 0, or whose weights are not int8 held in the graph, stay as
they were.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from utils.qat.onnx.onnx_graph import attr
from utils.qat.onnx.onnx_qdq import Q, QDQGraph

ZERO_POINT = 128  # int8 codes as uint8: q + 128
_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def integer_arithmetic(model: onnx.ModelProto) -> dict[str, int]:
    """Rewrite ``model`` in place (see the module's docstring); returns how many convolutions, average pools and SiLUs
    were rewritten. A graph without Q/DQ convolutions is left as it was but for its SiLUs."""
    g = QDQGraph(model)
    out: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    unsigned: dict[str, str] = {}  # an activation's int8 codes -> the same codes as uint8
    zero = _initializer(inits, "integer_arithmetic/zero_point_u8", np.array(ZERO_POINT, np.uint8))
    one = _initializer(inits, "integer_arithmetic/one_f64", np.array(1.0, np.float64))
    convolutions = pools = silus = 0
    for node in g.nodes:
        if node.op_type == "Conv" and (parts := _quantized_conv(g, node)) is not None:
            out.extend(_integer_conv(node, parts, unsigned, inits, zero))
            convolutions += 1
        elif node.op_type == "AveragePool" and _exact_pool(node) and (codes := _quantized_input(g, node)) is not None:
            out.extend(_integer_pool(node, *codes))
            pools += 1
        elif node.op_type == "Sigmoid" and _is_silu(g, node):
            out.extend(_double_sigmoid(node, one))
            silus += 1
        else:
            out.append(node)
    if convolutions or pools or silus:
        del model.graph.node[:]
        model.graph.node.extend(out)
        model.graph.initializer.extend(inits)
        _drop_dead(model)
    return {"convolutions": convolutions, "pools": pools, "silu": silus}


def _quantized_conv(g: QDQGraph, conv: onnx.NodeProto) -> dict | None:
    """The parts of a convolution of a per-tensor quantized input (zero point 0) and int8 weights held in the graph
    (per output channel or per tensor, zero point 0); None for any other convolution."""
    x, w_dq = _quantized_input(g, conv), g.dq_of(conv.input[1])
    if x is None or w_dq is None:
        return None
    x_q = g.source(x[0])
    if x_q is None or x_q.op_type != Q:
        return None
    (sq, zq, _), sx = g.qparams(x_q), g.value(x[1])
    if sq is None or sq.tobytes() != sx.tobytes() or (zq is not None and (zq.dtype != np.int8 or zq.any())):
        return None
    sw, zw, _ = g.qparams(w_dq)
    w = g.value(w_dq.input[0])
    if w is None or w.dtype != np.int8 or w.ndim != 4 or sw is None or sw.dtype != np.float32 or \
            (zw is not None and zw.any()):
        return None
    if sw.size not in (1, w.shape[0]) or (sw.size > 1 and int(attr(w_dq, "axis", 1)) != 0):
        return None
    bias = g.value(conv.input[2]) if len(conv.input) > 2 and conv.input[2] else None
    if len(conv.input) > 2 and conv.input[2] and (bias is None or bias.dtype != np.float32):
        return None
    return {"x": x_q.input[0], "x_scale": x_q.input[1], "w": w, "scale": sx.astype(np.float32).reshape(()),
            "w_scale": sw.astype(np.float32).reshape(-1), "bias": bias}


def _integer_conv(conv: onnx.NodeProto, p: dict, unsigned: dict[str, str], inits: list, zero: str) -> list:
    name = conv.name or conv.output[0]
    nodes = []
    if p["x"] not in unsigned:  # round(x / s_x) + 128: the activation's int8 code, shifted
        unsigned[p["x"]] = f"{name}/x_u8"
        nodes.append(helper.make_node(Q, [p["x"], p["x_scale"], zero], [unsigned[p["x"]]], name=f"{name}/x_u8"))
    channels = p["w"].shape[0]
    w_u8 = _initializer(inits, f"{name}/w_u8", (p["w"].astype(np.int16) + ZERO_POINT).astype(np.uint8))
    scale = _initializer(inits, f"{name}/scale", (p["scale"] * p["w_scale"]).astype(np.float32).reshape(1, -1, 1, 1)
                         if p["w_scale"].size == channels else
                         np.full((1, channels, 1, 1), p["scale"] * p["w_scale"][0], np.float32))
    conv_attrs = {a.name: helper.get_attribute_value(a) for a in conv.attribute if a.name in _CONV_ATTRS}
    acc, real = f"{name}/acc", f"{name}/acc_f32"
    nodes.append(helper.make_node("ConvInteger", [unsigned[p["x"]], w_u8, zero, zero], [acc], name=f"{name}/integer",
                                  **conv_attrs))
    nodes.append(helper.make_node("Cast", [acc], [real], name=f"{name}/cast", to=TensorProto.FLOAT))
    if p["bias"] is None:
        nodes.append(helper.make_node("Mul", [real, scale], [conv.output[0]], name=f"{name}/scale"))
        return nodes
    scaled = f"{name}/scaled"
    bias = _initializer(inits, f"{name}/bias", p["bias"].reshape(1, -1, 1, 1))
    nodes.append(helper.make_node("Mul", [real, scale], [scaled], name=f"{name}/scale"))
    nodes.append(helper.make_node("Add", [scaled, bias], [conv.output[0]], name=f"{name}/bias"))
    return nodes


def _exact_pool(pool: onnx.NodeProto) -> bool:
    """An average pool whose every window divides by the same power of two (no padding, no partial windows), so
    that averaging integer codes in float is exact: ADown's and AConv's 2x2."""
    kernel = attr(pool, "kernel_shape", [])
    size = int(np.prod(kernel)) if kernel else 0
    return (size > 0 and size & (size - 1) == 0 and not any(attr(pool, "pads", []) or [])
            and not attr(pool, "ceil_mode", 0) and attr(pool, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET"))


def _quantized_input(g: QDQGraph, node: onnx.NodeProto) -> tuple[str, str] | None:
    """(int8 codes, float32 scale) of a node's input dequantized per tensor with zero point 0, else None."""
    dq = g.dq_of(node.input[0])
    if dq is None:
        return None
    scale, zero, _ = g.qparams(dq)
    if scale is None or scale.size != 1 or scale.dtype != np.float32 or (zero is not None and zero.any()):
        return None
    if g.elem_type(dq.input[0]) != TensorProto.INT8:
        return None
    return dq.input[0], dq.input[1]


def _integer_pool(pool: onnx.NodeProto, codes: str, scale: str) -> list:
    """The pool over the codes as floats (sums of small integers and a division by a power of two: exact), scaled
    once after, as ``rules.quantized_avg_pool`` computes it."""
    name = pool.name or pool.output[0]
    real, averaged = f"{name}/codes_f32", f"{name}/codes_avg"
    attrs = {a.name: helper.get_attribute_value(a) for a in pool.attribute}
    return [helper.make_node("Cast", [codes], [real], name=f"{name}/cast", to=TensorProto.FLOAT),
            helper.make_node("AveragePool", [real], [averaged], name=f"{name}/codes", **attrs),
            helper.make_node("Mul", [averaged, scale], [pool.output[0]], name=f"{name}/scale")]


def _is_silu(g: QDQGraph, sigmoid: onnx.NodeProto) -> bool:
    """A float32 Sigmoid whose only reader is ``Mul(x, Sigmoid(x))``."""
    readers = g.consumers.get(sigmoid.output[0], [])
    return (len(readers) == 1 and readers[0].op_type == "Mul" and sigmoid.output[0] not in g.graph_outputs
            and set(readers[0].input) == {sigmoid.input[0], sigmoid.output[0]}
            and g.elem_type(sigmoid.input[0]) == TensorProto.FLOAT)


def _double_sigmoid(sigmoid: onnx.NodeProto, one: str) -> list:
    """``1 / (1 + exp(-x))`` in float64, rounded once to float32."""
    name = sigmoid.name or sigmoid.output[0]
    t = [f"{name}/f64_{i}" for i in range(5)]
    return [helper.make_node("Cast", [sigmoid.input[0]], [t[0]], name=f"{name}/to_f64", to=TensorProto.DOUBLE),
            helper.make_node("Neg", [t[0]], [t[1]], name=f"{name}/neg"),
            helper.make_node("Exp", [t[1]], [t[2]], name=f"{name}/exp"),
            helper.make_node("Add", [t[2], one], [t[3]], name=f"{name}/add"),
            helper.make_node("Reciprocal", [t[3]], [t[4]], name=f"{name}/reciprocal"),
            helper.make_node("Cast", [t[4]], [sigmoid.output[0]], name=f"{name}/to_f32", to=TensorProto.FLOAT)]


def _initializer(inits: list, name: str, value: np.ndarray) -> str:
    inits.append(numpy_helper.from_array(value, name))
    return name


def _drop_dead(model: onnx.ModelProto) -> None:
    """Remove the nodes and initializers nothing reads any more (the replaced DequantizeLinear and their weights)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    while True:
        read = {i for n in graph.node for i in n.input} | outputs
        kept = [n for n in graph.node if any(o in read for o in n.output if o)]
        if len(kept) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(kept)
    read = {i for n in graph.node for i in n.input}
    dropped = {t.name for t in graph.initializer if t.name not in read}
    kept_inits = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    kept_inputs = [i for i in graph.input if i.name not in dropped]  # an initializer listed as an input too
    del graph.input[:]
    graph.input.extend(kept_inputs)
    names = {o for n in graph.node for o in n.output} | read
    kept_info = [v for v in graph.value_info if v.name in names]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
