"""The Q/DQ graph re-encoded for OpenVINO on x86 CPUs without VNNI or AMX (``export_qat.py --openvino-avx2``).

    counts = reencode(model)   # in place: {"weights": n, "activations": m}

On such CPUs (AVX2 alone: AMD up to Zen 3, Intel before Cascade Lake and Ice Lake) OpenVINO's INT8 convolutions
multiply unsigned 8-bit activations by signed 8-bit weights and add each pair of products into a 16-bit sum
(``vpmaddubsw``), which saturates: the graph export_qat.py writes for TensorRT then scores mAP50-95 near 0 there
(README "Deploying on CPUs"). Two changes give a graph those kernels compute as written:

- every weight on 7 bits: ``q7 = round(q / 2)`` clipped to [-63, 63] and its scale doubled (the same values to
  within one 8-bit step), so that a pair of products stays below 2^15 (2 x 255 x 63 = 32130);
- every activation Q/DQ pair as uint8 with zero point 128: the same grid of values, shifted. With int8
  activations the result on these CPUs was wrong past a Concat that feeds a convolution (YOLOv9-t's first ELAN1),
  7-bit weights or not; as uint8 it matches ONNX Runtime to rounding flips.

The first halves the weights' resolution, which QAT did not see: it costs accuracy (measured in README "Deploying
on CPUs"). The TensorRT graph is left as it is; this is a second file for those CPUs.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from utils.qat.core.errors import QATError

#: ONNX metadata marking a re-encoded graph (OpenVINOBackend then knows it runs right on these CPUs).
ENCODING_KEY, AVX2_ENCODING = "encoding", "openvino-avx2"
WEIGHT_MAX = 63  # 7-bit weights: |q| <= 63
ZERO_POINT = 128  # uint8 activations on the int8 grid


def _tensors(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers and ``Constant`` outputs (their ``value`` tensor), by name: editable in place."""
    found = {t.name: t for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.output:
            for a in n.attribute:
                if a.name == "value":
                    found[n.output[0]] = a.t
    return found


def _set(tensor: onnx.TensorProto, value: np.ndarray) -> None:
    name = tensor.name
    tensor.CopyFrom(numpy_helper.from_array(value, name))


def reencode(model: onnx.ModelProto) -> dict[str, int]:
    """Re-encode ``model`` (a Q/DQ graph from export_qat.py) in place for OpenVINO on CPUs without VNNI or AMX;
    returns how many weight tensors and activation quantizers were changed."""
    graph = model.graph
    tensors = _tensors(graph)
    uses: dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            uses[name] = uses.get(name, 0) + 1
    weights = activations = 0
    zero_points: set[str] = set()
    for n in graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in tensors:  # a weight: int8 data held in the graph
            q = numpy_helper.to_array(tensors[n.input[0]])
            if q.dtype != np.int8:
                continue
            if uses[n.input[0]] != 1 or uses[n.input[1]] != 1:
                raise QATError(f"{n.name}: its weight or scale is shared with other nodes, which export_qat.py "
                               "never writes; export the graph again with export_qat.py.")
            scale = numpy_helper.to_array(tensors[n.input[1]])
            _set(tensors[n.input[0]], np.clip(np.round(q.astype(np.float32) / 2), -WEIGHT_MAX, WEIGHT_MAX)
                 .astype(np.int8))
            _set(tensors[n.input[1]], (scale * 2).astype(scale.dtype))
            weights += 1
        elif n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2:
            zero_points.add(n.input[2])
            activations += n.op_type == "QuantizeLinear"
    for name in zero_points:
        if name not in tensors:
            raise QATError(f"zero point {name} is not a constant of the graph; export the graph again with "
                           "export_qat.py.")
        z = numpy_helper.to_array(tensors[name])
        if z.dtype != np.int8 or z.any():
            raise QATError(f"zero point {name} is {z.dtype} {z.ravel()[:1]}, not the int8 0 export_qat.py writes; "
                           "this graph is not one to re-encode (export it again with export_qat.py).")
        _set(tensors[name], np.full(z.shape, ZERO_POINT, np.uint8))
    if not weights or not activations:
        raise QATError("the graph has no INT8 Q/DQ convolutions to re-encode; --openvino-avx2 needs a quantized "
                       "checkpoint (qat.py quantize).")
    quantized = {o for n in graph.node if n.op_type == "QuantizeLinear" for o in n.output}
    kept = [v for v in graph.value_info if v.name not in quantized]  # their recorded type was int8
    del graph.value_info[:]
    graph.value_info.extend(kept)
    marks = {p.key: p.value for p in model.metadata_props}
    marks[ENCODING_KEY] = AVX2_ENCODING  # OpenVINOBackend then drops its notice about these CPUs
    del model.metadata_props[:]
    onnx.helper.set_model_props(model, marks)
    return {"weights": weights, "activations": activations}
