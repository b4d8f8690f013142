"""Seconds and operations per QAT step, per model size, for each way of running it.

One step is the library's own (``utils.qat.quantize.finetune.QATStep``: teacher forward, student forward and
backward, optimiser, learned amax, EMA) with the default ``QATConfig``, on random weights (re-initialised so
activations stay O(1)) calibrated with ``max`` on the same random batches. For each model yaml and each mode
(``eager``: the reference quantizer operations, ``triton``: the hand-written kernels of
utils/qat/quantize/qdq_triton.py, both with every step eager; ``graph``: the kernels with the forward and backward
replayed from a CUDA graph, utils/qat/quantize/cuda_graph.py: the default on CUDA) it reports the median step time
after ``--warmup`` steps (compilation and the graph's recording happen there), and what one step runs: ATen
operator calls issued from Python, GPU kernels and their summed time (torch.profiler, shapes not recorded; the
kernels a graph replays are not seen one by one). Writes OUT/qat_step.json and OUT/qat_step.md.

Run from the top of a patched YOLOv9 tree:

    python3 /path/to/yolov9-qat/benchmarks/qat_step.py --device cuda:0 --imgsz 640 --batch-size 16 \\
        --out runs/benchmark/qat_step

On the CPU at a tiny image size (``--imgsz 64 --batch-size 2``) arithmetic is negligible and the step time is
what the quantizers' Python and operator overhead costs.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

from utils.qat.core import yolov9  # noqa: E402
from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.quantize import qdq  # noqa: E402
from utils.qat.quantize.finetune import QATConfig, QATStep  # noqa: E402
from utils.qat.quantize.model_quant import QuantConfig, fused_copy, quantize  # noqa: E402
from utils.qat.quantize.state import enabled_quantizers  # noqa: E402

SIZES = ("t", "s", "m", "c", "e")
IMPLS = ("eager", "triton", "graph")  # graph: the triton kernels, replayed from a CUDA graph


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cfg", nargs="+", default=None,
                   help="model yamls (default: models/detect/gelan-{t,s,m,c,e}.yaml that the tree has)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--imgsz", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model and implementation")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the Triton kernels compile here)")
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--out", default="runs/benchmark/qat_step")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def operations(step: QATStep, batch: torch.Tensor, device: torch.device) -> dict:
    """ATen operator calls, GPU kernels and their summed milliseconds, of one step."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        step(batch)
        _sync(device)
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    cuda = device.type == "cuda"
    return {"aten_ops": ops, "gpu_kernels": len(gpu) if cuda else None,
            "gpu_ms": round(sum(e.device_time for e in gpu) / 1e3, 2) if cuda else None}


def measure(qmodel: torch.nn.Module, teacher: torch.nn.Module, batch: torch.Tensor, impl: str, args,
            device: torch.device) -> dict:
    model = copy.deepcopy(qmodel)
    with qdq.implementation("triton" if impl == "graph" else impl):
        step = QATStep(model, copy.deepcopy(teacher), lambda: [batch], QATConfig(cuda_graph=impl == "graph"),
                       device=device)
        step.train()
        try:
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step(batch)
            _sync(device)
            warmup_s = time.perf_counter() - t0
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(batch)
                _sync(device)
                times.append(time.perf_counter() - t0)
            ops = operations(step, batch, device)
        finally:
            step.close()
    return {"seconds_per_step": round(statistics.median(times), 5), "min_seconds": round(min(times), 5),
            "warmup_seconds": round(warmup_s, 2), **ops}


def main(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    cfgs = args.cfg or [str(p) for s in SIZES if (p := Path("models/detect") / f"gelan-{s}.yaml").is_file()]
    g = torch.Generator().manual_seed(0)
    batch = torch.rand(args.batch_size, 3, args.imgsz, args.imgsz, generator=g).to(device)
    rows = []
    for cfg in cfgs:
        fp = yolov9.reinit(yolov9.build(cfg, nc=80))
        qmodel, _ = quantize(fp, [batch], QuantConfig(method="max", head_amax="calibrated"), device=device)
        teacher = fused_copy(fp, device)
        row = {"model": Path(cfg).stem, "quantizers": len(enabled_quantizers(qmodel)),
               "parameters_M": round(sum(p.numel() for p in fp.parameters()) / 1e6, 2)}
        for impl in args.impl:
            row[impl] = measure(qmodel, teacher, batch, impl, args, device)
            print(f"{row['model']} {impl}: {row[impl]}", flush=True)
        for impl in ("triton", "graph"):  # eager's time over each's
            if "eager" in row and impl in row:
                row[f"speedup_{impl}"] = round(row["eager"]["seconds_per_step"] / row[impl]["seconds_per_step"], 3)
        rows.append(row)
    doc = {"device": _device_name(device), "imgsz": args.imgsz, "batch_size": args.batch_size, "steps": args.steps,
           "warmup": args.warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
           "platform": platform.platform(), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "qat_step.json", json.dumps(doc, indent=2) + "\n")
    write_text(out / "qat_step.md", render(doc))
    print(render(doc))
    return doc


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'cpu'})"


def render(doc: dict) -> str:
    impls = [i for i in IMPLS if any(i in r for r in doc["rows"])]
    speedups = [i for i in impls if any(f"speedup_{i}" in r for r in doc["rows"])]
    head = "| " + " | ".join(["model", "params (M)", "quantizers"]
                             + [f"{i} {c}" for i in impls for c in ("s/step", "ATen ops", "GPU kernels", "GPU ms")]
                             + [f"speed-up {i}" for i in speedups]) + " |"
    lines = [f"## QAT step: {doc['device']}, {doc['imgsz']} px, batch {doc['batch_size']} (median of {doc['steps']} "
             f"steps after {doc['warmup']}; torch {doc['torch']}, {doc['threads']} threads)", "", head,
             "|" + "---|" * (3 + 4 * len(impls) + len(speedups))]
    for r in doc["rows"]:
        cells = []
        for i in impls:
            m = r.get(i, {})
            cells += [f"{m.get('seconds_per_step', '')}", f"{m.get('aten_ops', '')}", f"{m.get('gpu_kernels') or '-'}",
                      f"{m.get('gpu_ms') or '-'}"]
        cells += [f"{r.get(f'speedup_{i}', '-')}" for i in speedups]
        lines.append(f"| {r['model']} | {r['parameters_M']} | {r['quantizers']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(get_args_parser().parse_args())
