"""The Q/DQ graph re-encoded for OpenVINO on x86 CPUs without VNNI or AMX (``export_qat.py --openvino-avx2``).

    counts = reencode(model)   # in place: {"weights": n, "activations": m}

On such CPUs (AVX2 alone: AMD up to Zen 3, Intel before Cascade Lake and Ice Lake) OpenVINO's INT8 convolutions
multiply unsigned 8-bit activations by signed 8-bit weights and add each pair of products into a 16-bit sum
(``vpmaddubsw``), which saturates: the graph export_qat.py writes for TensorRT then scores mAP50-95 near 0 there
(docs/CPU.md, "Deploying on CPUs"). Two changes give a graph those kernels compute as written:

- every weight on 7 bits: ``q7 = round(q / 2)`` clipped to [-63, 63] and its scale doubled (the same values to
  within one 8-bit step), so that a pair of products stays below 2^15 (2 x 255 x 63 = 32130);
- every activation Q/DQ pair as uint8 with zero point 128: the same grid of values, shifted. With int8
  activations the result on these CPUs was wrong past a Concat that feeds a convolution (YOLOv9-t's first ELAN1),
  7-bit weights or not; as uint8 it matches ONNX Runtime to rounding flips.

The first halves the weights' resolution, which QAT did not see: it costs accuracy (measured in docs/CPU.md).
The TensorRT graph is left as it is; this is a second file for those CPUs.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from utils.qat.core.artifact import read_props, write_props
from utils.qat.core.errors import QATError
from utils.qat.onnx.onnx_qdq import QDQGraph

#: ONNX metadata marking a re-encoded graph (OpenVINOBackend then knows it runs right on these CPUs).
ENCODING_KEY, AVX2_ENCODING = "encoding", "openvino-avx2"
WEIGHT_MAX = 63  # 7-bit weights: |q| <= 63
ZERO_POINT = 128  # uint8 activations on the int8 grid


def set_constant(g: QDQGraph, name: str, value: np.ndarray) -> None:
    """Replace the constant ``name`` (an initializer or a ``Constant`` node's tensor) in place."""
    tensor = g.init[name] if name in g.init else next(a.t for a in g.const_nodes[name].attribute if a.name == "value")
    tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))


def weight_dequantizers(g: QDQGraph) -> list[onnx.NodeProto]:
    """The DequantizeLinear nodes of the int8 weights held in the graph (each weight and scale used once)."""
    found = []
    for n in g.nodes:
        data = n.input[0] if n.op_type == "DequantizeLinear" else None
        if data in g.init or data in g.const_nodes:  # a weight: its int8 data held in the graph
            q = g.value(data)
            if q is None or q.dtype != np.int8:
                continue
            if len(g.consumers[data]) != 1 or len(g.consumers[n.input[1]]) != 1:
                raise QATError(f"{n.name}: its weight or scale is shared with other nodes, which export_qat.py "
                               "never writes; export the graph again with export_qat.py.")
            found.append(n)
    return found


def seven_bit_weights(g: QDQGraph, dequantizers: list[onnx.NodeProto]) -> None:
    """Each weight requantized to 7 bits: ``round(q / 2)`` clipped to [-63, 63], its scale doubled."""
    for n in dequantizers:
        q, scale = g.value(n.input[0]), g.value(n.input[1])
        set_constant(g, n.input[0], np.clip(np.round(q.astype(np.float32) / 2), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8))
        set_constant(g, n.input[1], (scale * 2).astype(scale.dtype))


def uint8_activations(g: QDQGraph, flag: str) -> int:
    """Every activation Q/DQ pair's zero point from int8 0 to uint8 128 (the same grid, shifted); returns the
    number of QuantizeLinear nodes. ``flag`` names the export option in the error for a graph it cannot take."""
    zero_points: set[str] = set()
    activations = 0
    for n in g.nodes:
        data = n.input[0] if n.op_type == "DequantizeLinear" else None
        if data in g.init or data in g.const_nodes:
            continue  # a weight
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2:
            zero_points.add(n.input[2])
            activations += n.op_type == "QuantizeLinear"
    for name in zero_points:
        z = g.value(name)
        if z is None or z.dtype != np.int8 or z.any():
            raise QATError(f"zero point {name} is not the int8 0 export_qat.py writes; {flag} cannot re-encode this "
                           "graph (export it again with export_qat.py).")
        set_constant(g, name, np.full(z.shape, ZERO_POINT, np.uint8))
    return activations


def forget_quantized_types(model: onnx.ModelProto) -> None:
    """Drop the recorded types of QuantizeLinear outputs (they were int8)."""
    quantized = {o for n in model.graph.node if n.op_type == "QuantizeLinear" for o in n.output}
    kept = [v for v in model.graph.value_info if v.name not in quantized]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def reencode(model: onnx.ModelProto) -> dict[str, int]:
    """Re-encode ``model`` (a Q/DQ graph from export_qat.py) in place for OpenVINO on CPUs without VNNI or AMX;
    returns how many weight tensors and activation quantizers were changed."""
    g = QDQGraph(model)
    dequantizers = weight_dequantizers(g)
    activations = uint8_activations(g, "--openvino-avx2")
    if not dequantizers or not activations:
        raise QATError("the graph has no INT8 Q/DQ convolutions to re-encode; --openvino-avx2 needs a quantized "
                       "checkpoint (qat.py quantize).")
    seven_bit_weights(g, dequantizers)
    forget_quantized_types(model)
    write_props(model, {**read_props(model), ENCODING_KEY: AVX2_ENCODING})  # OpenVINOBackend: no notice for it
    return {"weights": len(dequantizers), "activations": activations}
