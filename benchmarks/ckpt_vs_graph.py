"""A quantized checkpoint against its own exported graph, on one CPU under one protocol: how far the number `qat.py`
shows (the fake-quant checkpoint in PyTorch) is from the number the graph ships with (ONNX Runtime, as val_trt.py
runs it).

    python3 benchmarks/ckpt_vs_graph.py --weights runs/qat/exp/weights/qat_best_yolov9-t.pt --data coco.yaml \\
        --out runs/ckpt-vs-graph --label yolov9-t-qat --float64 --unoptimized

Exports each checkpoint as ``export_qat.py --dynamic`` does (or scores ``--graph``), scores checkpoint and graph on
the CPU with the one evaluator, at the same batch and protocol, and reports for each: both mAP50-95, graph minus
checkpoint with its 95% paired-bootstrap interval over the images, and how many images came out with the same
detections (the same number kept, the same classes, confidences within --conf-tol, the same matches to the labels).
Two more scorings of the same model under another arithmetic give the band to read that difference against:
``--float64`` (the checkpoint in float64) and ``--unoptimized`` (the graph with ONNX Runtime's basic rewrites only,
each operator computed as ONNX defines it, where the default fuses Q/DQ into integer kernels). Where they part, it
is arithmetic, not definition (docs/RESULTS.md "A checkpoint against its graph": the scales, INT8 weights, rounding
and placement are the same; an average pool of INT8 values requantized on their own scale puts about a quarter of
its outputs exactly on a rounding tie, which the order of a float sum decides, and the network carries the flips).
Writes OUT/LABEL.json, OUT/LABEL.md and the graphs in OUT/LABEL-graphs/.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.core.validate import check_args  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", nargs="+", required=True, type=Path, help="quantized checkpoints (qat.py quantize)")
    p.add_argument("--graph", nargs="+", type=Path, default=None,
                   help="their exported graphs, in the same order (default: export each here)")
    p.add_argument("--data", required=True, help="dataset yaml: its val split is scored")
    p.add_argument("--imgsz", type=int, default=640, help="evaluation size (default 640)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[16],
                   help="evaluation batches (default 16): the first is compared image by image; each other one "
                        "scores both again, to show that the score does not depend on it (the one protocol)")
    p.add_argument("--num-image", type=int, default=None, help="score on the first N val images (default all)")
    p.add_argument("--workers", type=int, default=4, help="dataloader workers")
    p.add_argument("--float64", action="store_true",
                   help="also score each checkpoint in float64: how far float arithmetic alone moves its score, the "
                        "band to read graph - checkpoint against")
    p.add_argument("--unoptimized", action="store_true",
                   help="also score each graph with ONNX Runtime's basic rewrites only (each operator as ONNX defines "
                        "it, no fused integer kernels): what the runtime's kernels add to graph - checkpoint")
    p.add_argument("--conf-tol", type=float, default=1e-3,
                   help="confidences this close count as the same detection (default %(default)s)")
    p.add_argument("--out", required=True, type=Path, help="folder of LABEL.json and LABEL.md")
    p.add_argument("--label", default="ckpt-vs-graph", help="name of the result files (default: %(default)s)")
    return p


COMPARED = ("checkpoint", "graph")  # scored at every --batch-size, compared image by image
BANDS = ("float64", "unoptimized_graph")  # the same model under another arithmetic, scored at the first batch only


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


def _float64(qmodel, task: str):
    """The checkpoint computed in float64, fed and read in float32 as the evaluator expects: the same model, the same
    scales and rounding, another float arithmetic (values on a rounding tie may round the other way)."""
    import copy

    import torch

    from utils.qat.evaluation.backends import TorchBackend

    class Float64(TorchBackend):
        def __call__(self, images):
            out = super().__call__(images.double())
            return [o.float() for o in out] if isinstance(out, (list, tuple)) else out.float()

    return Float64(copy.deepcopy(qmodel).double(), torch.device("cpu"), task=task)


def compare(weights: Path, graph: Path | None, data: dict, args: argparse.Namespace, graphs: Path) -> dict:
    """One checkpoint against its graph: the row of LABEL.json."""
    from utils.qat.evaluation.backends import ORTBackend, TorchBackend
    from utils.qat.evaluation.evaluate import evaluate
    from utils.qat.evaluation.resample import PairedBootstrap, record, shown
    from utils.qat.model import checkpoint
    from utils.qat.onnx.onnx_export import export_onnx, load_for_export
    import torch
    model, task, _quantized, fp_patterns = load_for_export(weights)
    if graph is None:
        graph = graphs / f"{weights.stem}.onnx"
        export_onnx(model, graph, imgsz=args.imgsz, dynamic=True, allow_fp=fp_patterns, task=task,
                    metadata={"source": weights.name})
    elif not graph.is_file():
        raise QATError(f"--graph {graph} not found; leave --graph out to export each checkpoint here.")
    del model
    qmodel = checkpoint.load_quantized(weights, task=task)[0]
    scores, by_batch = {}, {}
    backends = [("checkpoint", TorchBackend(qmodel, torch.device("cpu"), task=task)), ("graph", ORTBackend(graph))]
    if args.float64:
        backends.append(("float64", _float64(qmodel, task)))
    if args.unoptimized:
        backends.append(("unoptimized_graph", ORTBackend(graph, optimize=False)))
    for name, backend in backends:
        for batch in args.batch_size if name in COMPARED else args.batch_size[:1]:
            start = time.time()
            m = evaluate(backend, data, task=task, imgsz=args.imgsz, batch_size=batch, workers=args.workers,
                         num_images=args.num_image, desc=f"{weights.name}: {name.replace('_', ' ')}, batch {batch}")
            m.seconds = time.time() - start
            scores.setdefault(name, m)  # the first batch is the one compared image by image
            if name in COMPARED:
                by_batch.setdefault(str(batch), {})[name] = round(m.mAP50_95, 4)
    ckpt, onnx = scores["checkpoint"], scores["graph"]
    d = PairedBootstrap(ckpt)(onnx)

    def same(other) -> int:  # images whose detections agree with the checkpoint's
        by_path = {i.path: i for i in other.per_image}
        return sum(same_detections(i.box, by_path[i.path].box, args.conf_tol) for i in ckpt.per_image)

    row = {"weights": str(weights), "graph": str(graph), "images": ckpt.images,
           "checkpoint": {"AP": round(ckpt.mAP50_95, 4), "AP50": round(ckpt.mAP50, 4)},
           "graph_scores": {"AP": round(onnx.mAP50_95, 4), "AP50": round(onnx.mAP50, 4)},
           "graph_minus_checkpoint": record(d), "shown": shown(d), "tie": d.tie,
           "same_detections": same(onnx), "by_batch": by_batch,
           "batch_invariant": all(len({b[k] for b in by_batch.values()}) == 1 for k in COMPARED),
           "seconds": {k: round(m.seconds, 1) for k, m in scores.items()}}
    for name in BANDS:
        if name in scores:
            d = PairedBootstrap(ckpt)(scores[name])
            row[name] = {"AP": round(scores[name].mAP50_95, 4), "minus_checkpoint": record(d), "shown": shown(d),
                         "same_detections": same(scores[name])}
    return row


def render(doc: dict) -> str:
    batches = doc["batch_size"]
    lines = [f"# {doc['label']}: checkpoints against their graphs", "",
             f"Made by `{doc['command']}` ({doc['date']}, {doc['machine']}): each quantized checkpoint scored in PyTorch "
             f"(fake quantization) and its `export_qat.py --dynamic` graph on ONNX Runtime, both on the CPU, the one "
             f"protocol, {doc['imgsz']} px, mAP50-95, compared at batch {batches[0]}. `graph - checkpoint` carries its "
             f"95% paired-bootstrap interval over the images; `same detections`: images whose detections agree (count, "
             f"classes, confidences within {doc['conf_tol']}, matches); `by batch`: checkpoint / graph scored again at "
             f"each batch, which the one protocol makes the same.", "",
             "| checkpoint | checkpoint | graph | graph - checkpoint | same detections | by batch |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        by_batch = ", ".join(f"{b}: {s['checkpoint']:.4f} / {s['graph']:.4f}" for b, s in r["by_batch"].items())
        lines.append(f"| {Path(r['weights']).name} | {r['checkpoint']['AP']:.4f} | {r['graph_scores']['AP']:.4f} | "
                     f"{r['shown']} | {r['same_detections']} / {r['images']} | {by_batch}"
                     f"{'' if r['batch_invariant'] else ' (differ)'} |")
    bands = [(r, k) for r in doc["rows"] for k in BANDS if k in r]
    if bands:
        lines += ["", "The same model under another arithmetic, the band to read `graph - checkpoint` against: "
                  "`float64`, the checkpoint computed in float64 in PyTorch (the same scales and rounding); "
                  "`unoptimized graph`, the graph on ONNX Runtime with its basic rewrites only (each operator as ONNX "
                  "defines it, no fused integer kernels).", "",
                  "| checkpoint | scored as | AP | minus checkpoint | same detections |", "|---|---|---|---|---|"]
        lines += [f"| {Path(r['weights']).name} | {k.replace('_', ' ')} | {r[k]['AP']:.4f} | {r[k]['shown']} | "
                  f"{r[k]['same_detections']} / {r['images']} |" for r, k in bands]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation.cpu_bench import cpu_info
    from utils.qat.evaluation.data import load_data_yaml
    check_args(args)
    if args.graph is not None and len(args.graph) != len(args.weights):
        raise QATError(f"--graph gives {len(args.graph)} graphs for {len(args.weights)} checkpoints; give one per "
                       f"checkpoint, in the same order, or leave --graph out.")
    from utils.qat.model import checkpoint
    for w in args.weights:
        if not w.is_file():
            raise QATError(f"--weights {w} not found; pass quantized checkpoints (qat.py quantize writes them).")
        if not checkpoint.is_quantized(checkpoint.read(w)):
            raise QATError(f"{w} is a floating-point checkpoint; pass a quantized one (qat.py quantize writes them).")
    data = load_data_yaml(args.data, splits=("val",))
    graphs = args.out / f"{args.label}-graphs"
    graphs.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    doc = {"label": args.label, "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": f"{cpu['model']}, {cpu['cpus']} CPUs", "imgsz": args.imgsz, "batch_size": args.batch_size,
           "conf_tol": args.conf_tol, "rows": []}
    for i, w in enumerate(args.weights):
        doc["rows"].append(compare(w, args.graph[i] if args.graph else None, data, args, graphs))
        write_text(args.out / f"{args.label}.json", json.dumps(doc, indent=2))
        write_text(args.out / f"{args.label}.md", render(doc))
    print(render(doc))
    print(f"wrote {args.out / args.label}.json and .md")
    return doc


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
