"""Export a YOLOv9 checkpoint (quantized by qat.py, or floating point) to ONNX for DeepStream.

    python3 export_yoloV9.py --weights qat_best_yolov9-c.pt --simplify
    python3 export_yoloV9.py --weights qat_best_yolov9-c.pt --size 640 --dynamic --simplify
    python3 export_yoloV9.py --weights qat_best_yolov9-c.pt --batch 4 --size 640 640

Writes W.pt.onnx and labels.txt (one class name per line) beside it. The graph has one input `input`
(B x 3 x H x W, RGB in [0, 1]) and one output `output` of shape (B, anchors, 6): x1, y1, x2, y2 in input
pixels, the best class score and that class's index (as a float) for every anchor, before NMS: the
layout DeepStream-Yolo's parser (nvdsinfer_custom_impl_Yolo) reads. Quantized vs floating-point
checkpoints and single vs dual (auxiliary-branch) heads are detected; dual heads export their main
branch only. --dynamic makes the batch dynamic (DeepStream fixes the image size in its config).
"""
from __future__ import annotations

from utils.qat.core import compat

compat.apply()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402
from utils.qat.core.provenance import sha256  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="export_yoloV9.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-w", "--weights", required=True, help="checkpoint (.pt): quantized (qat.py) or floating point")
    add_trust_flag(p)
    p.add_argument("-s", "--size", nargs="+", type=int, default=[640], help="image size: N or H W (default: 640)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default: 17)")
    p.add_argument("--simplify", action="store_true", help="simplify with onnxslim (Q/DQ nodes preserved)")
    p.add_argument("--dynamic", action="store_true", help="dynamic batch size")
    p.add_argument("--batch", type=int, default=1, help="static batch size (default: 1; not with --dynamic)")
    return p


def output_path(weights: Path) -> Path:
    return weights.with_name(weights.name + ".onnx")  # DeepStream-Yolo's naming: W.pt.onnx


def main(args: argparse.Namespace) -> dict:
    from utils.qat.model import checkpoint
    from utils.qat.core.atomic import write_text
    from utils.qat.core import yolov9
    from utils.qat.onnx.onnx_export import DeepStreamOutput, export_onnx, format_report, load_for_export, parse_imgsz, readable
    from utils.qat.core.validate import check_args
    check_args(args)
    if args.dynamic and args.batch > 1:
        raise QATError(f"--batch {args.batch} and --dynamic contradict each other: use --dynamic for a dynamic batch "
                       f"or --batch N for a fixed one.")
    weights = Path(args.weights)
    ckpt = checkpoint.read(weights, trust=args.trust_weights)
    task = checkpoint.task_of(ckpt)
    if task != "detect":
        raise QATError(f"{weights} holds a {task} model; export_yoloV9.py exports detection models for DeepStream "
                       f"(use export_qat.py --include onnx for other models).")
    model, task, quantized, fp_patterns = load_for_export(weights, ckpt)
    del ckpt
    imgsz = parse_imgsz(args.size, yolov9.model_stride(model), flag="--size")
    kind = "dual" if yolov9.is_dual(model) else "single"
    print(f"{weights}: {'QAT (INT8 Q/DQ)' if quantized else 'FP (floating point)'} model, {kind} head "
          f"({yolov9.head_name(model)}{', exporting the main branch' if kind == 'dual' else ''}), "
          f"{imgsz[0]}x{imgsz[1]}, batch {'dynamic' if args.dynamic else args.batch}")
    out = output_path(weights)
    report = export_onnx(model, out, imgsz=imgsz, batch_size=args.batch, dynamic=args.dynamic, dynamic_hw=False,
                         opset=args.opset, simplify=args.simplify, task=task, post=DeepStreamOutput(),
                         input_names=["input"], output_names=["output"], allow_fp=fp_patterns,
                         metadata={"source": weights.name, "source_sha256": sha256(weights), "layout": "deepstream-yolo",
                                   "head": kind})
    labels = out.with_name("labels.txt")
    try:
        write_text(labels, "".join(f"{model.names[i]}\n" for i in sorted(model.names)))
        readable(labels)
    except OSError as e:
        raise QATError(f"cannot write {labels} ({e.strerror or e}); choose a writable folder.") from e
    print(format_report(report))
    print(f"wrote {labels} ({len(model.names)} classes)")
    report["labels"] = str(labels)
    return report


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
