"""One quantized checkpoint, every arithmetic it is scored in: does it score the same in PyTorch on a GPU, in PyTorch
on a CPU with every thread and with one, and as its exported graph on ONNX Runtime and on OpenVINO?

    python3 benchmarks/ckpt_vs_graph.py --weights runs/qat/exp/weights/qat_best_yolov9-t.pt --data coco.yaml \\
        --out runs/one-score --label yolov9-t-qat

Exports each checkpoint as ``export_qat.py --dynamic`` does (or scores ``--graph``) and scores it once in each of
``--arithmetics`` with the one evaluator, at the same batch and protocol:

==========  ===============================================================================================
gpu         the checkpoint in PyTorch on the first GPU, as qat.py evaluates it (integer convolutions, float32 elsewhere)
cpu         the checkpoint in PyTorch on the CPU, every thread this process has
cpu1        the checkpoint in PyTorch on the CPU, one thread
ort         its graph on ONNX Runtime in integer arithmetic, as val_trt.py scores it (integer convolutions, a SiLU
            rounded once: utils/qat/onnx/integer_graph.py)
openvino    its graph on OpenVINO, floating point in f32 (refused on CPUs whose INT8 convolutions saturate)
ort-float   its graph as ONNX Runtime runs the file itself (float32 convolutions of the dequantized values)
ort-basic   its graph on ONNX Runtime with its basic rewrites only (each operator as ONNX defines it)
==========  ===============================================================================================

For each checkpoint the table gives every score, each one's difference from the reference arithmetic (``--reference``,
by default the first of gpu, cpu, cpu1, ort, openvino that was scored) with its 95% paired-bootstrap interval over the
images, how many images came out with the same detections as the reference's, and the spread (largest minus smallest
score of gpu, cpu, cpu1, ort and openvino: where the checkpoint is scored, and the graph as val_trt.py and OpenVINO
score it; ort-float and ort-basic, ONNX Runtime's float path for a Q/DQ convolution, are shown beside). Scores are
kept per arithmetic, image by image (``OUT/LABEL-images/``), so a set begun on a GPU machine can be finished on
another: run again with the same ``--out`` and ``--label`` and the other ``--arithmetics``, and the rows of the
checkpoints already there (the same file, by its SHA-256) keep the scores they have. Why the arithmetics part at all:
docs/RESULTS.md "One model, one score". Writes OUT/LABEL.json, OUT/LABEL.md and the graphs in OUT/LABEL-graphs/.

How far can an arithmetic's rounding alone move the score? ``--silu-ulp-draws N`` scores each checkpoint N more
times in PyTorch (on the GPU where there is one), each time with every SiLU one float32 step off on a random half of
its outputs (seeds 1..N): a runtime whose sigmoid rounds its own way, as OpenVINO's does. The range of those scores
is the part of a difference between runtimes that says nothing about the model.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))  # benchmarks/parts/
from utils.qat.core import compat  # noqa: E402

compat.apply()

from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.core.validate import check_args  # noqa: E402

from parts import portable  # noqa: E402

ARITHMETICS = {
    "gpu": "PyTorch, GPU",
    "cpu": "PyTorch, CPU",
    "cpu1": "PyTorch, CPU, 1 thread",
    "ort": "ONNX Runtime",
    "openvino": "OpenVINO",
    "ort-float": "ONNX Runtime, float",
    "ort-basic": "ONNX Runtime, basic",
}
ORT_ARITHMETIC = {"ort": "integer", "ort-float": "float", "ort-basic": "basic"}  # ORTBackend's arithmetic of each
DEPLOYED = ("gpu", "cpu", "cpu1", "ort", "openvino")  # the arithmetics users score or ship with, in reference order


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", required=True, type=Path, help="quantized checkpoints (qat.py quantize)")
    p.add_argument("--graph", nargs="+", type=Path, default=None,
                   help="their exported graphs, in the same order (default: export each into OUT/LABEL-graphs/, or "
                        "reuse the one a run before exported there)")
    p.add_argument("--arithmetics", nargs="+", default=["auto"], choices=["auto", *ARITHMETICS],
                   help="where each checkpoint is scored (default auto: gpu where there is one, cpu, cpu1, ort, "
                        "openvino where it is installed and computes INT8 exactly on this CPU, and ort-float)")
    p.add_argument("--reference", choices=DEPLOYED, default=None,
                   help="the arithmetic the others are compared with (default: the first of "
                        f"{', '.join(DEPLOYED)} that was scored)")
    p.add_argument("--data", required=True, help="dataset yaml: its val split is scored")
    p.add_argument("--imgsz", type=int, default=640, help="evaluation size (default 640)")
    p.add_argument("--batch-size", type=int, default=16, help="evaluation batch (default 16; the one protocol makes "
                                                               "scores independent of it)")
    p.add_argument("--num-image", type=int, default=None, help="score on the first N val images (default all)")
    p.add_argument("--workers", type=int, default=4, help="dataloader workers")
    p.add_argument("--conf-tol", type=float, default=1e-3,
                   help="confidences this close count as the same detection (default %(default)s)")
    p.add_argument("--silu-ulp-draws", type=int, default=0,
                   help="also score each checkpoint N times with its SiLUs one float32 step off on a random half of "
                        "their outputs (seeds 1..N; default 0: not at all)")
    p.add_argument("--out", required=True, type=Path, help="folder of LABEL.json, LABEL.md and the per-image scores")
    p.add_argument("--label", default="one-score", help="name of the result files (default: %(default)s)")
    return p


def same_detections(a, b, tol: float) -> bool:
    """Whether two per-image statistics ``(correct, conf, pred_cls, target_cls)`` hold the same detections: as many,
    of the same classes, confidences within ``tol``, matched to the labels alike (compared in confidence order)."""
    import numpy as np
    if a is None or b is None:
        return a is None and b is None
    (ca, fa, pa, _), (cb, fb, pb, _) = ([np.asarray(t) for t in s] for s in (a, b))
    if len(fa) != len(fb):
        return False
    ia, ib = np.lexsort((-fa, pa)), np.lexsort((-fb, pb))
    return bool(np.array_equal(pa[ia], pb[ib]) and np.allclose(fa[ia], fb[ib], rtol=0, atol=tol)
                and np.array_equal(ca[ia], cb[ib]))


def available(requested: list[str]) -> list[str]:
    """``--arithmetics`` resolved: ``auto`` is every deployed arithmetic this machine can run; one it cannot is refused
    in one sentence."""
    import torch
    openvino = _openvino_exact()
    if requested == ["auto"]:
        deployed = [a for a in DEPLOYED if (a != "gpu" or torch.cuda.is_available()) and (a != "openvino" or openvino)]
        return [*deployed, "ort-float"]
    if "auto" in requested:
        raise QATError("--arithmetics auto stands alone; name the arithmetics, or give auto only.")
    if "gpu" in requested and not torch.cuda.is_available():
        raise QATError("--arithmetics gpu needs a CUDA GPU and this machine has none; leave gpu out (and score it on a "
                       "GPU machine into the same --out and --label).")
    if "openvino" in requested and not openvino:
        raise QATError("--arithmetics openvino: OpenVINO is not installed, or its INT8 convolutions saturate on this "
                       "CPU (it would score another model than the graph); install it (install_dependencies.sh "
                       "--openvino) or score openvino on a CPU with VNNI or AMX into the same --out and --label.")
    return list(dict.fromkeys(requested))


def _openvino_exact() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    from utils.qat.evaluation.openvino_probe import openvino_int8_exact
    return openvino_int8_exact()


@contextlib.contextmanager
def _threads(n: int | None):
    """PyTorch's intra-op threads set to ``n`` inside the block (None: unchanged)."""
    import torch
    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def _backend(arithmetic: str, model: Callable, graph: Path, task: str):
    """The evaluator's backend for one arithmetic, and the intra-op threads it runs with (None: the default).
    ``model()``: the quantized checkpoint, loaded at the first call."""
    import torch

    from utils.qat.evaluation.backends import OpenVINOBackend, ORTBackend, TorchBackend
    if arithmetic in ("ort", "ort-float", "ort-basic"):
        return ORTBackend(graph, arithmetic=ORT_ARITHMETIC[arithmetic]), None
    if arithmetic == "openvino":
        return OpenVINOBackend(graph), None
    if arithmetic == "gpu":
        return TorchBackend(model(), torch.device("cuda:0"), task=task), None
    return TorchBackend(model(), torch.device("cpu"), task=task), 1 if arithmetic == "cpu1" else None


