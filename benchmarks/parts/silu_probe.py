"""Where does a runtime's arithmetic part from qat.py's? One quantized convolution and its SiLU, as export_qat.py
writes them (input per tensor, int8 weights per output channel, bias), at the extremes of the INT8 range, computed by
each runtime and compared element by element with the exact arithmetic qat.py scores with: the codes' integer sum,
scaled once in float32, the bias, the sigmoid in float64 rounded once (utils/qat/quantize/integer_conv.py).

    python3 benchmarks/diagnose.py silu-probe --out runs/silu-probe --label amd-epyc

Runtimes: ONNX Runtime as val_trt.py runs a Q/DQ graph (integer arithmetic), ONNX Runtime running the file as it is
(float convolutions), and OpenVINO (f32 outside INT8) where it is installed. For each, how many of the convolution's
outputs and of the SiLU's differ from the exact ones, and by how many float32 steps at most (among SiLU outputs above
0.001: the smaller ones sit far inside any quantizer's zero step). Writes OUT/LABEL.json and OUT/LABEL.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library, from this checkout: no tree needed
from utils.qat.core.atomic import write_text  # noqa: E402

from parts import portable  # noqa: E402

CIN, COUT, K, SIZE = 64, 8, 3, 12  # a bound of 64 x 9 x 127 x 128 < 2**24: PyTorch's float32 sums are exact too
VISIBLE = 1e-3  # SiLU outputs smaller than this sit far inside a quantizer's zero step: not counted in the steps


def probe_graph(scale: float, weights: np.ndarray, weight_scale: np.ndarray, bias: np.ndarray | None,
                quantized: bool = True):
    """x -> Q/DQ (per tensor, int8 zero point 0) -> Conv (DQ'd int8 weights per channel, bias) -> c -> SiLU -> y, as
    export_qat.py writes a YOLOv9 convolution; ``quantized=False``: the same convolution in float, no Q/DQ."""
    from onnx import TensorProto, helper, numpy_helper
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(weights, "w"),
             numpy_helper.from_array(weight_scale, "ws"),
             numpy_helper.from_array(np.zeros(len(weight_scale), np.int8), "wz")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0)]
    conv_in = ["xd", "wd"]
    if not quantized:
        inits = [numpy_helper.from_array(weights.astype(np.float32) * weight_scale.reshape(-1, 1, 1, 1), "wf")]
        nodes, conv_in = [], ["x", "wf"]
    if bias is not None:
        inits.append(numpy_helper.from_array(bias, "b"))
        conv_in.append("b")
    nodes += [helper.make_node("Conv", conv_in, ["c"], pads=[1, 1, 1, 1], name="conv"),
              helper.make_node("Sigmoid", ["c"], ["sig"]),
              helper.make_node("Mul", ["c", "sig"], ["y"])]
    graph = helper.make_graph(nodes, "silu-probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CIN, SIZE, SIZE])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, COUT, SIZE, SIZE])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def extreme_inputs(rng: np.random.Generator) -> tuple:
    """(scale, weights, weight scales, bias, input): weights of every code from -127 to 127 with a full first tap,
    inputs over the whole INT8 range with a corner of -128 codes, so that the sums reach their bound (where 16-bit
    pair sums would saturate)."""
    scale = 0.05
    w = rng.integers(-127, 128, (COUT, CIN, K, K)).astype(np.int8)
    w[:, :, 0, 0] = -127
    ws = rng.uniform(0.001, 0.01, COUT).astype(np.float32)
    x = rng.uniform(-128 * scale, 127 * scale, (1, CIN, SIZE, SIZE)).astype(np.float32)
    x[..., :4, :4] = -128 * scale
    return scale, w, ws, rng.normal(0, 1, COUT).astype(np.float32), x


def exact_arithmetic(scale: float, w: np.ndarray, ws: np.ndarray, b: np.ndarray | None,
                     x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(convolution, SiLU) in the arithmetic qat.py scores with, in numpy: the codes' exact int64 sum, scaled once in
    float32, the bias; the SiLU's sigmoid computed in float64 as ``1 / (1 + exp(-x))`` and rounded once."""
    q = np.clip(np.rint(x / np.float32(scale)), -128, 127).astype(np.int64)
    cols = np.pad(q, ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(cols, (K, K), axis=(2, 3))  # n, c, h, w, kh, kw
    acc = np.einsum("nchwij,ocij->nohw", windows, w.astype(np.int64))
    c = acc.astype(np.float32) * (np.float32(scale) * ws).reshape(1, -1, 1, 1)
    if b is not None:
        c = c + b.reshape(1, -1, 1, 1)
    return c, c * (1 / (1 + np.exp(-c.astype(np.float64)))).astype(np.float32)


def _steps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """How many float32 steps apart each pair is (signs alike; a sign change counts as large)."""
    a, b = (v.astype(np.float32).view(np.int32).astype(np.int64) for v in (got, want))
    return np.where(np.sign(got) == np.sign(want), np.abs(a - b), 2**31)


def _runtimes(model) -> dict:
    """Each runtime's (convolution, SiLU) outputs as a function of the input."""
    import onnx
    import onnxruntime as ort

    from utils.qat.onnx.integer_graph import integer_arithmetic
    from onnx import helper
    model.graph.output.append(helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, None))
    integer = onnx.ModelProto()
    integer.CopyFrom(model)
    integer_arithmetic(integer)

    def ort_run(m):
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return lambda x: session.run(["c", "y"], {"x": x})

    runs = {"ONNX Runtime, integer (val_trt.py)": ort_run(integer), "ONNX Runtime, float (the file)": ort_run(model)}
    try:
        import openvino  # noqa: F401
    except ImportError:
        return runs
    import tempfile

    from utils.qat.evaluation.openvino_core import shared_core
    core = shared_core()
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(model, f"{tmp}/probe.onnx")
        compiled = core.compile_model(core.read_model(f"{tmp}/probe.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    request = compiled.create_infer_request()

    def ov_run(x):
        request.infer({"x": x})
        outs = {o.get_any_name(): request.get_tensor(o).data.copy() for o in compiled.outputs}
        return outs["c"], outs["y"]
    runs["OpenVINO, f32"] = ov_run
    return runs


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=4, help="probe inputs drawn (default %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="folder of LABEL.json and LABEL.md")
    p.add_argument("--label", default="silu-probe", help="name of the result files (default: %(default)s)")
    return p


def main(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation.cpu_bench import cpu_info
    rows: dict[str, dict] = {}
    for seed in range(args.seeds):
        scale, w, ws, b, x = extreme_inputs(np.random.default_rng(seed))
        conv, silu = exact_arithmetic(scale, w, ws, b, x)
        for name, run in _runtimes(probe_graph(scale, w, ws, b)).items():
            c, y = run(x)
            r = rows.setdefault(name, {"outputs": 0, "conv_off": 0, "silu_off": 0, "silu_max_steps": 0})
            r["outputs"] += conv.size
            r["conv_off"] += int((c != conv).sum())
            r["silu_off"] += int((y != silu).sum())
            seen = np.abs(silu) > VISIBLE
            r["silu_max_steps"] = max(r["silu_max_steps"], int(_steps(y[seen], silu[seen]).max()))
    doc = {"label": args.label, "command": portable.command(work=args.out), "cpu": cpu_info()["model"],
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seeds": args.seeds, "runtimes": rows}
    lines = [f"# {args.label}: one quantized convolution and its SiLU against the exact arithmetic", "",
             f"Made by `{doc['command']}` on an {doc['cpu']}, {doc['date']}: {args.seeds} probe inputs, each output "
             "compared with the exact arithmetic.", "",
             "| runtime | convolution outputs off | SiLU outputs off | "
             f"most float32 steps off (SiLU above {VISIBLE}) |",
             "|---|---|---|---|"]
    lines += [f"| {n} | {r['conv_off']} / {r['outputs']} | {r['silu_off']} / {r['outputs']} | {r['silu_max_steps']} |"
              for n, r in rows.items()]
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / f"{args.label}.json", json.dumps(doc, indent=2))
    write_text(args.out / f"{args.label}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return doc
