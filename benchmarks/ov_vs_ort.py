"""OpenVINO against ONNX Runtime on one Q/DQ graph, tensor by tensor: where their INT8 codes part.

Every tensor the graph quantizes (each QuantizeLinear's activation input) becomes an output of a probe copy of the
graph; both runtimes run it on the same letterboxed images, and each tensor is compared in units of its own
quantization step: the share of elements whose 8-bit code differs by one step or more, by two or more, and the
largest difference. ONNX Runtime computes the graph as written, in float between the Q/DQ pairs; OpenVINO in
integers with the scales folded in, so the two round a value that sits on a step's boundary differently, and a
flip grows through the layers after it. The final outputs of the unchanged graph are compared too (OpenVINO fuses
differently when inner tensors are outputs). README "Deploying on CPUs" reads this report.

    python3 benchmarks/ov_vs_ort.py qat_best.onnx --images data/coco/images/val2017 --num-image 2 --out ov-vs-ort.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.onnx.onnx_qdq import QDQGraph  # noqa: E402


def quantized_tensors(model) -> list[dict]:
    """Each activation tensor a QuantizeLinear quantizes with one scale, in graph order: name, scale, zero point
    and the code's range."""
    g = QDQGraph(model)
    out, seen = [], set()
    for n in g.nodes:
        if n.op_type != "QuantizeLinear" or n.input[0] in g.constant or n.input[0] in seen:
            continue
        scale = g.value(n.input[1])
        zero = g.value(n.input[2]) if len(n.input) > 2 else None
        if scale is None or scale.size != 1:
            continue
        seen.add(n.input[0])
        unsigned = zero is not None and zero.dtype == np.uint8
        out.append({"tensor": n.input[0], "scale": float(scale), "zero_point": int(zero) if zero is not None else 0,
                    "range": (0, 255) if unsigned else (-128, 127)})
    return out


def letterbox(path: Path, imgsz: int) -> np.ndarray:
    """One image, the same for both runtimes: resized to fit imgsz, padded below and to the right with 114 to a
    square, RGB, NCHW float in [0, 1]."""
    import cv2
    im = cv2.imread(str(path))
    if im is None:
        raise QATError(f"cannot read {path} as an image.")
    r = imgsz / max(im.shape[:2])
    im = cv2.resize(im, (round(im.shape[1] * r), round(im.shape[0] * r)), interpolation=cv2.INTER_LINEAR)
    canvas = np.full((imgsz, imgsz, 3), 114, np.uint8)
    canvas[:im.shape[0], :im.shape[1]] = im
    return np.ascontiguousarray(canvas[:, :, ::-1].transpose(2, 0, 1)[None], dtype=np.float32) / 255


def _ort(path: Path, images: list[np.ndarray], threads: int) -> tuple[list[str], list[dict]]:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feed = session.get_inputs()[0].name
    return names, [dict(zip(names, session.run(None, {feed: x}))) for x in images]


def _openvino(path: Path, images: list[np.ndarray], names: list[str], threads: int) -> list[dict]:
    from utils.qat.evaluation.openvino_core import shared_core
    core = shared_core()
    model = core.read_model(str(path))
    model.reshape({model.inputs[0].get_any_name(): list(images[0].shape)})
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads})
    results = []
    for x in images:
        res = compiled({0: x})
        by_name = {nm: res[o] for o in compiled.outputs for nm in o.get_names()}
        results.append({n: by_name.get(n) for n in names})
    return results


