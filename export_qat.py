"""Export a YOLOv9 checkpoint (quantized by qat.py, or floating point) to ONNX for TensorRT.

    python3 export_qat.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --include onnx --dynamic --simplify --inplace
    python3 export_qat.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --include onnx_end2end
    python3 export_qat.py --weights yolov9-c-converted.pt --include onnx --half      # the FP16 baseline
    python3 export_qat.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --include onnx --half  # TensorRT 11

--include onnx          W.onnx: input `images` (B x 3 x H x W), output `output0` (B x (4 + classes) x anchors;
                        `output1` prototypes for segmentation), Q/DQ nodes for quantized checkpoints.
--include onnx_end2end  W-end2end.onnx: NMS inside, outputs num_dets, det_boxes, det_scores, det_classes
                        (segmentation: det_masks); --nms onnx (default: standard NonMaxSuppression, TensorRT's
                        native NMS layer, and ONNX Runtime) or --nms trt (the EfficientNMS_TRT plugin, deprecated
                        since TensorRT 10.12; segmentation: EfficientNMSX_TRT, a third-party plugin that is not
                        part of TensorRT: engines need its library, --plugins).
--half                  the floating-point parts of the graph in FP16, converted by NVIDIA ModelOpt AutoCast
                        (TensorRT 11 builds strongly typed networks and takes FP16 from the ONNX); inputs and
                        outputs stay FP32; a Q/DQ graph moves to opset 19 (FP16 scales, DQ -> Conv).
--inplace               ignored, with a notice: accepted so that upstream export.py's command line works
                        (it sets the head's `inplace` attribute, which no YOLOv9 head reads).
--check / --no-check    Q/DQ lint of the result (on by default for quantized checkpoints); findings that
                        would stop TensorRT from fusing Q/DQ are printed, the graph is not kept and the exit
                        status is non-zero (--no-check keeps it).
--openvino-avx2         also W-avx2.onnx (W-end2end-avx2.onnx): the Q/DQ graph re-encoded for OpenVINO on x86
                        CPUs without VNNI or AMX, where the TensorRT graph's INT8 outputs are wrong (7-bit
                        weights, uint8 activations: utils/qat/onnx/avx2.py; docs/CPU.md).
--onnxruntime-cpu [W]   also W-ort.onnx (W-end2end-ort.onnx): the Q/DQ graph re-placed so that ONNX Runtime's CPU
                        provider fuses its SiLU convolutions into INT8 kernels (a Q/DQ pair added on their
                        outputs; utils/qat/onnx/ort_cpu.py); weights uint8 (default: computed as written on
                        every CPU) or 7bit (faster on CPUs without VNNI, less exact).
"""
from __future__ import annotations

from utils.qat.core import compat

compat.apply()

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402
from utils.qat.core.provenance import sha256  # noqa: E402

INCLUDE = {"onnx": ".onnx", "onnx_end2end": "-end2end.onnx"}
NMS_BACKENDS = ("onnx", "trt")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="export_qat.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, help="checkpoint (.pt): quantized (qat.py) or floating point")
    add_trust_flag(p)
    p.add_argument("--include", nargs="+", default=["onnx"], choices=sorted(INCLUDE), metavar="FORMAT",
                   help=f"what to export: {', '.join(sorted(INCLUDE))} (default: onnx)")
    p.add_argument("--imgsz", "--img", "--img-size", dest="imgsz", nargs="+", type=int, default=[640],
                   help="image size: N or H W (default: 640)")
    p.add_argument("--batch-size", type=int, default=1,
                   help="batch size of the graph (with --dynamic: the batch it is traced with)")
    p.add_argument("--device", default="cpu", help="cpu, 0 or cuda:0 (default: cpu)")
    p.add_argument("--dynamic", action="store_true", help="dynamic batch, height and width")
    p.add_argument("--simplify", action="store_true", help="simplify with onnxslim (Q/DQ nodes preserved)")
    p.add_argument("--opset", type=int, default=17, help="ONNX opset (default: 17)")
    p.add_argument("--half", action="store_true",
                   help="FP16 for the non-quantized parts of the graph (ModelOpt AutoCast; for TensorRT 11)")
    p.add_argument("--inplace", action="store_true",
                   help="ignored: upstream export.py's flag, accepted for its command line (no YOLOv9 head reads it)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=None,
                   help="Q/DQ lint of the result: on findings no graph is kept and the exit status is non-zero "
                        "(default: on for quantized checkpoints; --no-check keeps the graph)")
    p.add_argument("--openvino-avx2", action="store_true",
                   help="also write W-avx2.onnx, re-encoded for OpenVINO on x86 CPUs without VNNI or AMX (7-bit "
                        "weights, uint8 activations; costs some accuracy: docs/CPU.md)")
    p.add_argument("--onnxruntime-cpu", nargs="?", const="uint8", default=None, choices=("uint8", "7bit"),
                   metavar="WEIGHTS", help="also write W-ort.onnx, re-placed for ONNX Runtime's CPU kernels; "
                                           "WEIGHTS: uint8 (default, as written on every CPU) or 7bit (faster "
                                           "without VNNI, less exact)")
    e = p.add_argument_group("End2End (--include onnx_end2end)")
    e.add_argument("--nms", choices=NMS_BACKENDS, default="onnx",
                   help="onnx: standard NonMaxSuppression, TensorRT's native NMS layer (default); trt: the "
                        "EfficientNMS_TRT plugin (deprecated since TensorRT 10.12)")
    e.add_argument("--topk-all", type=int, default=100, help="detections kept per image (default: 100)")
    e.add_argument("--iou-thres", type=float, default=0.45, help="NMS IoU threshold (default: 0.45)")
    e.add_argument("--conf-thres", type=float, default=0.25, help="score threshold (default: 0.25)")
    e.add_argument("--class-agnostic", action="store_true", help="one NMS over all classes")
    e.add_argument("--mask-resolution", type=int, default=56, help="segmentation: mask size in pixels (default: 56)")
    e.add_argument("--pooler-scale", type=float, default=0.25,
                   help="segmentation: prototype size / input size (default: 0.25)")
    e.add_argument("--sampling-ratio", type=int, default=0, help="segmentation: ROIAlign sampling ratio (0: adaptive)")
    return p


