"""Deploying on CPUs: FP32 against INT8 ONNX graphs on ONNX Runtime and OpenVINO, their mAP and their speed.

From checkpoints, end to end: each model's FP32 and INT8 ONNX graphs, their mAP on ONNX Runtime
and OpenVINO (the same graph on both: how far OpenVINO's INT8 kernels move the score), and their speed
(``utils/qat/evaluation/cpu_bench.py``: FP32 vs INT8, batch 1 and a throughput batch, the CPU and its instruction
sets, OpenVINO's execution graph of each INT8 graph). Writes OUT/cpu-deploy.json, OUT/cpu-deploy.md and
OUT/cpu-deploy.png, updated after every stage, and the graphs in OUT/NAME/.

Run from the top of a patched YOLOv9 tree (yolov9-t needs one with ELAN1 / AConv):

    python3 /path/to/yolov9-qat/benchmarks/cpu_deploy.py --model c=gelan-c.pt --model t=yolov9-t.pt \\
        --data coco.yaml --imgsz 640 --out runs/benchmark/cpu

``--shared [DIR]``: the tables of docs/CPU.md in one command, from the shared folder (DIR; default YOLOV9_QAT_SHARED,
else ../shared beside this repository): GELAN-C (c) and YOLOv9-t (t) from DIR/weights, each calibrated on coco369,
scored on coco334 (DIR/datasets/coco-qat.yaml, written into OUT with its path: filled in). Later flags still apply,
e.g. --threads 2, --batch 1 4, --no-map, --device cpu:

    python3 /path/to/yolov9-qat/benchmarks/cpu_deploy.py --shared --out runs/cpu-deploy

Each ``--model NAME=FP.pt`` is an FP checkpoint, calibrated here on the first --calib-batches batches of the data's
train split (qat.py quantize --ptq-only, on --device); ``NAME=FP.pt,INT8.pt`` gives its quantized checkpoint (a
qat.py run) instead. Both are exported as ``export_qat.py --dynamic`` does (the one exporter). ``--no-map``
skips the evaluation (then --data is needed only for calibration). OpenVINO runs what is not INT8 in FP32 for
both stages; on x86 CPUs without VNNI or AMX its INT8 convolutions saturate, which the mAP table shows.

``--compare-runtimes GRAPH``: where OpenVINO and ONNX Runtime part on one Q/DQ graph, tensor by tensor. Every tensor
the graph quantizes (each QuantizeLinear's activation input) becomes an output of a probe copy of the graph; both
runtimes run it on the same letterboxed images (the first ``--num-image`` of ``--images``, default 2), and each
tensor is compared in units of its own quantization step: the share of elements whose 8-bit code differs by one step
or more, by two or more, and the largest difference. ONNX Runtime computes the graph as written, in float between the
Q/DQ pairs; OpenVINO in integers with the scales folded in, so the two round a value that sits on a step's boundary
differently, and a flip grows through the layers after it. The final outputs of the unchanged graph are compared too
(OpenVINO fuses differently when inner tensors are outputs). Prints the table; with ``--out``, writes
OUT/ov-vs-ort.json and OUT/ov-vs-ort.md.

    python3 benchmarks/cpu_deploy.py --compare-runtimes qat_best.onnx --images data/coco/images/val2017 \\
        --num-image 2 --out runs/benchmark/ov-vs-ort
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))  # benchmarks/parts/
from utils.qat.core import compat  # noqa: E402

compat.apply()

from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.device import exact_int8_dot  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.core.validate import check_args  # noqa: E402
from utils.qat.evaluation import cpu_bench  # noqa: E402
from utils.qat.evaluation.backends import ONNX_RUNTIMES, RUNTIMES, OpenVINOBackend, ORTBackend  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402
from utils.qat.quantize.config import CALIB_METHODS, DEFAULT_CALIB_METHOD, HEAD_AMAX, DEFAULT_HEAD_AMAX  # noqa: E402

from parts import portable  # noqa: E402

STEM = "cpu-deploy"
#: --shared: docs/CPU.md's models (name -> file in DIR/weights) and the files they need
SHARED_MODELS = {"c": "gelan-c-coco334.pt", "t": "yolov9-t-coco.pt"}
SHARED_FILES = ("datasets/coco-qat.yaml", "datasets/coco334", "datasets/coco369")
COMPARE_STEM = "ov-vs-ort"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", metavar="NAME=FP.pt[,INT8.pt]",
                   help="a model: its FP checkpoint, and optionally its quantized one (repeatable)")
    p.add_argument("--shared", nargs="?", const=str(portable.shared()), default=None, metavar="DIR",
                   help="docs/CPU.md's tables: GELAN-C and YOLOv9-t from DIR/weights, calibrated on coco369 and scored "
                        "on coco334 (default DIR: YOLOV9_QAT_SHARED, else ../shared beside this repository)")
    p.add_argument("--compare-runtimes", type=Path, metavar="GRAPH", default=None,
                   help="instead: compare OpenVINO with ONNX Runtime on this Q/DQ graph (export_qat.py), tensor by tensor")
    p.add_argument("--images", type=Path, default=None,
                   help="--compare-runtimes: a folder of images (.jpg/.png), taken in name order")
    add_trust_flag(p)
    p.add_argument("--data", default=None, help="dataset yaml: train split calibrates, val split is scored")
    p.add_argument("--imgsz", type=int, default=640, help="export, evaluation and benchmark size (default 640)")
    p.add_argument("--device", default="", help="device for calibration (default: first GPU, else CPU)")
    p.add_argument("--calib-method", choices=CALIB_METHODS, default=DEFAULT_CALIB_METHOD)
    p.add_argument("--head-amax", choices=HEAD_AMAX, default=DEFAULT_HEAD_AMAX)
    p.add_argument("--calib-batches", type=int, default=4, help="calibration batches (default 4)")
    p.add_argument("--batch-size", type=int, default=8, help="calibration and evaluation batch (default 8)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-image", type=int, default=None,
                   help="evaluate on the first N val images (default all; --compare-runtimes: N images, default 2)")
    p.add_argument("--no-map", action="store_true", help="skip the mAP evaluation")
    p.add_argument("--runtime", nargs="+", choices=ONNX_RUNTIMES, default=list(ONNX_RUNTIMES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="benchmark batch sizes (default 1 8)")
    p.add_argument("--threads", type=int, default=None,
                   help="benchmark (and --compare-runtimes) threads (default: every usable core)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", default=None, help="output folder (needed except with --compare-runtimes)")
    return p


def use_shared(args: argparse.Namespace) -> str:
    """--shared DIR: docs/CPU.md's two models and data, each file checked; returns the data yaml to write to
    ``args.data`` (OUT/coco-qat.yaml, its path: filled in) once every other check has passed."""
    import yaml
    shared = Path(args.shared).resolve()
    if not args.out:
        raise QATError("--shared writes the tables and the data yaml it uses into --out: pass --out.")
    for f in (*(f"weights/{w}" for w in SHARED_MODELS.values()), *SHARED_FILES):
        if not (shared / f).exists():
            raise QATError(f"--shared: {shared / f} not found; pass the shared/ folder (or set YOLOV9_QAT_SHARED).")
    common = Path("models/common.py")  # the tree this runs from
    if not common.is_file() or "class ELAN1(" not in common.read_text():
        raise QATError("this YOLOv9 tree has no ELAN1, which yolov9-t needs: run from a patched clone of "
                       "WongKinYiu/yolov9 (or the yolo9 stand-in).")
    args.model = [f"{name}={shared / 'weights' / w}" for name, w in SHARED_MODELS.items()] + (args.model or [])
    data = yaml.safe_load((shared / "datasets" / "coco-qat.yaml").read_text())
    args.data = Path(args.out) / "coco-qat.yaml"
    return yaml.safe_dump({**data, "path": str(shared / "datasets")}, sort_keys=False)


def parse_models(specs: list[str]) -> dict[str, tuple[Path, Path | None]]:
    models: dict[str, tuple[Path, Path | None]] = {}
    for spec in specs:
        name, sep, files = spec.partition("=")
        parts = files.split(",")
        if not sep or not name or not parts[0] or len(parts) > 2:
            raise QATError(f"--model {spec} is not NAME=FP.pt or NAME=FP.pt,INT8.pt; e.g. --model c=gelan-c.pt.")
        if name in models:
            raise QATError(f"--model {name} is given twice; give each model its own name.")
        paths = [Path(f) for f in parts]
        for path in paths:
            if not path.is_file():
                raise QATError(f"--model {name}: {path} not found; pass an existing checkpoint.")
        models[name] = (paths[0], paths[1] if len(paths) > 1 else None)
    return models


def graphs_for(name: str, fp: Path, quantized: Path | None, args: argparse.Namespace, data: dict | None,
               out: Path) -> tuple[dict[str, Path], dict]:
    """The FP32 and INT8 graphs of one model in ``out`` (calibrating first without a quantized checkpoint)."""
    import torch

    from utils.qat.core.device import select_device
    from utils.qat.core.provenance import record
    from utils.qat.model import checkpoint
    from utils.qat.onnx.onnx_export import export_onnx, load_for_export
    from utils.qat.quantize.config import QuantConfig
    from utils.qat.run.pipeline import ptq
    device = select_device(args.device)
    facts: dict = {"fp_checkpoint": str(fp)}
    if quantized is None:
        if data is None:
            raise QATError(f"--model {name} has no quantized checkpoint to export: pass --data to calibrate one, or "
                           f"NAME=FP.pt,INT8.pt.")
        start = time.time()
        fp_model = checkpoint.load_fp(fp, trust=args.trust_weights)
        config = QuantConfig(method=args.calib_method, head_amax=args.head_amax)
        qmodel, info = ptq(fp_model, data, config, imgsz=args.imgsz, batch_size=args.batch_size, device=device,
                           calib_batches=args.calib_batches, workers=args.workers)
        quantized = checkpoint.save_quantized(out / f"ptq_{fp.stem}.pt", qmodel.cpu(), info,
                                              source=record(fp))
        facts["calibration"] = {"method": args.calib_method, "head_amax": args.head_amax,
                                "batches": args.calib_batches, "batch_size": args.batch_size,
                                "seconds": round(time.time() - start, 1)}
        del fp_model, qmodel
        if device.type == "cuda":
            torch.cuda.empty_cache()
    facts["int8_checkpoint"] = str(quantized)
    paths = {}
    for precision, weights in (("FP32", fp), ("INT8", quantized)):
        model, _task, _q, fp_patterns = load_for_export(weights, trust=args.trust_weights)
        paths[precision] = out / f"{name}-{precision.lower()}.onnx"
        report = export_onnx(model, paths[precision], imgsz=args.imgsz, dynamic=True, allow_fp=fp_patterns,
                             metadata={"source": weights.name})  # on the CPU, as export_qat.py by default
        if report["lint"] is not None:
            facts["lint_findings"] = report["lint"]["total"]
            facts["quantized_conv"] = f"{report['quantized_conv']}/{report['conv']}"
    return paths, facts


def score(graphs: dict[str, Path], args: argparse.Namespace, data: dict) -> dict:
    """mAP50-95 (and mAP50) of each graph on each runtime, with val_trt.py's evaluator and defaults."""
    from utils.qat.evaluation.evaluate import evaluate
    out: dict = {}
    for precision, path in graphs.items():
        for runtime in args.runtime:
            backend = OpenVINOBackend(path) if runtime == "openvino" else ORTBackend(path, arithmetic="float")
            start = time.time()
            m = evaluate(backend, data, task=backend.task, imgsz=args.imgsz, batch_size=args.batch_size,
                         workers=args.workers, num_images=args.num_image,
                         desc=f"{precision} {RUNTIMES[runtime]}")
            out.setdefault(precision, {})[runtime] = {"mAP50_95": round(m.mAP50_95, 4), "mAP50": round(m.mAP50, 4),
                                                      "images": m.images, "seconds": round(time.time() - start, 1)}
    return out


