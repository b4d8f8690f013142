"""Deploying on CPUs, end to end from checkpoints: each model's FP32 and INT8 ONNX graphs, their mAP on ONNX Runtime
and OpenVINO (the same graph on both: how far OpenVINO's INT8 kernels move the score), and their speed
(``utils/qat/evaluation/cpu_bench.py``: FP32 vs INT8, batch 1 and a throughput batch, the CPU and its instruction
sets, OpenVINO's execution graph of each INT8 graph). Writes OUT/cpu-deploy.json, OUT/cpu-deploy.md and
OUT/cpu-deploy.png, updated after every stage, and the graphs in OUT/NAME/.

Run from the top of a patched YOLOv9 tree (yolov9-t needs one with ELAN1 / AConv):

    python3 /path/to/yolov9-qat/benchmarks/cpu_deploy.py --model c=gelan-c.pt --model t=yolov9-t.pt \\
        --data coco.yaml --imgsz 640 --out runs/benchmark/cpu

Each ``--model NAME=FP.pt`` is an FP checkpoint, calibrated here on the first --calib-batches batches of the data's
train split (qat.py quantize --ptq-only, on --device); ``NAME=FP.pt,INT8.pt`` gives its quantized checkpoint (a
qat.py run) instead. Both are exported as ``export_qat.py --dynamic`` does (the one exporter). ``--no-map``
skips the evaluation (then --data is needed only for calibration). OpenVINO runs what is not INT8 in FP32 for
both stages; on x86 CPUs without VNNI or AMX its INT8 convolutions saturate, which the mAP table shows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
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

STEM = "cpu-deploy"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", required=True, metavar="NAME=FP.pt[,INT8.pt]",
                   help="a model: its FP checkpoint, and optionally its quantized one (repeatable)")
    add_trust_flag(p)
    p.add_argument("--data", default=None, help="dataset yaml: train split calibrates, val split is scored")
    p.add_argument("--imgsz", type=int, default=640, help="export, evaluation and benchmark size (default 640)")
    p.add_argument("--device", default="", help="device for calibration (default: first GPU, else CPU)")
    p.add_argument("--calib-method", choices=CALIB_METHODS, default=DEFAULT_CALIB_METHOD)
    p.add_argument("--head-amax", choices=HEAD_AMAX, default=DEFAULT_HEAD_AMAX)
    p.add_argument("--calib-batches", type=int, default=4, help="calibration batches (default 4)")
    p.add_argument("--batch-size", type=int, default=8, help="calibration and evaluation batch (default 8)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--num-image", type=int, default=None, help="evaluate on the first N val images (default all)")
    p.add_argument("--no-map", action="store_true", help="skip the mAP evaluation")
    p.add_argument("--runtime", nargs="+", choices=ONNX_RUNTIMES, default=list(ONNX_RUNTIMES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="benchmark batch sizes (default 1 8)")
    p.add_argument("--threads", type=int, default=None, help="benchmark threads (default: every usable core)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--out", required=True, help="output folder")
    return p


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
            backend = OpenVINOBackend(path) if runtime == "openvino" else ORTBackend(path)
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
    write_text(out / f"{STEM}.json", json.dumps(doc, indent=2) + "\n")
    write_text(out / f"{STEM}.md", render(doc))
    if doc.get("speed"):
        cpu_bench.plot(doc["speed"], out / f"{STEM}.png")


def main(args: argparse.Namespace) -> dict:
    import shlex

    from utils.qat.evaluation.data import load_data_yaml
    check_args(args)
    models = parse_models(args.model)
    if "openvino" in args.runtime:
        from utils.qat.evaluation.backends import require_openvino
        require_openvino()
    if not args.no_map and args.data is None:
        raise QATError("the mAP stage needs --data (its val split); pass it, or --no-map.")
    needs_train = any(q is None for _fp, q in models.values())
    data = load_data_yaml(args.data, splits=("train", "val") if needs_train else ("val",)) if args.data else None
    out = Path(args.out)
    doc: dict = {"command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]), "imgsz": args.imgsz,
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
