"""The derived placement (ort_from_qat_graph.py) with its weights stored so that ONNX Runtime's fused kernels compute
them exactly. On x86 without VNNI, ONNX Runtime's kernel for uint8 activations x int8 weights adds pairs of
products in 16-bit integers (vpmaddubsw) and saturates: with activations around the zero point 128 and weights
reaching +-127 a pair reaches 64,770, and the fused QLinearConv outputs were off by up to ~100 steps. Stored as uint8
with zero point 128 (q_u8 = q_s8 + 128: the same integer grid, exactly) the weights go to its u8u8 kernel, which
widens before it multiplies. ``--7bit``: the weights requantized to [-64, 63] at twice the scale instead (ONNX
Runtime's own ``reduce_range``), which keeps the faster u8s8 kernel and loses a bit of weight precision. An
experiment for ../cpu-ort-placement-2core.md, not a toolkit export.

    python3 fix_weights.py DERIVED.onnx OUT.onnx [--7bit]
"""
import sys

import numpy as np
import onnx
from onnx import numpy_helper

model = onnx.load(sys.argv[1])
seven = "--7bit" in sys.argv
g = model.graph
init = {i.name: i for i in g.initializer}
consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}


def proto(name):
    return init[name] if name in init else consts[name].attribute[0].t


def get(name):
    return numpy_helper.to_array(proto(name))


def put(name, array):
    proto(name).CopyFrom(numpy_helper.from_array(array, name))


done = 0
for n in g.node:
    if n.op_type != "DequantizeLinear" or not (n.input[0] in init or n.input[0] in consts):
        continue
    w = get(n.input[0])
    if w.dtype != np.int8:
        continue
    z = get(n.input[2]) if len(n.input) > 2 else np.zeros(1, np.int8)
    assert not z.any(), "symmetric weights expected"
    if seven:
        put(n.input[0], np.clip(np.round(w.astype(np.float32) / 2), -64, 63).astype(np.int8))  # halves to even
        put(n.input[1], (get(n.input[1]).astype(np.float32) * 2).astype(np.float32))
    else:
        put(n.input[0], (w.astype(np.int16) + 128).astype(np.uint8))
        put(n.input[2], np.full(z.shape, 128, np.uint8))
    done += 1
onnx.checker.check_model(model)
onnx.save(model, sys.argv[2])
print(f"{done} weight tensors rewritten ({'7-bit int8' if seven else 'uint8, zero point 128'})")