def render(doc: dict) -> str:
    lines = [f"## CPU deployment: FP32 vs INT8 on {', '.join(RUNTIMES[r] for r in doc['runtimes'])}", "",
             f"Command: `{doc['command']}`", ""]
    maps = {name: m["map"] for name, m in doc["graphs"].items() if m.get("map")}
    if maps:
        lines += ["### mAP50-95 of the same graphs on each runtime", "",
                  "| model | graph | " + " | ".join(RUNTIMES[r] for r in doc["runtimes"])
                  + (" | OpenVINO - ONNX Runtime |" if len(doc["runtimes"]) == 2 else " |"),
                  "|---|---|" + "---:|" * (len(doc["runtimes"]) + (len(doc["runtimes"]) == 2))]
        for name, by_precision in maps.items():
            for precision, by_runtime in by_precision.items():
                cells = [f"{by_runtime[r]['mAP50_95']:.4f}" if r in by_runtime else "-" for r in doc["runtimes"]]
                if len(doc["runtimes"]) == 2 and all(r in by_runtime for r in doc["runtimes"]):
                    diff = by_runtime["openvino"]["mAP50_95"] - by_runtime["onnxruntime"]["mAP50_95"]
                    cells.append(f"{diff:+.4f}")
                lines.append(f"| {name} | {precision} | " + " | ".join(cells) + " |")
        images = next(iter(next(iter(maps.values())).values()))
        lines += ["", f"{next(iter(images.values()))['images']} images at {doc['imgsz']} px, val_trt.py's evaluator "
                      f"(conf 0.001, IoU 0.7). 8-bit dot products on this CPU: "
                      f"{cpu_bench.EXACT.get(exact_int8_dot())}.", ""]
    for name, g in doc["graphs"].items():
        calib = g.get("calibration")
        how = (f"calibrated here ({calib['method']}, head {calib['head_amax']}, {calib['batches']} x "
               f"{calib['batch_size']} images, {calib['seconds']} s)" if calib else f"from {g['int8_checkpoint']}")
        lines.append(f"- {name}: FP32 from {Path(g['fp_checkpoint']).name}; INT8 {how}; quantized convs "
                     f"{g.get('quantized_conv', '?')}, Q/DQ lint findings {g.get('lint_findings', '?')}.")
    if doc.get("speed"):
        lines += ["", cpu_bench.render_markdown(doc["speed"])]
    return "\n".join(lines) + "\n"