def compare(graph: Path, images: list[np.ndarray], threads: int) -> dict:
    """The report: per quantized tensor the share of codes differing by >= 1 and >= 2 steps and the largest
    difference (means over the images), and the unchanged graph's final outputs' largest and mean differences."""
    import onnx
    from onnx import TensorProto, helper
    model = onnx.load(str(graph))
    tensors = quantized_tensors(model)
    if not tensors:
        raise QATError(f"{graph} has no QuantizeLinear on an activation: compare a Q/DQ graph (export_qat.py).")
    finals = [o.name for o in model.graph.output]
    model.graph.output.extend([helper.make_tensor_value_info(t["tensor"], TensorProto.FLOAT, None) for t in tensors])
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.onnx"
        onnx.save(model, str(probe))
        names, ref = _ort(probe, images, threads)
        got = _openvino(probe, images, names, threads)
    plain = _openvino(graph, images, finals, threads)
    rows = []
    for t in tensors:
        lo, hi = t["range"]
        one = two = worst = 0.0
        for r, g in zip(ref, got):
            a, b = r[t["tensor"]], g[t["tensor"]]
            if b is None:  # OpenVINO did not keep this tensor under its name
                one = two = worst = float("nan")
                break
            qa = np.clip(np.rint(a / t["scale"]) + t["zero_point"], lo, hi)
            qb = np.clip(np.rint(b / t["scale"]) + t["zero_point"], lo, hi)
            d = np.abs(qa - qb)
            one += float((d >= 1).mean()) / len(images)
            two += float((d >= 2).mean()) / len(images)
            worst = max(worst, float(d.max()))
        rows.append({"tensor": t["tensor"], "scale": t["scale"], "codes_1_step": round(one, 6),
                     "codes_2_steps": round(two, 6), "max_steps": worst})
    outputs = {f: {"max_abs": max(float(np.abs(r[f]).max()) for r in ref),
                   "max_diff": max(float(np.abs(r[f] - p[f]).max()) for r, p in zip(ref, plain)),
                   "mean_diff": float(np.mean([np.abs(r[f] - p[f]).mean() for r, p in zip(ref, plain)]))}
               for f in finals}
    return {"graph": str(graph), "images": len(images), "threads": threads, "outputs": outputs, "tensors": rows}


def table(report: dict) -> str:
    lines = [f"{report['graph']}: {len(report['tensors'])} quantized tensors, {report['images']} images",
             "", "| output | max abs | max diff | mean diff |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['max_abs']:.4g} | {v['max_diff']:.4g} | {v['mean_diff']:.4g} |"
              for k, v in report["outputs"].items()]
    lines += ["", "| # | tensor | codes >= 1 step apart | >= 2 steps | max steps |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {i} | `{r['tensor']}` | {r['codes_1_step']:.5f} | {r['codes_2_steps']:.5f} | {r['max_steps']:g} |"
              for i, r in enumerate(report["tensors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("graph", type=Path, help="a Q/DQ ONNX graph (export_qat.py)")
    p.add_argument("--images", type=Path, required=True, help="a folder of images (.jpg/.png), taken in name order")
    p.add_argument("--num-image", type=int, default=2)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--threads", type=int, default=0, help="threads for both runtimes (0: one per core)")
    p.add_argument("--out", type=Path, help="also write the report here as JSON, and the table beside it (.md)")
    args = p.parse_args(argv)
    if not args.graph.is_file():
        raise QATError(f"{args.graph} not found: pass a Q/DQ ONNX graph written by export_qat.py.")
    files = sorted(f for f in args.images.glob("*") if f.suffix.lower() in (".jpg", ".jpeg", ".png"))[:args.num_image]
    if not files:
        raise QATError(f"no .jpg/.png images in {args.images}: pass a folder of images with --images.")
    try:
        import openvino  # noqa: F401
    except ImportError as e:
        raise QATError(f"OpenVINO is not installed ({e}); install it with ./install_dependencies.sh --openvino.") from e
    report = compare(args.graph, [letterbox(f, args.imgsz) for f in files], args.threads or (os.cpu_count() or 1))
    text = table(report)
    print(text, end="")
    if args.out:
        write_text(args.out, json.dumps(report, indent=1) + "\n")
        write_text(args.out.with_suffix(".md"), text)


if __name__ == "__main__":
    run_cli(main)
