"""The quantizers a user would pick instead, run beside this toolkit's from the same FP model, scored by one evaluator.

From one FP checkpoint: its FP ONNX graph (as ``export_qat.py --dynamic`` writes it), the same calibration images
(the first --calib-images of the data's train split, letterboxed into squares as upstream's loader does), then each
peer's INT8 graph, timed from the FP graph to the quantized file:

- ``modelopt-max``, ``modelopt-entropy``: NVIDIA ModelOpt's ONNX PTQ as its command line runs it
  (``python -m modelopt.onnx.quantization --quantize_mode int8 --calibration_method max|entropy``, its other
  settings left at their defaults, which keep what is not quantized in FP16);
- ``nncf``: OpenVINO NNCF's PTQ as Ultralytics' ``format=openvino int8=True`` runs it: the OpenVINO model of the FP
  graph, ``nncf.quantize`` with preset MIXED and the Detect head's box decode (its Add/Sub/Mul/Div, the DFL) and
  every Sigmoid ignored; an OpenVINO IR (.xml), scored on OpenVINO only;
- ``nncf-onnx``: the same call on the ONNX graph itself (NNCF's ONNX backend): a Q/DQ ONNX that ONNX Runtime scores
  exactly, as it scores ours.

and this toolkit's graphs: ``--ours NAME=GRAPH`` (e.g. a ``qat.py quantize`` run's exported graph), and with
``--ptq`` a ``qat.py quantize --ptq-only`` run made here from the same checkpoint and data (``--ptq-args`` adds its
flags), exported and timed the same way. Every graph, the FP one included, is scored with val_trt.py's evaluator
on each --backend (ONNX Runtime: the graph as written; OpenVINO: INT8 kernels, where this CPU computes them as
written), and every difference from FP on the same runtime gets its 95% paired-bootstrap interval over the images
(``utils/qat/evaluation/resample.py``): a difference whose interval holds 0 is a tie. So does each of this toolkit's
graphs against each peer's, and each of its later graphs against its first (settings of ours told apart). Writes OUT/LABEL.json,
OUT/LABEL.md and OUT/LABEL.png (the differences with their intervals), updated after every graph, and the graphs
and logs in OUT/LABEL-work/.

Run from the top of a patched YOLOv9 tree (``--peers`` needs ``./install_dependencies.sh --peers`` for NNCF):

    python3 benchmarks/peers.py --weights yolov9-t-coco.pt --data coco.yaml --ptq \\
        --peers modelopt-max modelopt-entropy nncf nncf-onnx --backend onnxruntime openvino \\
        --out runs/peers --label yolov9-t
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))  # benchmarks/parts/
from utils.qat.core import compat  # noqa: E402

compat.apply()

from utils.qat.core.atomic import atomic_path, write_text  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.core.validate import check_args  # noqa: E402
from utils.qat.evaluation.backends import RUNTIMES  # noqa: E402

from parts import portable  # noqa: E402

PEERS = {
    "modelopt-max": "NVIDIA ModelOpt ONNX PTQ, max",
    "modelopt-entropy": "NVIDIA ModelOpt ONNX PTQ, entropy",
    "nncf": "OpenVINO NNCF PTQ (IR), MIXED, as Ultralytics",
    "nncf-onnx": "OpenVINO NNCF PTQ (ONNX), MIXED",
}
BACKENDS = ("onnxruntime", "openvino")
CALIB_IMAGES = 400  # qat.py quantize's default: 25 batches of 16


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, type=Path, help="the FP checkpoint (.pt)")
    p.add_argument("--data", required=True, help="dataset yaml: its train split calibrates, its val split is scored")
    p.add_argument("--peers", nargs="*", choices=sorted(PEERS), default=["modelopt-max", "modelopt-entropy"],
                   help="the peers to run (default: %(default)s)")
    p.add_argument("--ours", action="append", default=[], metavar="NAME=GRAPH",
                   help="one of this toolkit's graphs to score beside them (repeatable)")
    p.add_argument("--ptq", action="store_true",
                   help="also run qat.py quantize --ptq-only here on the same checkpoint and data, timed, and score "
                        "its graph")
    p.add_argument("--ptq-args", default="", help="more flags for that run, e.g. '--device cpu --search-layers 0-5'")
    p.add_argument("--backend", nargs="+", choices=BACKENDS, default=["onnxruntime"],
                   help="runtimes that score every graph (default: onnxruntime)")
    p.add_argument("--calib-images", type=int, default=CALIB_IMAGES,
                   help="calibration images, the first of the train split (default %(default)s, qat.py's default "
                        "25 x 16; the split may hold fewer)")
    p.add_argument("--imgsz", type=int, default=640, help="calibration and evaluation size (default 640)")
    p.add_argument("--batch-size", type=int, default=32, help="evaluation batch (default 32, as val_trt.py)")
    p.add_argument("--num-image", type=int, default=None, help="score on the first N val images (default all)")
    p.add_argument("--workers", type=int, default=4, help="dataloader workers")
    p.add_argument("--out", required=True, type=Path, help="folder of LABEL.json, LABEL.md and LABEL.png")
    p.add_argument("--label", default="peers", help="name of the result files (default: %(default)s)")
    return p


# ---------------------------------------------------------------------------------------------- inputs
def calibration_images(data: dict, n: int, imgsz: int):
    """The first ``n`` images of the train split, letterboxed into imgsz squares as upstream's loader letterboxes
    (centred, grey 114), RGB, NCHW float32 in [0, 1]."""
    import cv2
    import numpy as np

    from utils.augmentations import letterbox
    from utils.qat.core.progress import progress
    from utils.qat.evaluation.data import _split_images
    files = _split_images(data, "train")[:n]
    out = np.empty((len(files), 3, imgsz, imgsz), np.float32)
    for i, f in enumerate(progress(files, desc="calibration images")):
        im = cv2.imread(f)
        if im is None:
            raise QATError(f"cannot read {f} as an image; remove it from the train split.")
        im = letterbox(im, imgsz, auto=False)[0]
        out[i] = im[:, :, ::-1].transpose(2, 0, 1) / 255.0
    return out


def fp_graph(weights: Path, path: Path, imgsz: int) -> None:
    """The FP graph, as ``export_qat.py --dynamic`` writes it (the toolkit's one exporter)."""
    from utils.qat.onnx.onnx_export import export_onnx, load_for_export
    model, _task, quantized, fp_patterns = load_for_export(weights)
    if quantized:
        raise QATError(f"{weights} is a quantized checkpoint; pass the FP weights the peers and --ptq start from.")
    export_onnx(model, path, imgsz=imgsz, dynamic=True, allow_fp=fp_patterns, metadata={"source": weights.name})


def head_scope(graph: Path) -> str:
    """The ONNX name scope of the module that makes the first output (the Detect head, e.g. ``/model/model.22``)."""
    import onnx
    model = onnx.load(str(graph), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer.get(model.graph.output[0].name)
    if node is None or "/" not in node.name:
        raise QATError(f"{graph}'s first output is not made by a named module; export it with export_qat.py.")
    return node.name.rsplit("/", 1)[0]


# ---------------------------------------------------------------------------------------------- the peers
def _log_tail(log: Path, lines: int = 5) -> str:
    text = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return " | ".join(line.strip() for line in text[-lines:])


def modelopt(fp: Path, calib_npy: Path, method: str, out: Path, shape: tuple[int, ...], log: Path) -> None:
    """ModelOpt's ONNX PTQ command line, its defaults kept, on a copy of the FP graph in a folder of its own (it
    writes its intermediate graphs beside its input, and was seen rewriting that input). A ``tensorrt`` that is only
    type stubs (tensorrt-stubs, --dev) is hidden from it: ModelOpt takes any importable ``tensorrt`` for TensorRT."""
    import importlib.util
    import shutil
    own = out.parent / f"{out.stem}-input"
    own.mkdir(exist_ok=True)
    fp = Path(shutil.copy(fp, own / fp.name))
    spec = importlib.util.find_spec("tensorrt")
    stubs_only = spec is not None and spec.origin in (None, "namespace")
    runner = ("import runpy, sys; sys.modules['tensorrt'] = None; "
              "runpy.run_module('modelopt.onnx.quantization', run_name='__main__', alter_sys=True)")
    cmd = [sys.executable, *(["-c", runner] if stubs_only else ["-m", "modelopt.onnx.quantization"]),
           "--onnx_path", str(fp), "--quantize_mode", "int8", "--calibration_method", method,
           "--calibration_data_path", str(calib_npy), "--calibration_shapes", f"images:{'x'.join(map(str, shape))}",
           "--output_path", str(out)]
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0 or not out.is_file():
        raise QATError(f"ModelOpt's ONNX PTQ ({method}) failed (exit {rc}): {_log_tail(log)}; its log is {log}.")


def nncf_ignored(scope: str):
    """Ultralytics' ignored scope for NNCF (its exporter's ``ignored_scope``), in this graph's names: the Detect
    head's own Add/Sub/Mul/Div nodes (the box decode, not its convolution branches) and its DFL, and every
    Sigmoid."""
    import re

    import nncf
    head = re.escape(scope)
    return nncf.IgnoredScope(patterns=[rf"{head}/(Add|Sub|Mul|Div)(_\d+)?", rf"{head}/dfl/.*"], types=["Sigmoid"],
                             validate=False)


def run_nncf(fp: Path, calib, out: Path, *, ir: bool) -> None:
    """``nncf.quantize`` with Ultralytics' settings on the OpenVINO model of ``fp`` (``ir``; saved as an IR) or on
    the ONNX graph itself (a Q/DQ ONNX)."""
    import nncf
    import onnx
    scope = head_scope(fp)
    if ir:
        import openvino as ov
        model = ov.convert_model(str(fp))
        name = None
    else:
        model = onnx.load(str(fp))
        name = model.graph.input[0].name
    dataset = nncf.Dataset(list(range(len(calib))),
                           (lambda i: calib[i:i + 1]) if ir else (lambda i: {name: calib[i:i + 1]}))
    q = nncf.quantize(model, dataset, preset=nncf.QuantizationPreset.MIXED, subset_size=len(calib),
                      ignored_scope=nncf_ignored(scope))
    with atomic_path(out) as tmp:
        if ir:
            import openvino as ov
            ov.save_model(q, str(tmp.with_suffix(".xml")), compress_to_fp16=False)
            tmp.with_suffix(".xml").replace(tmp)
            tmp.with_suffix(".bin").replace(out.with_suffix(".bin"))
        else:
            onnx.save(q, str(tmp))


def ours_ptq(args: argparse.Namespace, work: Path, log: Path) -> Path:
    """``qat.py quantize --ptq-only`` on the same checkpoint and data, then its graph as ``export_qat.py
    --dynamic`` writes it: the PTQ checkpoint's path in ``work``."""
    cmd = [sys.executable, "qat.py", "quantize", "--weights", str(args.weights), "--data", args.data, "--ptq-only",
           "--imgsz", str(args.imgsz), "--project", str(work), "--name", "ptq", "--exist-ok",
           *shlex.split(args.ptq_args)]
    with open(log, "w") as f:
        f.write(shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    found = sorted((work / "ptq" / "weights").glob("ptq*.pt"))
    if rc != 0 or not found:
        raise QATError(f"qat.py quantize --ptq-only failed (exit {rc}): {_log_tail(log)}; its log is {log}.")
    return found[0]


def export_quantized(checkpoint: Path, out: Path, imgsz: int) -> None:
    from utils.qat.onnx.onnx_export import export_onnx, load_for_export
    model, _task, _q, fp_patterns = load_for_export(checkpoint)
    export_onnx(model, out, imgsz=imgsz, dynamic=True, allow_fp=fp_patterns, metadata={"source": checkpoint.name})


# ---------------------------------------------------------------------------------------------- measuring
# Ops that carry 8-bit values unchanged (a quantized input stays quantized through them): a convolution behind them
# and a Q/DQ pair (or an OpenVINO FakeQuantize) is fed 8-bit data, as TensorRT and OpenVINO run it.
CARRY_ONNX = {"Concat", "Split", "Slice", "MaxPool", "Reshape", "Transpose", "Resize", "Identity"}
CARRY_OPENVINO = {"Concat", "Split", "VariadicSplit", "StridedSlice", "Slice", "MaxPool", "Reshape", "Transpose",
                  "Interpolate"}


def _fed_quantized(node, kind, inputs, quantizer: str, carry: set[str], depth: int = 0) -> bool:
    """Whether every data input of ``node`` comes from a ``quantizer`` node, directly or through ``carry`` ops
    (``inputs(node)``: its data inputs' producers, None for a graph input or a constant)."""
    if node is None or depth > 64:
        return False
    if kind(node) == quantizer:
        return True
    return kind(node) in carry and all(_fed_quantized(p, kind, inputs, quantizer, carry, depth + 1)
                                       for p in inputs(node))


def int8_convolutions(graph: Path) -> str:
    """``quantized/all`` convolutions: those fed 8-bit data, through a DequantizeLinear (ONNX) or a FakeQuantize
    (OpenVINO IR), directly or through ops that carry 8-bit values (:data:`CARRY_ONNX`)."""
    if graph.suffix == ".xml":
        from utils.qat.evaluation.openvino_core import shared_core
        ops = shared_core().read_model(str(graph)).get_ops()

        def ov_inputs(op):
            n = op.get_input_size() if op.get_type_name() == "Concat" else 1
            return [op.input_value(i).get_node() for i in range(n)]
        convs = [op for op in ops if op.get_type_name() == "Convolution"]
        quantized = [op for op in convs if _fed_quantized(op.input_value(0).get_node(), lambda o: o.get_type_name(),
                                                          ov_inputs, "FakeQuantize", CARRY_OPENVINO)]
        return f"{len(quantized)}/{len(convs)}"
    import onnx
    model = onnx.load(str(graph), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}

    def onnx_inputs(n):
        names = n.input if n.op_type == "Concat" else n.input[:1]
        return [producer.get(x) for x in names]
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    quantized = [n for n in convs if _fed_quantized(producer.get(n.input[0]), lambda n: n.op_type, onnx_inputs,
                                                    "DequantizeLinear", CARRY_ONNX)]
    return f"{len(quantized)}/{len(convs)}"


def score(graph: Path, runtime: str, data: dict, args: argparse.Namespace):
    """val_trt.py's evaluation of one graph on one runtime: the Metrics, or a sentence saying why it was not
    scored (an IR on ONNX Runtime; OpenVINO where this CPU does not compute INT8 as written)."""
    from utils.qat.evaluation.backends import OpenVINOBackend, ORTBackend
    from utils.qat.evaluation.evaluate import evaluate
    if graph.suffix == ".xml" and runtime != "openvino":
        return "an OpenVINO IR: OpenVINO only"
    backend = OpenVINOBackend(graph) if runtime == "openvino" else ORTBackend(graph, arithmetic="float")
    if getattr(backend, "inexact", False):
        return "OpenVINO does not compute INT8 as written on this CPU"
    return evaluate(backend, data, task="detect", imgsz=args.imgsz, batch_size=args.batch_size,
                    workers=args.workers, num_images=args.num_image, desc=f"{graph.name} on {RUNTIMES[runtime]}")


def versions() -> dict:
    from importlib import metadata
    out = {}
    for name in ("nvidia-modelopt", "nncf", "openvino", "onnxruntime", "onnx", "torch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---------------------------------------------------------------------------------------------- results
def _differences(reference: dict, others: list[dict], kept: dict, key: str) -> list[dict]:
    """Each of this toolkit's ``others`` against the ``reference`` row on every runtime both were scored on: the
    difference (other minus reference) with its paired-bootstrap interval over the images; ``key`` names the
    reference in each record."""
    from utils.qat.evaluation.resample import PairedBootstrap, record, shown
    out = []
    for runtime in reference["scores"]:
        if (reference["name"], runtime) not in kept:
            continue
        paired = PairedBootstrap(kept[reference["name"], runtime])
        for other in others:
            if (other["name"], runtime) in kept:
                d = paired(kept[other["name"], runtime])
                out.append({"ours": other["name"], key: reference["name"], "runtime": runtime, **record(d),
                            "shown": shown(d), "tie": d.tie})
    return out


def _ours(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("tool") == "yolov9-qat"]


def versus(rows: list[dict], kept: dict) -> list[dict]:
    """Each of this toolkit's rows against each peer's on the same runtime (toolkit minus peer), so that a lead is
    called one only where its interval excludes 0."""
    return [d for peer in rows if peer.get("tool") in PEERS for d in _differences(peer, _ours(rows), kept, "peer")]


def within(rows: list[dict], kept: dict) -> list[dict]:
    """Each of this toolkit's later rows against its first (the ``--ptq`` run where there is one, else the first
    ``--ours``) on the same runtime (later minus first), so that two settings of ours are told apart only where the
    interval excludes 0."""
    ours = _ours(rows)
    return _differences(ours[0], ours[1:], kept, "first") if ours else []


def _pairs(against: str, order: str, key: str, column: str, words: tuple[str, str], entries: list[dict]) -> list[str]:
    """The table of paired differences ``entries`` (:func:`versus` or :func:`within` records), with its sentence;
    ``words``: what a difference above 0 and below 0 is called where its interval excludes 0."""
    from utils.qat.evaluation.resample import INTERVAL
    if not entries:
        return []
    lines = ["", f"This toolkit's graphs {against}, on the same runtime and images ({order}, {INTERVAL:.0%} "
             "paired-bootstrap interval; a tie where it holds 0):", "",
             f"| this toolkit | {column} | runtime | difference |", "|---|---|---|---|"]
    for v in entries:
        called = "" if v["tie"] else f" ({words[0] if v['AP'] > 0 else words[1]})"
        lines.append(f"| {v['ours']} | {v[key]} | {RUNTIMES[v['runtime']]} | {v['shown']}{called} |")
    return lines


def render(doc: dict) -> str:
    from utils.qat.evaluation.resample import INTERVAL
    calibration = ", ".join(f"{r['calibration_s']} s" for r in doc["rows"] if r.get("calibration_s"))
    if calibration:
        calibration = (f" (this toolkit's `qat.py quantize` scores the FP and the PTQ model too; its calibration "
                       f"and searches alone took {calibration})")
    lines = [f"# {doc['label']}: INT8 quantizers side by side", "",
             f"Made by `{doc['command']}` ({doc['date']}). {doc['weights']}, calibrated on the first "
             f"{doc['calibration']['images']} train images at {doc['imgsz']} px, scored on {doc['images']} val images "
             f"(mAP50-95; val_trt.py's evaluator and protocol). `vs FP` is the difference from the FP graph on the "
             f"same runtime with its {INTERVAL:.0%} paired-bootstrap interval over the images: a difference whose "
             f"interval holds 0 is a tie. Quantize time is from the FP model to the INT8 file, on this machine{calibration}.", "",
             f"Machine: {doc['machine']}. Versions: "
             + ", ".join(f"{k} {v}" for k, v in doc["versions"].items() if v) + ".", "",
             "| quantizer | runtime | mAP50-95 | mAP50 | vs FP | INT8 convolutions | quantize s |",
             "|---|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        for runtime, r in row["scores"].items():
            cell = r.get("vs_fp_shown", "") if "AP" in r else ""
            ap = f"{r['AP']:.4f}" if "AP" in r else f"- ({r['skipped']})"
            ap50 = f"{r['AP50']:.4f}" if "AP50" in r else ""
            lines.append(f"| {row['name']} | {RUNTIMES[runtime]} | {ap} | {ap50} | {cell} | "
                         f"{row.get('int8_convolutions', '')} | {row.get('quantize_s', '')} |")
    lines += _pairs("against each peer's", "toolkit minus peer", "peer", "peer", ("lead", "behind"),
                    doc.get("versus", []))
    lines += _pairs("against its first", "later minus first", "first", "against", ("higher", "lower"),
                    doc.get("within", []))
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: Path) -> None:
    from utils.qat.run.reports import _pyplot
    points = [(f"{row['name']} ({RUNTIMES[rt]})", r) for row in doc["rows"] for rt, r in row["scores"].items()
              if "vs_fp" in r]
    if not points:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(points) + 1.4), dpi=120)
    for i, (_name, r) in enumerate(points):
        lo, hi = r["vs_fp"]["interval"]
        d = r["vs_fp"]["AP"]
        ax.errorbar(d, i, xerr=[[d - lo], [hi - d]], fmt="o", color="C0" if lo <= 0 <= hi else "C3", capsize=3)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(points)), [n for n, _ in points], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("mAP50-95 minus FP (same runtime; 95% paired interval, red where it excludes 0)", fontsize=8)
    ax.locator_params(axis="x", nbins=6)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(doc["label"], fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def save(doc: dict, out: Path) -> None:
    write_text(out / f"{doc['label']}.json", portable.text(json.dumps(doc, indent=2), work=out))
    write_text(out / f"{doc['label']}.md", portable.text(render(doc), work=out))
    plot(doc, out / f"{doc['label']}.png")


def parse_ours(specs: list[str]) -> dict[str, Path]:
    ours: dict[str, Path] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise QATError(f"--ours {spec} is not NAME=GRAPH; e.g. --ours 'QAT, last epoch'=runs/qat/exp/qat.onnx.")
        if not Path(path).is_file():
            raise QATError(f"--ours {name}: {path} not found; pass a graph export_qat.py wrote.")
        ours[name] = Path(path)
    return ours


def main(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation.cpu_bench import cpu_info
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.evaluation.resample import PairedBootstrap, record, save_images, shown
    check_args(args)
    if not args.weights.is_file():
        raise QATError(f"--weights {args.weights} not found; pass the FP checkpoint.")
    ours = parse_ours(args.ours)
    if any(p.startswith("nncf") for p in args.peers):
        try:
            import nncf  # noqa: F401
        except ImportError:
            raise QATError("NNCF is not installed: ./install_dependencies.sh --peers installs it (and OpenVINO); "
                           "or leave nncf out of --peers.") from None
    if "openvino" in args.backend or "nncf" in args.peers:
        from utils.qat.evaluation.backends import require_openvino
        require_openvino()
    data = load_data_yaml(args.data, splits=("train", "val"))
    work = args.out / f"{args.label}-work"
    work.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    doc: dict = {"label": args.label, "command": portable.command(work=args.out),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "weights": args.weights.name,
                 "imgsz": args.imgsz, "images": None, "versions": versions(),
                 "machine": f"{cpu['model']}, {cpu['cpus']} CPUs usable", "calibration": {}, "rows": []}

    print("==> the FP graph and the calibration images", flush=True)
    fp = work / "fp.onnx"
    fp_graph(args.weights, fp, args.imgsz)
    calib = calibration_images(data, args.calib_images, args.imgsz)
    doc["calibration"] = {"images": len(calib), "split": "train", "first": True}
    graphs: list[tuple[str, Path, dict]] = [("FP", fp, {})]
    if any(p.startswith("modelopt") for p in args.peers):
        import numpy as np
        calib_npy = work / "calibration.npy"
        with atomic_path(calib_npy) as tmp, open(tmp, "wb") as f:
            np.save(f, calib)
    if args.ptq:
        print("==> qat.py quantize --ptq-only", flush=True)
        start = time.time()
        ckpt = ours_ptq(args, work, work / "ptq.log")
        export_quantized(ckpt, work / "ours-ptq.onnx", args.imgsz)
        report = json.loads((work / "ptq" / "report.json").read_text())
        graphs.append(("this toolkit, PTQ " + (args.ptq_args or "(defaults)"), work / "ours-ptq.onnx",
                       {"quantize_s": round(time.time() - start, 1), "tool": "yolov9-qat",
                        "calibration_s": report.get("calibration_seconds")}))
    for name, path in ours.items():
        graphs.append((name, path, {"tool": "yolov9-qat"}))
    for peer in args.peers:
        print(f"==> {PEERS[peer]}", flush=True)
        out = work / (f"{peer}.xml" if peer == "nncf" else f"{peer}.onnx")
        start = time.time()
        if peer.startswith("modelopt"):
            modelopt(fp, calib_npy, peer.split("-")[1], out, (1, 3, args.imgsz, args.imgsz), work / f"{peer}.log")
        else:
            run_nncf(fp, calib, out, ir=peer == "nncf")
        graphs.append((PEERS[peer], out, {"quantize_s": round(time.time() - start, 1), "tool": peer}))
    del calib

    references: dict[str, PairedBootstrap] = {}
    kept: dict[tuple[str, str], object] = {}  # (row, runtime) -> its Metrics, for the comparisons between rows
    for name, path, facts in graphs:
        row = {"name": name, "graph": str(path), **facts, "scores": {}}
        if name != "FP":
            row["int8_convolutions"] = int8_convolutions(path)
        for runtime in args.backend:
            m = score(path, runtime, data, args)
            if isinstance(m, str):
                row["scores"][runtime] = {"skipped": m}
                continue
            doc["images"] = m.images
            r = {"AP": round(m.mAP50_95, 4), "AP50": round(m.mAP50, 4)}
            if name == "FP":
                references[runtime] = PairedBootstrap(m)
            elif runtime in references:
                d = references[runtime](m)
                r.update(vs_fp=record(d), vs_fp_shown=shown(d), tie=d.tie)
            row["scores"][runtime] = r
            kept[name, runtime] = m
            save_images(m, work / f"{len(doc['rows'])}-{runtime}.npz")
        doc["rows"].append(row)
        save(doc, args.out)
    doc["versus"] = versus(doc["rows"], kept)
    doc["within"] = within(doc["rows"], kept)
    save(doc, args.out)
    print(render(doc))
    print(f"wrote {args.out / args.label}.json, .md and .png")
    return doc


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
