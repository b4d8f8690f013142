"""Does the TensorRT engine compute what the ONNX graph does? Polygraphy, TensorRT against ONNX Runtime.

    python3 -m utils.qat.trt.compare qat_best.onnx [--engine qat_best.engine] [--images DIR] [--imgsz 640] \\
        [--batch 4] [--plugins LIB.so] [--work DIR] [--dry-run --trt-version 11.1]
    (scripts/compare_trt.sh is the same)

1. Inputs: ``--batch`` real images from ``--images`` (resized to ``--imgsz``, RGB, [0, 1]), else uniform
   noise, saved to WORK/inputs.npy with a Polygraphy data loader script (WORK/data_loader.py).
2. ONNX Runtime reference, on any machine: ``polygraphy run ONNX --onnxrt --save-outputs WORK/onnxrt.json``.
3. TensorRT (a GPU host): ``polygraphy run ONNX --trt`` (built with this toolkit's precision rules: TensorRT 10
   ``--fp16 --int8``, or ``--strongly-typed``; TensorRT 11 strongly typed, nothing to pass) or, with
   ``--engine``, ``polygraphy run ENGINE --model-type engine --trt``; both ``--load-outputs WORK/onnxrt.json``
   and compare output by output with INT8-suited tolerances: the 99th percentile of the absolute difference
   over each output (``--check-error-stat quantile --error-quantile 0.99``) within ``--atol`` (output0: 15,
   boxes in input pixels and class scores together; output1, the mask prototypes: 1.0). INT8 kernels round
   differently in every runtime and the flips cascade, so some elements, mostly boxes of background anchors,
   always differ a lot: an element-wise or max check would fail every good engine.
4. Detections: the anchors ONNX Runtime scores above ``--conf`` must keep their class (>= 98%) and their box
   (IoU >= 0.9 for >= 95% of them) in TensorRT's output.

The verdict is one line: ``verdict: MATCH ...`` (exit 0) or ``verdict: MISMATCH ...`` (exit 1); user errors
are one ``error:`` sentence (exit 2). Calibrated on this toolkit's graphs in ONNX Runtime (benchmarks/results/
autocast-cpu.md): a legitimate difference, the FP16+INT8 graph against the FP32+INT8 graph, has a 99th
percentile |difference| on output0 of 4.2 (GELAN-C, 640 px) and 3.4 to 8.5 (the embedded models, 256 px), 0.39
on output1, and keeps 100% of the classes and 99% of the boxes; GELAN-C fed BGR instead of RGB has 27, 73% of
the classes and 15% of the boxes.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from utils.qat.core.artifact import END2END_OUTPUTS
from utils.qat.core.atomic import write_text
from utils.qat.core.errors import QATError, run_cli

ATOL = {"output0": 15.0, "output1": 1.0}
ERROR_QUANTILE = 0.99
CLASS_AGREEMENT = 0.98
BOX_AGREEMENT = 0.95
BOX_IOU = 0.9
INSTALL_POLYGRAPHY = "pip install polygraphy (./install_dependencies.sh installs it)"


def find_polygraphy() -> str:
    exe = shutil.which("polygraphy") or str(Path(sys.executable).with_name("polygraphy"))
    if not Path(exe).is_file():
        raise QATError(f"polygraphy was not found on PATH; install it with {INSTALL_POLYGRAPHY}.")
    return exe


def graph_io(onnx_path: Path) -> tuple[str, list[int | None], list[str]]:
    """Input name and dims (None = dynamic), output names; refuses graphs ONNX Runtime cannot compare."""
    import onnx
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as e:  # onnx raises its own types for files that are not ONNX
        raise QATError(f"{onnx_path} is not a readable ONNX file ({type(e).__name__}); pass export_qat.py's .onnx.")
    plugins = sorted({n.op_type for n in model.graph.node if n.domain not in ("", "ai.onnx")})
    if plugins:
        raise QATError(f"{onnx_path} holds TensorRT plugin nodes ({', '.join(plugins)}) that ONNX Runtime cannot run; "
                       f"compare the plain export (export_qat.py --include onnx).")
    outputs = [o.name for o in model.graph.output]
    if any(n in outputs for n in END2END_OUTPUTS):  # any End2End output: ranked lists
        raise QATError(f"{onnx_path} is an End2End graph, whose ranked detection lists differ between NMS "
                       f"implementations element by element; compare the plain export (export_qat.py --include onnx).")
    from utils.qat.trt.trt_common import image_input
    name, dims = image_input(model, onnx_path)
    return name, dims, outputs


def make_inputs(dims: Sequence[int | None], *, batch: int, imgsz: int, images: Path | None, seed: int = 0) -> np.ndarray:
    """B x 3 x H x W float32 in [0, 1]: real images when a folder is given, else noise."""
    b = dims[0] or batch
    h = dims[2] or imgsz
    w = dims[3] or imgsz
    if images is None:
        return np.random.default_rng(seed).random((b, 3, h, w), dtype=np.float32)
    import cv2
    files = sorted(p for p in Path(images).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".bmp"))[:b]
    if len(files) < b:
        raise QATError(f"{images} has {len(files)} images but the comparison needs {b}; pass a folder with more, "
                       f"or a smaller --batch.")
    arrays = []
    for f in files:
        im = cv2.imread(str(f))
        if im is None:
            raise QATError(f"cannot read the image {f}; remove it from {images} or pass another folder.")
        arrays.append(cv2.resize(im, (w, h))[:, :, ::-1].transpose(2, 0, 1))
    return np.ascontiguousarray(np.stack(arrays)).astype(np.float32) / 255


def write_data_loader(work: Path, input_name: str, x: np.ndarray) -> Path:
    """WORK/inputs.npy and a Polygraphy data loader script yielding it (``--data-loader-script``)."""
    work.mkdir(parents=True, exist_ok=True)
    np.save(work / "inputs.npy", x)
    script = work / "data_loader.py"
    write_text(script, f'"""Polygraphy data loader written by yolov9-qat compare: one batch, {list(x.shape)}."""\n'
                       f"import numpy as np\n\n\ndef load_data():\n"
                       f"    yield {{{input_name!r}: np.load({str(work / 'inputs.npy')!r})}}\n")
    return script


def trt_precision_args(version: str, strongly_typed: bool) -> list[str]:
    """Polygraphy's TensorRT build flags matching the toolkit's builds (docs/TENSORRT.md)."""
    from utils.qat.trt.trt_common import version_tuple
    major, _minor = version_tuple(version)
    if major >= 11:
        return []  # strongly typed only; precisions come from the ONNX (Q/DQ, --half)
    return ["--strongly-typed"] if strongly_typed else ["--fp16", "--int8"]


def tolerance_args(outputs: Sequence[str]) -> list[str]:
    atol = [f"{o}:{ATOL.get(o, ATOL['output0'])}" for o in outputs]
    return ["--check-error-stat", "quantile", "--error-quantile", str(ERROR_QUANTILE), "--atol", *atol,
            "--rtol", "1e-5"]


def commands(onnx_path: Path, work: Path, *, outputs: Sequence[str], engine: Path | None = None,
             trt_version: str | None = None, strongly_typed: bool = False, plugins: Sequence[str] = (),
             polygraphy: str = "polygraphy") -> tuple[list[str], list[str] | None]:
    """The two Polygraphy command lines: ONNX Runtime reference, then TensorRT against it (None without a version)."""
    loader = f"{work / 'data_loader.py'}:load_data"
    ref = [polygraphy, "run", str(onnx_path), "--onnxrt", "--data-loader-script", loader,
           "--save-outputs", str(work / "onnxrt.json")]
    plugin_args = ["--plugins", *plugins] if plugins else []
    if engine is not None:
        trt = [polygraphy, "run", str(engine), "--model-type", "engine", "--trt", *plugin_args]
    elif trt_version is not None:
        trt = [polygraphy, "run", str(onnx_path), "--trt", *trt_precision_args(trt_version, strongly_typed),
               *plugin_args]
    else:
        return ref, None
    trt += ["--data-loader-script", loader, "--load-outputs", str(work / "onnxrt.json"),
            "--save-outputs", str(work / "tensorrt.json"), *tolerance_args(outputs)]
    return ref, trt


def load_outputs(path: Path) -> dict[str, np.ndarray]:
    """The outputs of the first iteration of the (only) runner in a Polygraphy ``--save-outputs`` file."""
    from polygraphy.comparator import RunResults
    results = RunResults.load(str(path))
    (_runner, iterations), *_ = list(results.items())
    return {k: np.asarray(v) for k, v in iterations[0].items()}


def detection_agreement(ref: np.ndarray, got: np.ndarray, conf: float = 0.25) -> dict[str, Any]:
    """On the anchors ``ref`` scores above ``conf`` (B x (4 + classes [+ masks]) x A heads; pass only the box and
    class rows): how many keep their class in ``got``, and their box (IoU >= BOX_IOU)."""
    ref, got = ref.astype(np.float64), got.astype(np.float64)
    s_ref = ref[:, 4:].max(1)
    mask = s_ref > conf
    n = int(mask.sum())
    if n == 0:
        return {"confident": 0, "same_class": None, "same_box": None}

    def xyxy(t: np.ndarray) -> np.ndarray:
        xy, wh = t[:, :2], t[:, 2:4]
        return np.concatenate([xy - wh / 2, xy + wh / 2], 1)

    a, b = xyxy(ref), xyxy(got)
    lt, rb = np.maximum(a[:, :2], b[:, :2]), np.minimum(a[:, 2:], b[:, 2:])
    inter = np.clip(rb - lt, 0, None).prod(1)

    def area(t: np.ndarray) -> np.ndarray:
        return (t[:, 2] - t[:, 0]) * (t[:, 3] - t[:, 1])

    iou = inter / np.maximum(area(a) + area(b) - inter, 1e-12)
    same_class = ref[:, 4:].argmax(1) == got[:, 4:].argmax(1)
    return {"confident": n, "same_class": round(float(same_class[mask].mean()), 4),
            "same_box": round(float((iou[mask] >= BOX_IOU).mean()), 4),
            "score_diff_median": round(float(np.median(np.abs(got[:, 4:].max(1) - s_ref)[mask])), 4)}


def verdict(polygraphy_passed: bool, det: dict[str, Any]) -> tuple[bool, str]:
    ok_det = det["confident"] == 0 or (det["same_class"] >= CLASS_AGREEMENT and det["same_box"] >= BOX_AGREEMENT)
    text = (f"Polygraphy {'PASSED' if polygraphy_passed else 'FAILED'} (99th percentile of |TensorRT - ONNX Runtime| "
            f"per output within {', '.join(f'{k} {v:g}' for k, v in ATOL.items())})")
    if det["confident"]:
        text += (f"; {det['confident']} confident anchors: same class {100 * det['same_class']:.1f}%, box IoU >= "
                 f"{BOX_IOU} {100 * det['same_box']:.1f}%")
    ok = polygraphy_passed and ok_det
    return ok, f"verdict: {'MATCH' if ok else 'MISMATCH'}: {text}"


def _run(cmd: Sequence[str], log: Path) -> int:
    print(f"+ {shlex.join(cmd)}", flush=True)
    proc = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    write_text(log, proc.stdout)
    sys.stdout.write(proc.stdout[-4000:])
    return proc.returncode


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/compare_trt.sh", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("onnx", help="the exported ONNX (export_qat.py --include onnx)")
    p.add_argument("--engine", default=None, help="compare this engine (else Polygraphy builds one from the ONNX)")
    p.add_argument("--images", default=None, help="folder of images to feed (default: noise)")
    p.add_argument("--imgsz", type=int, default=640, help="image size for dynamic H/W (default 640)")
    p.add_argument("--batch", type=int, default=4, help="images per comparison for a dynamic batch (default 4)")
    p.add_argument("--conf", type=float, default=0.25, help="score above which an anchor counts as a detection")
    p.add_argument("--plugins", action="append", default=[], metavar="LIB.so", help="TensorRT plugin library")
    p.add_argument("--strongly-typed", action="store_true", help="TensorRT 10: build strongly typed")
    p.add_argument("--work", default=None, help="folder for inputs, outputs and logs (default: ONNX.compare/)")
    p.add_argument("--trt-version", default=None, help="TensorRT version (default: the installed one)")
    p.add_argument("--reference-only", action="store_true", help="run only the ONNX Runtime side (any machine)")
    p.add_argument("--dry-run", action="store_true", help="write the inputs, print the Polygraphy commands, stop")
    return p


def main(args: argparse.Namespace) -> int:
    onnx_path = Path(args.onnx)
    if not onnx_path.is_file():
        raise QATError(f"ONNX file {onnx_path} not found; export it with export_qat.py --include onnx.")
    engine = Path(args.engine) if args.engine else None
    if engine is not None and not engine.is_file():
        raise QATError(f"engine file {engine} not found; build it with scripts/generate_trt_engine.sh, or leave out "
                       f"--engine to let Polygraphy build one.")
    for lib in args.plugins:
        if not Path(lib).is_file():
            raise QATError(f"plugin library {lib} not found; pass the .so file that provides the plugin.")
    if args.batch < 1 or args.imgsz < 1:
        raise QATError(f"--batch and --imgsz must be positive, got {args.batch} and {args.imgsz}.")
    name, dims, outputs = graph_io(onnx_path)
    work = (Path(args.work) if args.work else onnx_path.with_name(onnx_path.name + ".compare")).resolve()
    x = make_inputs(dims, batch=args.batch, imgsz=args.imgsz, images=Path(args.images) if args.images else None)
    write_data_loader(work, name, x)
    version = args.trt_version
    if version is None and not args.reference_only and engine is None:
        from utils.qat.trt.trt_common import INSTALL_TENSORRT, installed_version
        version = installed_version()
        if version is None and not args.dry_run:
            raise QATError("TensorRT is not installed here (Polygraphy's --trt runner needs it, on a GPU host); run "
                           f"with --reference-only for the ONNX Runtime side, or install it with {INSTALL_TENSORRT}.")
    exe = "polygraphy" if args.dry_run else find_polygraphy()
    ref_cmd, trt_cmd = commands(onnx_path, work, outputs=outputs, engine=engine, trt_version=version,
                                strongly_typed=args.strongly_typed, plugins=args.plugins, polygraphy=exe)
    if args.dry_run:
        print(shlex.join(ref_cmd))
        if trt_cmd is not None:
            print(shlex.join(trt_cmd))
        return 0
    if _run(ref_cmd, work / "onnxrt.log") != 0:
        raise QATError(f"Polygraphy could not run {onnx_path} in ONNX Runtime; see {work / 'onnxrt.log'}.")
    if args.reference_only or trt_cmd is None:
        print(f"ONNX Runtime outputs: {work / 'onnxrt.json'} (run again on a GPU host without --reference-only)")
        return 0
    rc = _run(trt_cmd, work / "tensorrt.log")
    if not (work / "tensorrt.json").is_file():
        raise QATError(f"Polygraphy's TensorRT run failed (exit {rc}) before producing outputs; see "
                       f"{work / 'tensorrt.log'}.")
    ok, line = report(work, outputs, rc == 0, args.conf)
    print(line)
    return 0 if ok else 1


def report(work: Path, outputs: Sequence[str], polygraphy_passed: bool, conf: float = 0.25) -> tuple[bool, str]:
    """The verdict from Polygraphy's result and its two saved output files; also WORK/verdict.json."""
    ref, got = load_outputs(work / "onnxrt.json"), load_outputs(work / "tensorrt.json")
    head = outputs[0]
    nc = ref[head].shape[1] - 4 - (ref[outputs[1]].shape[1] if len(outputs) > 1 else 0)
    det = detection_agreement(ref[head][:, :4 + nc], got[head][:, :4 + nc], conf)
    ok, line = verdict(polygraphy_passed, det)
    write_text(work / "verdict.json", json.dumps({"match": ok, "polygraphy_passed": polygraphy_passed,
                                                  "detections": det, "atol": ATOL}, indent=2) + "\n")
    return ok, line


if __name__ == "__main__":
    def _cli() -> None:
        rc = main(get_args_parser().parse_args())
        if rc:
            sys.exit(rc)
    run_cli(_cli)