def score(arithmetic: str, weights: Path, model: Callable, graph: Path, task: str, data: dict,
          args: argparse.Namespace, images: Path) -> dict:
    """Scores one checkpoint in one arithmetic; keeps its per-image statistics in ``images`` and returns its entry."""
    from utils.qat.evaluation.cpu_bench import cpu_info
    from utils.qat.evaluation.evaluate import evaluate
    from utils.qat.evaluation.resample import save_images
    backend, threads = _backend(arithmetic, model, graph, task)
    with _threads(threads) as used:
        start = time.time()
        m = evaluate(backend, data, task=task, imgsz=args.imgsz, batch_size=args.batch_size, workers=args.workers,
                     num_images=args.num_image, desc=f"{weights.name}: {ARITHMETICS[arithmetic]}")
        seconds = time.time() - start
    save_images(m, images / f"{weights.stem}.{arithmetic}.npz")
    if arithmetic == "gpu":
        import torch
        where = torch.cuda.get_device_name(0)
    else:
        cpu = cpu_info()
        where = f"{cpu['model']}, {used if arithmetic in ('cpu', 'cpu1') else cpu['cpus']} threads"
    return {"AP": round(m.mAP50_95, 4), "AP50": round(m.mAP50, 4), "images": m.images, "where": where,
            "seconds": round(seconds, 1), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def ulp_draws(weights: Path, model: Callable, task: str, data: dict, args: argparse.Namespace) -> dict:
    """The checkpoint scored ``--silu-ulp-draws`` times, each with its SiLUs one step off on a random half of their
    outputs (seeds 1..N), in PyTorch on the GPU where there is one, else on the CPU."""
    import torch

    from utils.qat.evaluation.backends import TorchBackend
    from utils.qat.evaluation.evaluate import evaluate
    on = "gpu" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda:0" if on == "gpu" else "cpu")
    scores = []
    for seed in range(1, args.silu_ulp_draws + 1):
        m = evaluate(TorchBackend(model(), device, task=task, silu_ulp_seed=seed), data, task=task, imgsz=args.imgsz,
                     batch_size=args.batch_size, workers=args.workers, num_images=args.num_image,
                     desc=f"{weights.name}: SiLU one step off, draw {seed}")
        scores.append(round(m.mAP50_95, 4))
    return {"on": on, "AP": scores}


def compare(row: dict, images: Path, reference: str | None, tol: float) -> None:
    """Fills ``row`` with each arithmetic's difference from the reference (paired interval, same detections) and the
    spread of the deployed arithmetics' scores, from the per-image statistics kept in ``images``."""
    from utils.qat.evaluation.resample import PairedBootstrap, load_images, record, shown
    scored = row["scores"]
    reference = reference or next((a for a in DEPLOYED if a in scored), None)
    if reference is None or reference not in scored:
        raise QATError(f"--reference {reference}: {row['weights']} was not scored there; score it (--arithmetics) or "
                       f"pick one of {', '.join(scored)}.")
    stats = {a: load_images(images / f"{Path(row['weights']).stem}.{a}.npz") for a in scored}
    for s in stats.values():  # an image by its file name: machines keep the data in other folders
        for image in s.per_image:
            image.path = Path(image.path).name
    paired = PairedBootstrap(stats[reference])
    by_path = {a: {i.path: i.box for i in s.per_image} for a, s in stats.items()}
    row["reference"], row["vs_reference"] = reference, {}
    for a in scored:
        if a == reference:
            continue
        d = paired(stats[a])
        same = sum(same_detections(box, by_path[a].get(p), tol) for p, box in by_path[reference].items())
        row["vs_reference"][a] = {**record(d), "shown": shown(d), "tie": d.tie, "same_detections": same}
    deployed = [scored[a]["AP"] for a in DEPLOYED if a in scored]
    row["spread"] = round(max(deployed) - min(deployed), 4)


def render(doc: dict) -> str:
    lines = [f"# {doc['label']}: one checkpoint, every arithmetic", "",
             f"Made by `{doc['command']}`: each quantized checkpoint scored by the one evaluator ({doc['imgsz']} px, "
             f"batch {doc['batch_size']}, mAP50-95) in each arithmetic below. Each difference is from the row's "
             f"reference arithmetic, with its 95% paired-bootstrap interval over the images and the images whose "
             f"detections are the same (count, classes, confidences within {doc['conf_tol']}, matches); `spread`: "
             f"the largest minus the smallest of {', '.join(DEPLOYED)}.", ""]
    for r in doc["rows"]:
        lines += [f"## {r['weights']}", "", f"Reference: {ARITHMETICS[r['reference']]}; spread {r['spread']:.4f}.", "",
                  "| arithmetic | mAP50-95 | minus reference | same detections | scored on |", "|---|---|---|---|---|"]
        for a in ARITHMETICS:
            if a not in r["scores"]:
                continue
            s = r["scores"][a]
            vs = r["vs_reference"].get(a)
            diff = "reference" if vs is None else vs["shown"]
            same = "" if vs is None else f"{vs['same_detections']} / {s['images']}"
            lines.append(f"| {ARITHMETICS[a]} | {s['AP']:.4f} | {diff} | {same} | {s['where']}, {s['date']} |")
        lines.append("")
        if r.get("silu_ulp"):
            draws, ref = r["silu_ulp"]["AP"], r["scores"][r["reference"]]["AP"]
            lines += [f"With every SiLU one float32 step off on a random half of its outputs ({len(draws)} draws, "
                      f"{ARITHMETICS[r['silu_ulp']['on']]}): mAP50-95 {min(draws):.4f} to {max(draws):.4f}, "
                      f"{min(draws) - ref:+.4f} to {max(draws) - ref:+.4f} from the reference "
                      f"({', '.join(f'{d:.4f}' for d in draws)}).", ""]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.core.provenance import sha256
    from utils.qat.model import checkpoint
    from utils.qat.onnx.onnx_export import export_onnx, load_for_export
    check_args(args)
    if args.graph is not None and len(args.graph) != len(args.weights):
        raise QATError(f"--graph gives {len(args.graph)} graphs for {len(args.weights)} checkpoints; give one per "
                       f"checkpoint, in the same order, or leave --graph out.")
    for w in args.weights:
        if not w.is_file():
            raise QATError(f"--weights {w} not found; pass quantized checkpoints (qat.py quantize writes them).")
        if not checkpoint.is_quantized(checkpoint.read(w)):
            raise QATError(f"{w} is a floating-point checkpoint; pass a quantized one (qat.py quantize writes them).")
    if len({w.name for w in args.weights}) != len(args.weights):
        raise QATError("two --weights share a file name; the rows are named by it: copy one under another name.")
    arithmetics = available(args.arithmetics)
    data = load_data_yaml(args.data, splits=("val",))
    graphs, images = args.out / f"{args.label}-graphs", args.out / f"{args.label}-images"
    images.mkdir(parents=True, exist_ok=True)
    graphs.mkdir(exist_ok=True)
    doc_path = args.out / f"{args.label}.json"
    doc = {"label": args.label, "command": portable.command(work=args.out),
           "imgsz": args.imgsz, "batch_size": args.batch_size, "num_image": args.num_image, "conf_tol": args.conf_tol,
           "rows": []}
    earlier = json.loads(doc_path.read_text()) if doc_path.is_file() else {"rows": []}
    protocol = ("imgsz", "batch_size", "num_image")
    if earlier["rows"] and any(earlier.get(k) != doc[k] for k in protocol):
        raise QATError(f"{doc_path} was scored at {', '.join(f'{k} {earlier.get(k)}' for k in protocol)}; score at the "
                       f"same settings to add to it, or pass another --label.")
    rows = {r["sha256"]: r for r in earlier["rows"]}
    for i, w in enumerate(args.weights):
        digest = sha256(w)
        row = rows.setdefault(digest, {"weights": w.name, "sha256": digest, "scores": {}})
        row["weights"] = w.name
        model, task, _quantized, fp_patterns = load_for_export(w)
        graph = args.graph[i] if args.graph else graphs / f"{w.stem}.onnx"
        if args.graph and not graph.is_file():
            raise QATError(f"--graph {graph} not found; leave --graph out to export each checkpoint here.")
        if not graph.is_file() and any(a.startswith(("ort", "openvino")) for a in arithmetics):
            export_onnx(model, graph, imgsz=args.imgsz, dynamic=True, allow_fp=fp_patterns, task=task,
                        metadata={"source": w.name})
        del model
        quantized = functools.cache(lambda w=w: checkpoint.load_quantized(w, task=task)[0])  # once per checkpoint
        for a in arithmetics:
            row["scores"][a] = score(a, w, quantized, graph, task, data, args, images)
        if args.silu_ulp_draws:
            row["silu_ulp"] = ulp_draws(w, quantized, task, data, args)
        compare(row, images, args.reference, args.conf_tol)
        doc["rows"] = list(rows.values())  # the rows of checkpoints not named this time stay as they were
        write_text(doc_path, portable.text(json.dumps(doc, indent=2), work=args.out))
        write_text(args.out / f"{args.label}.md", portable.text(render(doc), work=args.out))
    print(render(doc))
    print(f"wrote {doc_path} and {args.out / args.label}.md")
    return doc


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
