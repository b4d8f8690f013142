"""A placement ONNX Runtime fuses, derived from the toolkit's TensorRT Q/DQ graph without new calibration: every
activation Q/DQ pair as uint8 around 128 (the same grid; ONNX Runtime's x86 kernels fuse unsigned activations
only), and for each convolution whose SiLU output goes only to QuantizeLinear nodes of one scale, a Q/DQ pair on
the convolution's output (that scale) and on the Sigmoid's output (1/255, zero point 0), so that the convolution,
the Sigmoid and the Mul each see quantized inputs and a quantized output. An experiment for
../cpu-ort-placement-2core.md, not a toolkit export.

    python3 ort_from_qat_graph.py TRT_INT8.onnx OUT.onnx
"""
import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

model = onnx.load(sys.argv[1])
g = model.graph
init = {i.name: i for i in g.initializer}
consts = {n.output[0]: n for n in g.node if n.op_type == "Constant"}


def tensor(name):
    return init[name] if name in init else consts[name].attribute[0].t


def value(name):
    return numpy_helper.to_array(tensor(name)) if name in init or name in consts else None


shifted = 0
for n in g.node:  # activation zero points: int8 0 -> uint8 128
    if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2:
        if n.op_type == "DequantizeLinear" and (n.input[0] in init or n.input[0] in consts):
            continue  # a weight
        z = value(n.input[2])
        if z is not None and z.dtype == np.int8 and z.size == 1 and int(z) == 0:
            tensor(n.input[2]).CopyFrom(numpy_helper.from_array(np.array(128, np.uint8), tensor(n.input[2]).name))
            shifted += 1
users = {}
for n in g.node:
    for i in n.input:
        users.setdefault(i, []).append(n)
inserted, skipped = {}, {}


def qdq(tensor_name, scale, zero, zero_type):
    base = tensor_name.replace("/", "_")
    g.initializer.extend([numpy_helper.from_array(np.array(scale, np.float32), base + "_scale"),
                          numpy_helper.from_array(np.array(zero, zero_type), base + "_zero")])
    return base + "_dq", [
        helper.make_node("QuantizeLinear", [tensor_name, base + "_scale", base + "_zero"], [base + "_q"], name=base + "_Q"),
        helper.make_node("DequantizeLinear", [base + "_q", base + "_scale", base + "_zero"], [base + "_dq"],
                         name=base + "_DQ")]


for conv in list(g.node):
    if conv.op_type != "Conv":
        continue
    out = conv.output[0]
    sig = [u for u in users.get(out, []) if u.op_type == "Sigmoid"]
    mul = [u for u in users.get(out, []) if u.op_type == "Mul"]
    if len(users.get(out, [])) != 2 or len(sig) != 1 or len(mul) != 1:
        skipped["output not a SiLU"] = skipped.get("output not a SiLU", 0) + 1
        continue
    quantizers = users.get(mul[0].output[0], [])
    if not quantizers or any(q.op_type != "QuantizeLinear" for q in quantizers):
        skipped["SiLU output also used unquantized"] = skipped.get("SiLU output also used unquantized", 0) + 1
        continue
    scales = {float(value(q.input[1])) for q in quantizers}
    if len(scales) != 1:
        skipped["SiLU output quantized with several scales"] = skipped.get("SiLU output quantized with several scales", 0) + 1
        continue
    conv_dq, conv_nodes = qdq(out, scales.pop(), 128, np.uint8)
    sig_dq, sig_nodes = qdq(sig[0].output[0], 1 / 255, 0, np.uint8)
    sig[0].input[0] = conv_dq
    mul[0].input[0], mul[0].input[1] = conv_dq, sig_dq
    inserted[id(conv)], inserted[id(sig[0])] = conv_nodes, sig_nodes
nodes = [m for n in g.node for m in [n, *inserted.get(id(n), [])]]
del g.node[:]
g.node.extend(nodes)
onnx.checker.check_model(model)
onnx.save(model, sys.argv[2])
print(f"{shifted} activation zero points made uint8 128; {len(inserted) // 2} SiLU convolutions given an output Q/DQ;"
      f" left as they were: {skipped}")