def save(doc: dict, out: Path) -> None:
    write_text(out / f"{STEM}.json", portable.text(json.dumps(doc, indent=2) + "\n", work=out))
    write_text(out / f"{STEM}.md", portable.text(render(doc), work=out))
    if doc.get("speed"):
        cpu_bench.plot(doc["speed"], out / f"{STEM}.png")


# ---- --compare-runtimes: OpenVINO against ONNX Runtime on one graph, tensor by tensor ---------------------

def quantized_tensors(model) -> list[dict]:
    """Each activation tensor a QuantizeLinear quantizes with one scale, in graph order: name, scale, zero point
    and the code's range."""
    import numpy as np

    from utils.qat.onnx.onnx_qdq import QDQGraph
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


def letterbox(path: Path, imgsz: int):
    """One image, the same for both runtimes: resized to fit imgsz, padded below and to the right with 114 to a
    square, RGB, NCHW float in [0, 1]."""
    import cv2
    import numpy as np
    im = cv2.imread(str(path))
    if im is None:
        raise QATError(f"cannot read {path} as an image.")
    r = imgsz / max(im.shape[:2])
    im = cv2.resize(im, (round(im.shape[1] * r), round(im.shape[0] * r)), interpolation=cv2.INTER_LINEAR)
    canvas = np.full((imgsz, imgsz, 3), 114, np.uint8)
    canvas[:im.shape[0], :im.shape[1]] = im
    return np.ascontiguousarray(canvas[:, :, ::-1].transpose(2, 0, 1)[None], dtype=np.float32) / 255


