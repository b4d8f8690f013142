"""``benchmarks/cost.py --mode ddp``: multi-GPU QAT against one GPU, speed-up per epoch, and whether N processes
calibrate and train as one does.

The same ``qat.py quantize`` for the same global batch, run once in one process and once under
``torch.distributed.run`` with ``--nproc`` processes. Writes ddp.json and ddp.md, the runs and their logs into --out
and prints the table: QAT seconds per epoch and the speed-up, calibration seconds, loss and AP per epoch, and the
largest amax differences (N processes vs one, and between the ranks of the N-process run, from the
YOLOV9_QAT_AMAX_DUMP files every rank writes after calibration). ``--device cpu`` runs both on the CPU (gloo), one
thread per process: how tests/test_ddp.py checks it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from utils.qat.core.atomic import write_text
from utils.qat.core.errors import QATError

from parts import portable


def qat_command(args: argparse.Namespace, nproc: int, project: Path) -> list[str]:
    """The command line of one run: plain python for one process, torch.distributed.run for several."""
    argv = ["qat.py", "quantize", "--weights", args.weights, "--data", args.data, "--imgsz", str(args.imgsz),
            "--batch-size", str(args.batch_size), "--epochs", str(args.epochs), "--iters", str(args.iters),
            "--calib-method", args.calib_method, "--calib-batches", str(args.calib_batches),
            "--workers", str(args.workers), "--project", str(project), "--name", f"{nproc}proc", "--exist-ok",
            "--no-eval-origin"]
    argv += ["--hyp", args.hyp] if args.hyp else []
    argv += ["--trust-weights"] if args.trust_weights else []
    argv += ["--device", "cpu" if args.cpu else ",".join(str(i) for i in range(nproc))]
    if nproc == 1:
        return [sys.executable, *argv]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]


def run(args: argparse.Namespace, nproc: int, out: Path) -> dict:
    """One run, its log in out/<n>proc.log; returns its report.json plus the wall time and amax dumps."""
    dump = out / f"amax_{nproc}proc"
    env = {**os.environ, "YOLOV9_QAT_AMAX_DUMP": str(dump), "PYTHONUNBUFFERED": "1"}
    if args.cpu:  # torchrun gives each process one thread; the single process gets the same, so convs round alike
        env["OMP_NUM_THREADS"] = "1"
    cmd = qat_command(args, nproc, out / "runs")
    log = out / f"{nproc}proc.log"
    print(f"==> {' '.join(cmd)}", flush=True)
    start = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout,
                                check=False).returncode
        except subprocess.TimeoutExpired as e:
            raise QATError(f"the {nproc}-process run took over {args.timeout:.0f} s; see {log}, or pass a larger "
                           "--timeout.") from e
    if rc != 0:
        print("".join(log.read_text().splitlines(keepends=True)[-30:]), file=sys.stderr)
        raise QATError(f"the {nproc}-process run failed (exit {rc}); its log is {log}.")
    report = json.loads((out / "runs" / f"{nproc}proc" / "report.json").read_text())
    ranks = [json.loads((dump / f"amax_rank{r}.json").read_text()) for r in range(nproc)]
    return {"report": report, "wall_seconds": round(time.time() - start, 1), "amax": ranks}


def max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict:
    """Largest absolute and relative difference between two amax dumps (same quantizers required)."""
    if a.keys() != b.keys():
        raise QATError("the two runs quantized different layers; compare runs of the same model and settings.")
    diffs = [(abs(x - y), abs(x - y) / max(abs(x), 1e-12)) for k in a for x, y in zip(a[k], b[k])]
    return {"max_abs": max((d[0] for d in diffs), default=0.0), "max_rel": max((d[1] for d in diffs), default=0.0),
            "values": len(diffs), "differing": sum(1 for d in diffs if d[0] > 0)}


def per_epoch(report: dict) -> tuple[float, float | None]:
    """Mean QAT seconds per epoch, over all epochs and over epochs 2+ (the first includes warm-up)."""
    secs = [e["train_seconds"] for e in report["epochs"]]
    return sum(secs) / len(secs), (sum(secs[1:]) / len(secs[1:]) if len(secs) > 1 else None)


def summarise(args: argparse.Namespace, one: dict, many: dict) -> dict:
    mean1, steady1 = per_epoch(one["report"])
    mean_n, steady_n = per_epoch(many["report"])
    result = {
        "settings": {k: getattr(args, k) for k in ("weights", "data", "imgsz", "batch_size", "nproc", "epochs", "iters",
                                                     "calib_method", "calib_batches", "hyp", "cpu")},
        "machine": machine(args.cpu),
        "qat_seconds_per_epoch": {"1": round(mean1, 2), str(args.nproc): round(mean_n, 2)},
        "speedup": round(mean1 / mean_n, 2) if mean_n else None,
        "speedup_epochs_2_plus": round(steady1 / steady_n, 2) if steady1 and steady_n else None,
        "amax_vs_1proc": max_diff(one["amax"][0], many["amax"][0]),
        "amax_across_ranks": max((max_diff(many["amax"][0], r) for r in many["amax"][1:]), key=lambda d: d["max_abs"]),
    }
    for key, r in (("1", one), (str(args.nproc), many)):
        rep = r["report"]
        result[f"run_{key}"] = {"world_size": rep.get("world_size", 1), "calibration_seconds": rep.get("calibration_seconds"),
                                "wall_seconds": r["wall_seconds"], "epochs": rep["epochs"],
                                "models": {m["name"]: {c: m[c] for c in ("AP", "AP50")} for m in rep["models"]}}
    return result


def machine(cpu: bool) -> dict:
    import torch
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count()}
    if not cpu and torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def render(r: dict) -> str:
    n = str(r["settings"]["nproc"])
    one, many = r["run_1"], r[f"run_{n}"]
    unit, units = ("process", "processes") if r["settings"]["cpu"] else ("GPU", "GPUs")
    s = r["settings"]
    title = (f"# Multi-GPU QAT: {Path(s['weights']).name}, {s['imgsz']} px, global batch {s['batch_size']} "
             f"({int(s['batch_size']) // int(n)} per {unit} on {n}), {s['epochs']} epochs x {s['iters']} iterations, "
             f"{s['calib_method']} calibration")
    lines = [title, "",
             f"| | 1 {unit} | {n} {units} |", "|---|---|---|",
             f"| QAT seconds per epoch (mean) | {r['qat_seconds_per_epoch']['1']} | {r['qat_seconds_per_epoch'][n]} |",
             f"| speed-up (mean; epochs 2+) | | {r['speedup']}x; {r['speedup_epochs_2_plus'] or '-'}x |",
             f"| calibration seconds | {one['calibration_seconds']} | {many['calibration_seconds']} |",
             f"| whole command, seconds | {one['wall_seconds']} | {many['wall_seconds']} |"]
    for name in ("PTQ", "QAT"):
        if name in one["models"] and name in many["models"]:
            lines.append(f"| {name} AP / AP50 | {one['models'][name]['AP']:.4f} / {one['models'][name]['AP50']:.4f} | "
                         f"{many['models'][name]['AP']:.4f} / {many['models'][name]['AP50']:.4f} |")
    for e1, en in zip(one["epochs"], many["epochs"]):
        lines.append(f"| epoch {e1['epoch']}: loss, AP, seconds | {e1['loss']:.5f}, {e1['AP']:.4f}, {e1['train_seconds']} | "
                     f"{en['loss']:.5f}, {en['AP']:.4f}, {en['train_seconds']} |")
    a, b = r["amax_vs_1proc"], r["amax_across_ranks"]
    lines.append(f"| max abs (rel) amax difference vs 1 {unit} | | {a['max_abs']:.3g} ({a['max_rel']:.3g}); "
                 f"{a['differing']} of {a['values']} values differ |")
    lines.append(f"| max abs amax difference between ranks | | {b['max_abs']:.3g} ({b['differing']} of {b['values']} differ) |")
    lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in r["machine"].items())]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> dict:
    if args.nproc < 2:
        raise QATError(f"--nproc {args.nproc}: the comparison needs at least 2 processes.")
    if args.batch_size % args.nproc:
        raise QATError(f"--batch-size {args.batch_size} does not split over {args.nproc} processes; pass a multiple of {args.nproc}.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    one = run(args, 1, out)
    many = run(args, args.nproc, out)
    result = {"command": portable.command(work=out), **summarise(args, one, many)}
    write_text(out / "ddp.json", portable.text(json.dumps(result, indent=2), work=out))
    md = portable.text(render(result), work=out)
    write_text(out / "ddp.md", md)
    print(md)
    return result

