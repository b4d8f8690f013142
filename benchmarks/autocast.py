"""FP16 for TensorRT 11 with NVIDIA ModelOpt AutoCast: the FP16+INT8 graph against the FP32+INT8 graph.

For a quantized checkpoint it exports the Q/DQ ONNX twice, as ``export_qat.py --dynamic --simplify`` does,
without and with ``--half`` (ModelOpt AutoCast, ``utils.qat.onnx.onnx_export.to_fp16``), and reports for each:
the ONNX Runtime mAP on the dataset's val split (the same evaluator as ``val_trt.py``), the Q/DQ lint,
which nodes feed every Conv (``onnx_lint.conv_feeds``), the Q/DQ scale types, the opset, how many nodes
compute in FP16 and the Casts left. Writes OUT/autocast.json and OUT/autocast.md.

Run from the top of a patched YOLOv9 tree:

    python3 /path/to/yolov9-qat/benchmarks/autocast.py --weights runs/qat/exp/weights/qat_best.pt \\
        --data data/coco.yaml --imgsz 640 --out runs/benchmark/autocast

ONNX Runtime on the CPU runs FP16 operators it has no FP16 kernel for in FP32 between Casts it inserts
itself, so the FP16 graph's numbers include FP16 rounding at every tensor the graph stores in FP16, not
FP16 arithmetic inside the kernels (TensorRT's FP16 kernels accumulate in FP32 too).

``--diagnose`` (detection models) also scores, to tell what moves the difference: AutoCast keeping Q/DQ in FP32
(``op_types_to_exclude``: FP32 scales, Casts between DQ and Conv), and the FP32+INT8 graph with only its Q/DQ
scales changed, rounded to FP16 values or multiplied by 1 + u (u uniform in +-2^-11, FP16's relative
precision) for each ``--seeds`` value. The old converter (``to_half``) is in git history
(utils/qat/onnx/onnx_export.py before this benchmark was added).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

import onnx  # noqa: E402
import onnxruntime  # noqa: E402
import torch  # noqa: E402

from utils.qat import __version__  # noqa: E402
from utils.qat.model import checkpoint  # noqa: E402
from utils.qat.onnx import onnx_lint  # noqa: E402
from utils.qat.run import reports  # noqa: E402
from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.evaluation.backends import ORTBackend  # noqa: E402
from utils.qat.evaluation.data import load_data_yaml  # noqa: E402
from utils.qat.evaluation.evaluate import evaluate  # noqa: E402
from utils.qat.onnx.onnx_export import export_onnx, load_for_export  # noqa: E402
from utils.qat.core.errors import run_cli  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402

VARIANTS = (("FP32+INT8", False), ("FP16+INT8 (AutoCast)", True))


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, help="quantized checkpoint (qat.py / segment/qat_seg.py)")
    add_trust_flag(p)
    p.add_argument("--data", required=True, help="dataset yaml (its val split is scored)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-image", type=int, default=None, help="score the first N val images only")
    p.add_argument("--out", required=True, help="folder for autocast.json / autocast.md and the two ONNX files")
    p.add_argument("--diagnose", action="store_true", help="also the Q/DQ-FP32 AutoCast and scale perturbations")
    p.add_argument("--seeds", default="1,2", help="seeds of the random scale perturbations (default 1,2)")
    return p


def diagnose(fp32: Path, out: Path, data: dict, args: argparse.Namespace) -> dict:
    """mAP50-95 of the diagnostic graphs (see the module docstring), by name."""
    import numpy as np
    from onnx import numpy_helper

    from modelopt.onnx.autocast import convert_to_mixed_precision

    def score(model: onnx.ModelProto, name: str) -> float:
        path = out / f"diagnose-{name}.onnx"
        onnx.save(model, str(path))
        m = evaluate(ORTBackend(path, "cpu"), data, imgsz=args.imgsz, batch_size=args.batch_size,
                     workers=args.workers, num_images=args.num_image, desc=name)
        return round(float(m.mAP50_95), 6)

    def scaled(fn) -> onnx.ModelProto:
        m = onnx.load(str(fp32))
        inits = {t.name: t for t in m.graph.initializer}
        for name in sorted({n.input[1] for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}):
            t = inits[name]
            t.CopyFrom(numpy_helper.from_array(fn(numpy_helper.to_array(t).astype(np.float32)), name))
        return m

    npz = out / "diagnose-inputs.npz"
    np.savez(npz, images=np.random.default_rng(0).random((1, 3, args.imgsz, args.imgsz), dtype=np.float32))
    res = {"autocast_qdq_fp32": score(convert_to_mixed_precision(
        str(fp32), "fp16", keep_io_types=True, calibration_data=str(npz),
        op_types_to_exclude=["QuantizeLinear", "DequantizeLinear"]), "autocast_qdq_fp32")}
    res["fp16round_0"] = score(scaled(lambda a: a.astype(np.float16).astype(np.float32)), "fp16round")
    for seed in (int(x) for x in args.seeds.split(",") if x):
        rng = np.random.default_rng(seed)
        res[f"random_{seed}"] = score(scaled(lambda a: (a * (1 + rng.uniform(-2 ** -11, 2 ** -11, a.shape)))
                                             .astype(np.float32)), f"random{seed}")
    return res


def graph_facts(path: Path, allow_fp: list[str]) -> dict:
    """Lint, Conv feeds, scale types, opset, FP16 share and Casts of one exported graph."""
    from utils.qat.onnx.onnx_export import module_to_onnx_pattern
    m = onnx.load(str(path))
    inits = {t.name: t for t in m.graph.initializer}
    scale_types: Counter[str] = Counter()
    for n in m.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] in inits:
            scale_types[onnx.TensorProto.DataType.Name(inits[n.input[1]].data_type)] += 1
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update({o.name: o.type.tensor_type.elem_type for o in m.graph.output})
    float_nodes = [n for n in m.graph.node if n.output and types.get(n.output[0]) in (1, 10)]
    fp16 = sum(1 for n in float_nodes if types.get(n.output[0]) == 10)
    patterns = tuple(onnx_lint.DEFAULT_ALLOW_FP) + tuple(module_to_onnx_pattern(p) for p in allow_fp)
    lint = onnx_lint.lint(m, allow_fp=patterns)
    return {
        "opset": next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")),
        "lint": onnx_lint.format_lint(lint),
        "lint_findings": lint["total"],
        "conv_feeds": onnx_lint.conv_feeds(m),
        "qdq_scale_types": dict(scale_types),
        "float_nodes": len(float_nodes),
        "fp16_nodes": fp16,
        "casts": sum(1 for n in m.graph.node if n.op_type == "Cast"),
        "size_mb": round(path.stat().st_size / 1e6, 2),
    }


def main(args: argparse.Namespace) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint.read(args.weights, trust=args.trust_weights)
    model, task, quantized, fp_patterns = load_for_export(args.weights, ckpt)
    if not quantized:
        raise SystemExit(f"error: {args.weights} is not quantized; pass a qat.py checkpoint.")
    data = load_data_yaml(args.data, splits=("val",))
    stem = Path(args.weights).stem
    rows, results = [], {}
    for name, half in VARIANTS:
        path = out / f"{stem}-{'fp16' if half else 'fp32'}.onnx"
        t0 = time.time()
        rep = export_onnx(model, path, imgsz=args.imgsz, dynamic=True, simplify=True, half=half, task=task,
                          allow_fp=fp_patterns)
        export_s = time.time() - t0
        facts = graph_facts(path, fp_patterns)
        backend = ORTBackend(path, "cpu")
        t0 = time.time()
        m = evaluate(backend, data, task=task, imgsz=args.imgsz, batch_size=args.batch_size, workers=args.workers,
                     num_images=args.num_image, desc=f"ORT {name}")
        eval_s = time.time() - t0
        row = reports.entry(name, path, m, eval_s)
        rows.append(row)
        exact = {"mAP50_95": round(float(m.mAP50_95), 6), "mAP50": round(float(m.mAP50), 6)}
        if task == "segment":
            exact = {f"{k}_{g}": round(float(getattr(getattr(m, g), k)), 6) for g in ("box", "mask")
                     for k in ("mAP50_95", "mAP50")}
        results[name] = {**facts, "metrics": exact, "row": row, "export_seconds": round(export_s, 1),
                         "eval_seconds": round(eval_s, 1), "export_opset": rep["opset"]}
        print(f"{name}: {exact}  lint: {facts['lint']}  conv inputs: {facts['conv_feeds']['input']}")
    diag = diagnose(out / f"{stem}-fp32.onnx", out, data, args) if args.diagnose and task == "detect" else None
    a, b = (results[n]["metrics"] for n, _ in VARIANTS)
    delta = {k: round(b[k] - a[k], 6) for k in a}
    doc = {"weights": str(args.weights), "task": task, "imgsz": args.imgsz, "data": str(args.data),
           "images": m.images, "variants": results, "delta_fp16_minus_fp32": delta, "diagnose": diag,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                       "modelopt": _version("nvidia-modelopt"), "yolov9_qat": __version__}}
    write_text(out / "autocast.json", json.dumps(doc, indent=2) + "\n")
    write_text(out / "autocast.md", render(doc, rows))
    print(render(doc, rows))
    return doc


def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def render(doc: dict, rows: list[dict]) -> str:
    lines = [f"## AutoCast FP16+INT8 vs FP32+INT8: {Path(doc['weights']).name} ({doc['task']}, {doc['imgsz']} px, "
             f"{doc['images']} images, ONNX Runtime CPU)", "", reports.table(rows), "",
             "| graph | opset | lint | Conv inputs | Conv weights | Q/DQ scales | FP16 nodes | Casts |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in doc["variants"].items():
        feeds = {k: "; ".join(f"{p}: {c}" for p, c in v["conv_feeds"][k].items()) for k in ("input", "weight")}
        scales = ", ".join(f"{k} {c}" for k, c in v["qdq_scale_types"].items())
        lines.append(f"| {name} | {v['opset']} | {'clean' if not v['lint_findings'] else v['lint']} | "
                     f"{feeds['input']} | {feeds['weight']} | {scales} | {v['fp16_nodes']}/{v['float_nodes']} | "
                     f"{v['casts']} |")
    delta = ", ".join(f"{k} {d:+.5f}" for k, d in doc["delta_fp16_minus_fp32"].items())
    lines += ["", f"FP16+INT8 minus FP32+INT8: {delta}", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