def _ort(path: Path, images: list, threads: int) -> tuple[list[str], list[dict]]:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    feed = session.get_inputs()[0].name
    return names, [dict(zip(names, session.run(None, {feed: x}))) for x in images]


def _openvino(path: Path, images: list, names: list[str], threads: int) -> list[dict]:
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


def compare(graph: Path, images: list, threads: int) -> dict:
    """The report: per quantized tensor the share of codes differing by >= 1 and >= 2 steps and the largest
    difference (means over the images), and the unchanged graph's final outputs' largest and mean differences."""
    import numpy as np
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


def compare_table(report: dict) -> str:
    lines = [f"{report['graph']}: {len(report['tensors'])} quantized tensors, {report['images']} images",
             "", "| output | max abs | max diff | mean diff |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {v['max_abs']:.4g} | {v['max_diff']:.4g} | {v['mean_diff']:.4g} |"
              for k, v in report["outputs"].items()]
    lines += ["", "| # | tensor | codes >= 1 step apart | >= 2 steps | max steps |", "|---:|---|---:|---:|---:|"]
    lines += [f"| {i} | `{r['tensor']}` | {r['codes_1_step']:.5f} | {r['codes_2_steps']:.5f} | {r['max_steps']:g} |"
              for i, r in enumerate(report["tensors"])]
    return "\n".join(lines) + "\n"


