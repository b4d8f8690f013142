"""One quantized convolution (uint8 activations around zero point 128, int8 per-channel weights, a QuantizeLinear on
its output so that ONNX Runtime fuses it into QLinearConv), run fused and with graph optimisations off (the Q/DQ
computed in float, exactly): the largest difference of the two, in output quantization steps. On x86 without VNNI
the fused u8s8 kernel saturates 16-bit pair sums; 7-bit weights, or uint8 weights with zero point 128 (the u8u8
kernel), do not. For ../cpu-ort-placement-2core.md.

    python3 saturation_probe.py
"""
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

rng = np.random.default_rng(0)
C = K = 16


def build(wq: np.ndarray, ws: np.ndarray, weight_zero: np.ndarray):
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "xs"),
             numpy_helper.from_array(np.array(128, np.uint8), "xz"),
             numpy_helper.from_array(wq, "wq"), numpy_helper.from_array(ws, "ws"),
             numpy_helper.from_array(weight_zero, "wz"),
             numpy_helper.from_array(np.array(0.5, np.float32), "ys"),
             numpy_helper.from_array(np.array(128, np.uint8), "yz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["wq", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["y"], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["y", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["out"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 32, 32])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def fused_minus_exact(model, x: np.ndarray) -> float:
    out = {}
    for name, level in (("fused", ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
                        ("exact", ort.GraphOptimizationLevel.ORT_DISABLE_ALL)):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        out[name] = session.run(None, {"x": x})[0]
    return float(np.abs(out["fused"] - out["exact"]).max() / 0.5)


x = rng.uniform(1.0, 2.5, (1, C, 32, 32)).astype(np.float32)  # activations stored as uint8 ~178..253
w8 = rng.integers(-127, 128, (K, C, 3, 3)).astype(np.int8)
w7 = rng.integers(-64, 64, (K, C, 3, 3)).astype(np.int8)
s8 = np.full(K, 0.01, np.float32)
print("int8 weights in [-127, 127]:", fused_minus_exact(build(w8, s8, np.zeros(K, np.int8)), x))
print("int8 weights in [-64, 63]:", fused_minus_exact(build(w7, s8 * 2, np.zeros(K, np.int8)), x))
print("uint8 weights, zero point 128:", fused_minus_exact(
    build((w8.astype(np.int16) + 128).astype(np.uint8), s8, np.full(K, 128, np.uint8)), x))
