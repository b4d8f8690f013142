"""Evaluate an exported model, a TensorRT engine or an ONNX graph, with the toolkit's shared evaluator.

    python3 val_trt.py --engine-file runs/qat/exp/weights/qat_best.engine --data data/coco.yaml --imgsz 640
    python3 val_trt.py --onnx runs/qat/exp/weights/qat_best.onnx --backend onnxruntime --data data/coco.yaml
    python3 val_trt.py --onnx runs/qat/exp/weights/qat_best.onnx --backend openvino --data data/coco.yaml

An ONNX graph runs on ONNX Runtime (the default) or OpenVINO (CPU; ./install_dependencies.sh --openvino), which
runs the Q/DQ convolutions with INT8 kernels and the rest in FP32. On ONNX Runtime a Q/DQ graph is scored in the
arithmetic qat.py scores its checkpoint with (--ort-arithmetic integer: exact integer convolutions, the SiLU rounded
once), so a graph and its checkpoint score alike; --ort-arithmetic float scores the file as a plain ONNX Runtime
session runs it (float32 convolutions of the dequantized values).

Same dataloader, NMS and metrics as `qat.py eval` and upstream val.py, so the numbers compare directly
with the PyTorch checkpoint the export came from. Plain exports (output0) and End2End exports (num_dets,
det_boxes, det_scores, det_classes; e.g. export_qat.py --include onnx_end2end --nms onnx) both work; an
End2End graph's own NMS settings (--conf-thres / --iou-thres of the export) apply to it.
Segmentation models (output0 + output1 prototypes, or End2End det_masks) get box and mask metrics, defined
as upstream segment/val.py defines them (the dataset needs polygon labels); --task detect scores their
boxes only. Writes results.json (and predictions.json with --save-json) to --project/--name.
"""
from __future__ import annotations

from utils.qat.core import compat

compat.apply()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from utils.qat.core.errors import QATError, run_cli  # noqa: E402

BACKENDS = ("tensorrt", "onnxruntime", "openvino")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="val_trt.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--engine-file", default=None, help="TensorRT engine (built by scripts/generate_trt_engine.sh)")
    src.add_argument("--onnx", default=None,
                     help="ONNX graph (export_qat.py), run with --backend onnxruntime or openvino")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="tensorrt (default with --engine-file); onnxruntime (default with --onnx) or openvino (CPU) "
                        "for --onnx")
    p.add_argument("--ort-arithmetic", choices=("integer", "float", "basic"), default="integer",
                   help="how ONNX Runtime computes a Q/DQ graph: integer (default; as qat.py scores the checkpoint), "
                        "float (the file as ONNX Runtime runs it itself) or basic (its basic rewrites only)")
    p.add_argument("--data", default=None, help="dataset yaml (default: data/coco.yaml of the YOLOv9 tree, as upstream)")
    p.add_argument("--batch-size", type=int, default=32, help="batch size (a static engine/graph uses its own)")
    p.add_argument("--imgsz", "--img", "--img-size", dest="imgsz", type=int, default=640,
                   help="inference size in pixels (a static engine/graph uses its own)")
    p.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold (plain exports)")
    p.add_argument("--iou-thres", type=float, default=0.7, help="NMS IoU threshold (plain exports)")
    p.add_argument("--max-det", type=int, default=300, help="detections per image (plain exports)")
    p.add_argument("--device", default="", help="cuda:0, 0 or cpu (default: first GPU, else CPU)")
    p.add_argument("--task", choices=("detect", "segment"), default=None,
                   help="detect or segment (default: from the model's metadata); detect on a segmentation "
                        "model scores its boxes only")
    p.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers")
    p.add_argument("--save-json", action="store_true", help="also save COCO-style predictions (predictions.json)")
    p.add_argument("--project", default="runs/val_trt", help="results go to project/name")
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true", help="reuse project/name instead of incrementing it")
    p.add_argument("--report", default=None,
                   help="also add this result as a row to a qat.py report.json (and rewrite its report.md)")
    p.add_argument("--report-name", default=None, help="row name for --report (default: the runtime name)")
    p.add_argument("--plugins", action="append", default=[], metavar="LIB.so",
                   help="TensorRT plugin library the engine needs (repeatable), e.g. one providing EfficientNMSX_TRT")
    return p