def compare_runtimes(args: argparse.Namespace) -> dict:
    """--compare-runtimes: the report of :func:`compare`, printed, and written into --out when given."""
    graph = args.compare_runtimes
    if args.model:
        raise QATError("--compare-runtimes compares one graph, --model deploys checkpoints: pass one of the two.")
    if not graph.is_file():
        raise QATError(f"{graph} not found: pass a Q/DQ ONNX graph written by export_qat.py.")
    if args.images is None:
        raise QATError("--compare-runtimes needs --images, a folder of images to run both runtimes on.")
    files = sorted(f for f in args.images.glob("*") if f.suffix.lower() in (".jpg", ".jpeg", ".png"))
    files = files[:args.num_image or 2]
    if not files:
        raise QATError(f"no .jpg/.png images in {args.images}: pass a folder of images with --images.")
    from utils.qat.evaluation.backends import require_openvino
    require_openvino()
    report = compare(graph, [letterbox(f, args.imgsz) for f in files], args.threads or (os.cpu_count() or 1))
    text = compare_table(report)
    print(text, end="")
    if args.out:
        write_text(Path(args.out) / f"{COMPARE_STEM}.json", json.dumps(report, indent=1) + "\n")
        write_text(Path(args.out) / f"{COMPARE_STEM}.md", text)
    return report


def main(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation.data import load_data_yaml
    check_args(args)
    if args.compare_runtimes is not None:
        return compare_runtimes(args)
    shared_yaml = use_shared(args) if args.shared else None
    if not args.model or not args.out:
        raise QATError("pass --model NAME=FP.pt[,INT8.pt] (one or more) and --out, the output folder; or "
                       "--compare-runtimes GRAPH.")
    models = parse_models(args.model)
    if "openvino" in args.runtime:
        from utils.qat.evaluation.backends import require_openvino
        require_openvino()
    if not args.no_map and args.data is None:
        raise QATError("the mAP stage needs --data (its val split); pass it, or --no-map.")
    if shared_yaml:
        write_text(args.data, shared_yaml)
    needs_train = any(q is None for _fp, q in models.values())
    data = load_data_yaml(args.data, splits=("train", "val") if needs_train else ("val",)) if args.data else None
    out = Path(args.out)
    doc: dict = {"command": portable.command(work=out), "imgsz": args.imgsz,
                 "runtimes": list(args.runtime), "graphs": {}}
    paths = {}
    for name, (fp, quantized) in models.items():
        print(f"\n==> {name}: FP32 and INT8 graphs", flush=True)
        paths[name], doc["graphs"][name] = graphs_for(name, fp, quantized, args, data, out / name)
        save(doc, out)
    if not args.no_map:
        for name in models:
            print(f"\n==> {name}: mAP on {', '.join(RUNTIMES[r] for r in args.runtime)}", flush=True)
            doc["graphs"][name]["map"] = score(paths[name], args, data)
            save(doc, out)
    print("\n==> speed", flush=True)
    doc["speed"] = cpu_bench.measure(paths, runtimes=args.runtime, batches=args.batch, imgsz=args.imgsz,
                                     threads=args.threads, warmup=args.warmup, runs=args.runs)
    save(doc, out)
    print(render(doc))
    print(f"wrote {out / STEM}.json, .md and .png")
    return doc


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
