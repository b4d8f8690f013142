"""The Q/DQ graph re-placed for ONNX Runtime's CPU provider (``export_qat.py --onnxruntime-cpu``).

    counts = place(model)                  # in place: uint8 weights, computed as written on every x86 CPU
    counts = place(model, weights="7bit")  # 7-bit weights: ONNX Runtime's faster kernel, a little less exact

ONNX Runtime runs a quantized convolution as one INT8 kernel (QLinearConv) only where a QuantizeLinear follows its
output. TensorRT's graphs quantize the inputs of each layer alone, so on ONNX Runtime every convolution of the
graph export_qat.py writes runs in float between Q/DQ pairs, slower than the FP32 graph
(benchmarks/results/cpu-ort-placement-2core.md). This placement adds, for each convolution whose SiLU output
(Sigmoid and Mul) goes only to quantizers of one scale, a Q/DQ pair on the convolution's output with that scale and
one on the Sigmoid's output (1/255, zero point 0): the convolution, the Sigmoid and the Mul then each have
quantized inputs and a quantized output, and ONNX Runtime fuses all three. No new calibration: the added scales are
ones QAT already trained for, or the Sigmoid's exact [0, 1] range.

The activations become uint8 around 128 (the same grid; ONNX Runtime's x86 kernels take unsigned activations). The
weights: on x86 without VNNI its kernel for uint8 activations and int8 weights adds products in pairs in 16-bit
integers (``vpmaddubsw``), which saturate (255 x 127 x 2 > 32767) and wrecked the detections (mAP50-95 0.24 for
0.42). ``weights="uint8"`` stores them as uint8 with zero point 128 (the same integers), which ONNX Runtime computes
with its u8u8 kernel, as written (to rounding) on every CPU; ``"7bit"`` requantizes them to [-63, 63] at twice the scale (as
``--openvino-avx2`` does), which keeps the faster u8s8 kernel and costs weight resolution QAT did not see.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from utils.qat.core.artifact import read_props, write_props
from utils.qat.core.errors import QATError
from utils.qat.onnx.avx2 import (ENCODING_KEY, ZERO_POINT, forget_quantized_types, seven_bit_weights, set_constant,
                                 uint8_activations, weight_dequantizers)
from utils.qat.onnx.onnx_qdq import QDQGraph

#: ONNX metadata: the graph's encoding and how its weights are stored.
ORT_ENCODING, WEIGHTS_KEY = "onnxruntime-cpu", "weights"
WEIGHTS = ("uint8", "7bit")
FLAG = "--onnxruntime-cpu"


def place(model: onnx.ModelProto, weights: str = "uint8") -> dict[str, int]:
    """Re-place ``model`` (a Q/DQ graph from export_qat.py) in place for ONNX Runtime's CPU kernels; returns the
    number of weight tensors, of activation quantizers, and of convolutions given an output Q/DQ pair."""
    if weights not in WEIGHTS:
        raise QATError(f"{FLAG} {weights} is not a weight encoding; choose one of {', '.join(WEIGHTS)}.")
    g = QDQGraph(model)
    dequantizers = weight_dequantizers(g)
    activations = uint8_activations(g, FLAG)
    if not dequantizers or not activations:
        raise QATError(f"the graph has no INT8 Q/DQ convolutions to re-place; {FLAG} needs a quantized checkpoint "
                       "(qat.py quantize).")
    if weights == "7bit":
        seven_bit_weights(g, dequantizers)
    else:
        for n in dequantizers:  # q + 128 with zero point 128: the same values; a zero point of its own each
            set_constant(g, n.input[0], (g.value(n.input[0]).astype(np.int16) + ZERO_POINT).astype(np.uint8))
            zero = _constant(model, f"{n.input[0]}_zero_point_u8", np.full(g.value(n.input[1]).shape, ZERO_POINT,
                                                                            np.uint8))
            if len(n.input) > 2:
                n.input[2] = zero
            else:
                n.input.append(zero)
    convolutions = _silu_output_quantizers(model, g)
    forget_quantized_types(model)
    write_props(model, {**read_props(model), ENCODING_KEY: ORT_ENCODING, WEIGHTS_KEY: weights})
    return {"weights": len(dequantizers), "activations": activations, "convolutions": convolutions}


def _constant(model: onnx.ModelProto, name: str, value: np.ndarray) -> str:
    model.graph.initializer.append(numpy_helper.from_array(value, name))
    return name


def _silu_output_quantizers(model: onnx.ModelProto, g: QDQGraph) -> int:
    """A Q/DQ pair on the output of every convolution whose SiLU output goes only to quantizers of one scale
    (that scale), and one on its Sigmoid's output (1/255, zero point 0); returns how many convolutions."""
    added: dict[str, list[onnx.NodeProto]] = {}
    for conv in g.nodes:
        if conv.op_type != "Conv":
            continue
        out = conv.output[0]
        users = g.consumers[out]
        sigmoid = [u for u in users if u.op_type == "Sigmoid"]
        mul = [u for u in users if u.op_type == "Mul"]
        if len(users) != 2 or len(sigmoid) != 1 or len(mul) != 1 or set(mul[0].input) != {out, sigmoid[0].output[0]}:
            continue  # not a SiLU
        quantizers = g.consumers[mul[0].output[0]]
        if not quantizers or any(q.op_type != "QuantizeLinear" for q in quantizers):
            continue  # its output also goes somewhere in float
        values = [g.value(q.input[1]) for q in quantizers]
        scales = {float(v) for v in values if v is not None and v.size == 1}
        if len(scales) != 1 or any(v is None for v in values) or mul[0].output[0] in g.graph_outputs:
            continue  # not one constant per-tensor scale
        conv_q = _qdq(model, out, scales.pop(), ZERO_POINT)
        sigmoid_q = _qdq(model, sigmoid[0].output[0], 1 / 255, 0)
        sigmoid[0].input[0] = conv_q[-1].output[0]
        mul[0].input[0], mul[0].input[1] = conv_q[-1].output[0], sigmoid_q[-1].output[0]
        added[conv.name or out] = conv_q
        added[sigmoid[0].name or sigmoid[0].output[0]] = sigmoid_q
    nodes = [m for n in model.graph.node for m in (n, *added.get(n.name or n.output[0], ()))]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return len(added) // 2


def _qdq(model: onnx.ModelProto, tensor: str, scale: float, zero: int) -> list[onnx.NodeProto]:
    """A QuantizeLinear / DequantizeLinear pair on ``tensor`` (uint8, per tensor)."""
    base = tensor.strip("/").replace("/", "_") + "_ort"
    s = _constant(model, base + "_scale", np.array(scale, np.float32))
    z = _constant(model, base + "_zero_point", np.array(zero, np.uint8))
    return [helper.make_node("QuantizeLinear", [tensor, s, z], [base + "_q"], name=base + "_Q"),
            helper.make_node("DequantizeLinear", [base + "_q", s, z], [base + "_dq"], name=base + "_DQ")]