def output_path(weights: Path, include: str) -> Path:
    return weights.with_name(weights.stem + INCLUDE[include])


def write_cpu_graph(path: Path, flag: str, weights: str = "uint8") -> dict:
    """``path`` rewritten for a CPU runtime and written beside it: ``--openvino-avx2`` as NAME-avx2.onnx (re-encoded
    for OpenVINO on CPUs without VNNI or AMX), ``--onnxruntime-cpu`` as NAME-ort.onnx (re-placed for ONNX Runtime's
    CPU kernels, ``weights`` their encoding)."""
    import onnx

    from utils.qat.core.atomic import write_bytes
    model = onnx.load(str(path))
    if flag == "--openvino-avx2":
        from utils.qat.onnx.avx2 import reencode
        counts, out = reencode(model), path.with_name(path.stem + "-avx2.onnx")
        what = (f"for OpenVINO on CPUs without VNNI or AMX ({counts['weights']} weight tensors on 7 bits, "
                f"{counts['activations']} activation quantizers as uint8)")
    else:
        from utils.qat.onnx.ort_cpu import place
        counts, out = place(model, weights), path.with_name(path.stem + "-ort.onnx")
        counts = {"weight_encoding": weights, **counts}
        what = (f"for ONNX Runtime on CPUs ({counts['convolutions']} convolutions with an INT8 output, "
                f"{counts['weights']} weight tensors as {weights})")
    write_bytes(out, model.SerializeToString())
    print(f"  {out}: {what}")
    return {"path": str(out), **counts}


