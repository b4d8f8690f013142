"""A Q/DQ graph on ONNX Runtime in the arithmetic qat.py scores a quantized model with
(utils/qat/onnx/integer_graph.py): integer convolutions summed exactly and scaled once, the SiLU's sigmoid in float64
rounded once. Here on hand-made graphs at the extremes of the INT8 range; tests/test_qat_cli.py scores a quantize
run's checkpoint and its graph alike to the last digit."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

ort = pytest.importorskip("onnxruntime")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from parts.silu_probe import exact_arithmetic, extreme_inputs, probe_graph  # noqa: E402  (diagnose.py silu-probe)


def _session(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("with_bias", [True, False])
def test_integer_graph_is_the_exact_arithmetic_to_the_bit(with_bias):
    """The rewritten graph's output equals the exact integer arithmetic in every bit, with and without a bias; the
    graph as ONNX Runtime runs it itself (float32 convolutions of the dequantized values) does not."""
    from utils.qat.onnx.integer_graph import integer_arithmetic
    scale, w, ws, b, x = extreme_inputs(np.random.default_rng(0))
    b = b if with_bias else None
    model = probe_graph(scale, w, ws, b)
    plain = _session(model).run(None, {"x": x})[0]
    assert integer_arithmetic(model) == {"convolutions": 1, "pools": 0, "silu": 1}
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node]
    assert "Conv" not in ops and "ConvInteger" in ops and "DequantizeLinear" not in ops  # the float path is gone
    got = _session(model).run(None, {"x": x})[0]
    want = exact_arithmetic(scale, w, ws, b, x)[1]
    assert np.abs(want).max() > 1 and np.array_equal(got, want)
    assert not np.array_equal(plain, want) and np.allclose(plain, want, rtol=1e-5, atol=1e-4)


def test_integer_graph_equals_pytorch_integer_form():
    """The same convolution in PyTorch's integer form (IntegerConv2d and ExactSiLU, as qat.py scores a checkpoint)
    gives the rewritten graph's output in every bit."""
    from utils.qat.onnx.integer_graph import integer_arithmetic
    from utils.qat.quantize.integer_conv import ExactSiLU
    scale, w, ws, b, x = extreme_inputs(np.random.default_rng(1))
    model = probe_graph(scale, w, ws, b)
    integer_arithmetic(model)
    got = _session(model).run(None, {"x": x})[0]
    codes = torch.round(torch.from_numpy(x) / torch.tensor(scale, dtype=torch.float32)).clamp(-128, 127)
    acc = torch.nn.functional.conv2d(codes, torch.from_numpy(w.astype(np.float32)), padding=1)  # below 2**24: exact
    y = acc * (torch.tensor(scale, dtype=torch.float32) * torch.from_numpy(ws).reshape(1, -1, 1, 1))
    y = ExactSiLU()(y + torch.from_numpy(b).reshape(1, -1, 1, 1))
    assert np.array_equal(got, y.numpy())


def test_graphs_without_integer_convolutions_are_left_as_they_are(tmp_path):
    """An FP graph comes out of the rewrite unchanged but for its SiLU, and ORTBackend runs a graph re-encoded for
    a CPU runtime (export_qat.py --onnxruntime-cpu) as the file is: its quantizers sit where that runtime fuses
    them into its own integer kernels."""
    from utils.qat.evaluation.backends import _integer_graph
    from utils.qat.onnx.integer_graph import integer_arithmetic
    from utils.qat.onnx.ort_cpu import place
    scale, w, ws, b, _ = extreme_inputs(np.random.default_rng(2))
    fp = probe_graph(scale, w, ws, b, quantized=False)
    before = [n.op_type for n in fp.graph.node]
    assert integer_arithmetic(fp) == {"convolutions": 0, "pools": 0, "silu": 1}
    assert [n.op_type for n in fp.graph.node] == ["Conv", "Cast", "Neg", "Exp", "Add", "Reciprocal", "Cast", "Mul"]
    assert before == ["Conv", "Sigmoid", "Mul"]
    placed = probe_graph(scale, w, ws, b)
    place(placed)
    path = tmp_path / "placed.onnx"
    onnx.save(placed, str(path))
    assert _integer_graph(path) == str(path)
    qdq = tmp_path / "qdq.onnx"
    onnx.save(probe_graph(scale, w, ws, b), str(qdq))
    assert isinstance(_integer_graph(qdq), bytes)


def test_ort_backend_refuses_an_unknown_arithmetic(tmp_path):
    from utils.qat.core.errors import QATError
    from utils.qat.evaluation.backends import ORTBackend
    path = tmp_path / "g.onnx"
    onnx.save(probe_graph(*extreme_inputs(np.random.default_rng(3))[:4]), str(path))
    with pytest.raises(QATError, match="arithmetic 'fast' is not one of integer, float, basic"):
        ORTBackend(path, arithmetic="fast")


def test_silu_probe_counts_where_each_runtime_parts(tmp_path):
    """benchmarks/diagnose.py silu-probe: val_trt.py's ONNX Runtime arithmetic off the exact one nowhere, the file as
    ONNX Runtime runs it off in most convolution outputs; its table and JSON written."""
    import argparse

    from parts import silu_probe
    doc = silu_probe.main(argparse.Namespace(seeds=1, out=tmp_path, label="probe"))
    runtimes = doc["runtimes"]
    integer, plain = runtimes["ONNX Runtime, integer (val_trt.py)"], runtimes["ONNX Runtime, float (the file)"]
    assert integer["outputs"] == silu_probe.COUT * silu_probe.SIZE ** 2
    assert integer["conv_off"] == integer["silu_off"] == integer["silu_max_steps"] == 0
    assert plain["conv_off"] > integer["outputs"] // 2 and plain["silu_max_steps"] > 0
    assert "| ONNX Runtime, integer (val_trt.py) | 0 / 1152 | 0 / 1152 | 0 |" in (tmp_path / "probe.md").read_text()


def test_an_average_pool_of_codes_is_exact():
    """ADown's 2x2 average pool behind a Q/DQ pair averages the integer codes and scales once (as
    rules.quantized_avg_pool does in PyTorch), in every bit; a 3x3 pool (its division by 9 rounds) is left alone."""
    from onnx import TensorProto, helper, numpy_helper

    from utils.qat.onnx.integer_graph import integer_arithmetic
    scale, x = np.float32(0.037), np.random.default_rng(4).uniform(-5, 5, (1, 4, 9, 9)).astype(np.float32)

    def graph(kernel: int):
        nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
                 helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"]),
                 helper.make_node("AveragePool", ["xd"], ["y"], kernel_shape=[kernel, kernel], strides=[1, 1])]
        inits = [numpy_helper.from_array(np.array(scale), "s"), numpy_helper.from_array(np.array(0, np.int8), "z")]
        g = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    model = graph(2)
    assert integer_arithmetic(model) == {"convolutions": 0, "pools": 1, "silu": 0}
    codes = torch.from_numpy(np.clip(np.rint(x / scale), -128, 127))
    want = (torch.nn.functional.avg_pool2d(codes, 2, 1) * torch.tensor(scale)).numpy()
    assert np.array_equal(_session(model).run(None, {"x": x})[0], want)
    assert integer_arithmetic(graph(3))["pools"] == 0