def open_source(args: argparse.Namespace):
    """The backend for --engine-file / --onnx (``utils.qat.evaluation.backends.open_backend``) and the file."""
    from utils.qat.evaluation.backends import open_backend
    source = Path(args.engine_file or args.onnx)
    backend = args.backend or ("tensorrt" if args.engine_file else "onnxruntime")
    if backend == "tensorrt" and args.onnx:
        raise QATError("--backend tensorrt runs engines: pass --engine-file X.engine (build one from the ONNX with "
                       "scripts/generate_trt_engine.sh), or use --backend onnxruntime or openvino for --onnx.")
    if backend != "tensorrt" and args.engine_file:
        raise QATError(f"--backend {backend} runs ONNX graphs, not TensorRT engines: pass --onnx X.onnx.")
    if backend != "tensorrt" and source.suffix.lower() != ".onnx" and source.is_file():
        raise QATError(f"{source} is not an .onnx file; export one with export_qat.py --include onnx.")
    return open_backend(source, args.device, kind=backend, plugins=args.plugins,
                        ort_arithmetic=args.ort_arithmetic), source


def main(args: argparse.Namespace) -> dict:
    from utils.qat.run import reports
    from utils.qat.core.atomic import write_text
    from utils.qat.evaluation.data import check_polygons, data_argument, load_data_yaml
    from utils.qat.core.validate import check_imgsz
    from utils.qat.evaluation.evaluate import evaluate
    from utils.qat.core.validate import check_args
    check_args(args)
    if args.report and not Path(args.report).is_file():
        raise QATError(f"--report {args.report} not found; pass the report.json that qat.py quantize wrote.")
    args.data = data_argument(args.data)
    data = load_data_yaml(args.data, splits=("val",))
    backend, source = open_source(args)
    runtime = backend.runtime
    task = args.task or backend.task
    if task == "segment" and backend.task != "segment":
        raise QATError(f"{source} is a detection model (no mask outputs); evaluate it with --task detect.")
    if task == "segment":
        check_polygons(data, ("val",))
    elif backend.task == "segment":
        print("notice: --task detect on a segmentation model: box metrics only.")
    if backend.names and len(backend.names) != len(data["names"]):
        raise QATError(f"{source} predicts {len(backend.names)} classes but {args.data} has {len(data['names'])}; "
                       f"evaluate it on the dataset it was trained for.")
    imgsz = check_imgsz(args.imgsz, int(backend.stride))
    if backend.imgsz is not None and max(backend.imgsz) != imgsz:
        print(f"notice: {source.name} has a fixed input of {backend.imgsz[0]}x{backend.imgsz[1]}; evaluating at that "
              f"size instead of --imgsz {imgsz}.")
    # docs/QAT_RECIPE.md "A real COCO model": 0.4026 rect against 0.3998 square, one checkpoint
    if backend.imgsz is not None:
        print(f"notice: {source.name} has a fixed input size, so every image is letterboxed into "
              f"{backend.imgsz[0]}x{backend.imgsz[1]}, where qat.py eval (as upstream's val.py) scores rectangular "
              f"batches: the two scores differ by that alone; export with --dynamic to compare with the checkpoint.")
    if backend.batch_size is not None and backend.batch_size != args.batch_size:
        print(f"notice: {source.name} has a fixed batch of {backend.batch_size}; using it instead of --batch-size "
              f"{args.batch_size}.")
    out = reports.run_dir(args.project, args.name, args.exist_ok)
    kind = "End2End" if backend.end2end else "plain"
    start = time.time()
    m = evaluate(backend, data, task=task, imgsz=imgsz, batch_size=args.batch_size, conf_thres=args.conf_thres,
                 iou_thres=args.iou_thres, max_det=args.max_det, workers=args.workers, num_images=args.num_image,
                 save_json=out / "predictions.json" if args.save_json else None, desc=f"{runtime} ({kind})")
    row = reports.entry(source.name, source, m, time.time() - start, backend=runtime, graph=kind, task=task,
                        imgsz=list(backend.imgsz) if backend.imgsz else imgsz)
    write_text(out / "results.json", json.dumps({**row, "instances": m.instances, **reports.per_class(m),
                                                  "conf_thres": args.conf_thres, "iou_thres": args.iou_thres},
                                                 indent=2))
    if args.report:
        reports.add_row(args.report, {**row, "name": args.report_name or f"INT8 {runtime}",
                                      **reports.vs_reference(args.report, m)})
        print(f"added to {args.report} (and report.md beside it)")
    print()
    print(reports.table([row]))
    print(f"\n{m.images} images, {m.instances} instances, {row['seconds']} s; results in {out / 'results.json'}")
    return row


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