def main(args: argparse.Namespace) -> list[dict]:
    from utils.qat.core import yolov9
    from utils.qat.model import checkpoint
    from utils.qat.core.device import select_device
    from utils.qat.onnx.onnx_export import export_onnx, format_report, load_for_export, parse_imgsz
    from utils.qat.core.validate import check_args, image_size
    check_args(args)
    image_size(args.imgsz, "--imgsz")  # before the (slow) model load
    weights = Path(args.weights)
    if "onnx_end2end" in args.include:  # cheap argument checks before the (slow) model load
        from utils.qat.onnx.end2end import NMSOptions
        NMSOptions(backend=args.nms, topk_all=args.topk_all, iou_thres=args.iou_thres, conf_thres=args.conf_thres,
                   mask_resolution=args.mask_resolution, pooler_scale=args.pooler_scale,
                   sampling_ratio=args.sampling_ratio).check()
    if args.inplace:
        print("notice: --inplace is ignored (upstream export.py's flag: no YOLOv9 head reads it, the graph is the "
              "same without it).")
    ckpt = checkpoint.read(weights, trust=args.trust_weights)
    task = checkpoint.task_of(ckpt)
    if "onnx_end2end" in args.include and task not in ("detect", "segment"):
        raise QATError(f"{weights} holds a {task} model: End2End export (NMS in the graph) needs a detection or "
                       f"segmentation model; use --include onnx.")
    model, task, quantized, fp_patterns = load_for_export(weights, ckpt)
    del ckpt
    if "onnx_end2end" in args.include and args.nms == "trt":
        from utils.qat.trt.trt_engine import THIRD_PARTY_PLUGINS
        plugin = "EfficientNMSX_TRT" if task == "segment" else "EfficientNMS_TRT"
        where = (f"it is not part of TensorRT (it comes from {THIRD_PARTY_PLUGINS[plugin]}): pass that library to "
                 f"the engine build and runner with --plugins" if plugin in THIRD_PARTY_PLUGINS
                 else "deprecated since TensorRT 10.12, TensorRT's native NMS layer (--nms onnx) replaces it")
        print(f"notice: --nms trt uses the {plugin} plugin; {where}.")
    cpu_flags = [f for f, on in (("--openvino-avx2", args.openvino_avx2),
                                 ("--onnxruntime-cpu", args.onnxruntime_cpu)) if on]
    if cpu_flags and not quantized:
        raise QATError(f"{weights} is a floating-point checkpoint: {' and '.join(cpu_flags)} "
                       f"{'rewrites' if len(cpu_flags) == 1 else 'rewrite'} INT8 Q/DQ graphs for CPUs; give a "
                       f"quantized checkpoint (qat.py quantize), or leave {'it' if len(cpu_flags) == 1 else 'them'} "
                       "out (FP32 graphs run as they are).")
    if (args.onnxruntime_cpu or args.openvino_avx2) and args.half:
        raise QATError("--half makes a graph for TensorRT 11 (FP16 between the Q/DQ pairs); the CPU graphs "
                       "(--onnxruntime-cpu, --openvino-avx2) are FP32: export them without --half.")
    imgsz = parse_imgsz(args.imgsz, yolov9.model_stride(model), flag="--imgsz")
    device = select_device(args.device)
    check = quantized if args.check is None else args.check
    print(f"{weights}: {'quantized (INT8 Q/DQ)' if quantized else 'floating-point'} {task} model, "
          f"{imgsz[0]}x{imgsz[1]}, batch {'dynamic' if args.dynamic else args.batch_size}")
    reports = []
    metadata = {"source": weights.name, "source_sha256": sha256(weights)}  # hashed once for every format
    for include in dict.fromkeys(args.include):
        end2end = None
        if include == "onnx_end2end":
            end2end = dict(backend=args.nms, topk_all=args.topk_all, iou_thres=args.iou_thres,
                           conf_thres=args.conf_thres, class_agnostic=args.class_agnostic,
                           mask_resolution=args.mask_resolution, pooler_scale=args.pooler_scale,
                           sampling_ratio=args.sampling_ratio)
        report = export_onnx(model, output_path(weights, include), imgsz=imgsz, batch_size=args.batch_size,
                             dynamic=args.dynamic, opset=args.opset, simplify=args.simplify, half=args.half,
                             end2end=end2end, task=task, device=device,
                             allow_fp=fp_patterns, metadata=metadata)
        print(format_report(report))
        if check and report["lint"] is not None and report["lint"]["total"]:
            raise refused(report, weights, [r["path"] for r in reports], args.half)
        if report["simplify"].startswith("failed"):
            print(f"notice: simplification failed, {report['path']} is the unsimplified graph "
                  f"({report['simplify'].removeprefix('failed: ').split(';')[0]}).")
        if check and not quantized:
            print("  Q/DQ lint: skipped (a floating-point model has no Q/DQ nodes)")
        if args.openvino_avx2:
            report["avx2"] = write_cpu_graph(Path(report["path"]), "--openvino-avx2")
        if args.onnxruntime_cpu:
            report["ort_cpu"] = write_cpu_graph(Path(report["path"]), "--onnxruntime-cpu", args.onnxruntime_cpu)
        reports.append(report)
    return reports


def refused(report: dict, weights: Path, written: list[str], half: bool) -> QATError:
    """The graph of ``report`` refused by its Q/DQ lint (``--check``): it and the graphs this command wrote before it
    (``written``) are removed, and the sentence says what the lint found where, and what to do."""
    for path in (report["path"], *written):
        Path(path).unlink(missing_ok=True)
    lint = report["lint"]
    total = lint["total"]
    kind, found = next(iter(lint["findings"].items()))
    where = f"{kind} at {found['nodes'][0]}" + (f" and {total - 1} more" if total > 1 else "")
    if "nonpositive_scale" in lint["findings"] and half:
        fix = "a scale underflowed to 0 in FP16: export without --half, or pass --no-check to keep the graph as it is"
    elif "nonpositive_scale" in lint["findings"]:
        fix = ("TensorRT refuses a scale that is not positive, so the graph cannot run as it is (--no-check keeps it "
               "to inspect)")
    else:
        fix = ("TensorRT would run those layers outside INT8 (slower, not wrong): pass --no-check to keep the graph "
               "as it is")
    return QATError(f"the Q/DQ lint found {total} TensorRT fusion blocker{'s' if total != 1 else ''} in the graph "
                    f"exported from {weights} ({where}; all listed above), so no graph was kept; {fix}.")


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
