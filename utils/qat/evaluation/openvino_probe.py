"""Whether OpenVINO computes this toolkit's INT8 graphs as written on this CPU, asked of the CPU itself.

    error = openvino_int8_error()     # relative error of a probe graph against its exact integer result
    if error > EXACT_TOLERANCE: ...   # OpenVINO's INT8 scores here are not the graph's

The CPU's flags answer part of it (``utils.qat.core.device.exact_int8_dot``: without VNNI or AMX OpenVINO's 8-bit
products saturate), but not all: on an AMD EPYC (Zen 4) with AVX512-VNNI, OpenVINO 2026.4.0 and 2026.4.1 compute a
quantized convolution exactly, yet a Concat whose output is quantized before a convolution, as in every YOLOv9
block, comes out several percent off (8% for this probe), and the quickstart's INT8 graph scored mAP50-95 0.74
against ONNX Runtime's 0.94.
The probe is that pattern, in the encoding ``export_qat.py`` writes (a per-tensor symmetric INT8 activation, per-channel
INT8 weights): two tensors concatenated, quantized, and a 1x1 convolution, at values over the whole INT8 range (which
saturate where the flags say so). It is compiled once per process, a few milliseconds.
"""
from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: The largest relative error of the probe's output that counts as the graph computed as written (rounding only).
EXACT_TOLERANCE = 1e-4


def _probe_graph(path: Path, channels: int, weights: np.ndarray, scale: float, weight_scale: float) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    both = 2 * channels
    nodes = [helper.make_node("Concat", ["a", "b"], ["x"], axis=1),
             helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd"], ["y"])]
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(weights, "w"),
             numpy_helper.from_array(np.full(both, weight_scale, np.float32), "ws"),
             numpy_helper.from_array(np.zeros(both, np.int8), "wz")]
    shape = [1, channels, 8, 8]
    graph = helper.make_graph(nodes, "openvino-int8-probe",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("a", "b")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, both, 8, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def probe_error(run: Callable[[Path, dict[str, np.ndarray]], np.ndarray], channels: int = 16) -> float:
    """The probe's largest error relative to its largest exact output, as ``run(onnx_path, inputs)`` computes the
    probe graph's output."""
    rng = np.random.default_rng(0)
    scale, weight_scale = 0.05, 0.01
    weights = rng.integers(-127, 128, (2 * channels, 2 * channels, 1, 1)).astype(np.int8)
    a, b = (rng.uniform(-128 * scale, 127 * scale, (1, channels, 8, 8)).astype(np.float32) for _ in range(2))
    q = np.clip(np.rint(np.concatenate([a, b], 1) / np.float32(scale)), -128, 127).astype(np.int64)
    exact = np.einsum("oc,nchw->nohw", weights[:, :, 0, 0].astype(np.int64), q) * (scale * weight_scale)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        _probe_graph(path, channels, weights, scale, weight_scale)
        got = np.asarray(run(path, {"a": a, "b": b}), np.float64)
    return float(np.abs(got - exact).max() / np.abs(exact).max())


def _openvino(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The graph's first output from OpenVINO's CPU plugin, what is not INT8 in f32 (as ``OpenVINOBackend`` runs it)."""
    from utils.qat.evaluation.openvino_core import shared_core
    core = shared_core()
    request = core.compile_model(core.read_model(str(path)), "CPU",
                                 {"INFERENCE_PRECISION_HINT": "f32"}).create_infer_request()
    request.infer(inputs)
    return request.get_output_tensor(0).data.copy()


@functools.lru_cache(maxsize=None)
def openvino_int8_error() -> float:
    """:func:`probe_error` on OpenVINO, once per process. Needs ``openvino`` and ``onnx``."""
    return probe_error(_openvino)


def openvino_int8_exact() -> bool:
    """Whether OpenVINO computes the probe as written here (its error within :data:`EXACT_TOLERANCE`)."""
    return openvino_int8_error() <= EXACT_TOLERANCE
