"""The reference side by side: one model's table as the reference's README lays it out, from the library in-process.

FP, PTQ (each calibration method), QAT (default, and with the most sensitive layer kept FP), INT8 ONNX Runtime
evaluation of the exported QAT model, the Q/DQ lint, and the time of every stage. Writes results.json, results.md
and results.png into --out.

Run from the top of a patched YOLOv9 tree:

    python3 /path/to/yolov9-qat/benchmarks/reference.py --weights gelan-c.pt --data data/coco.yaml \\
        --imgsz 640 --device 0 --out runs/benchmark/gelan-c

--stages picks what runs (default: all): fp, ptq, qat, sensitive, qat_skip, onnx.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))  # benchmarks/parts/
from utils.qat.core import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

import qat  # noqa: E402
from utils.qat.quantize.config import CALIB_METHODS, DEFAULT_CALIB_METHOD, DEFAULT_HEAD_AMAX, HEAD_AMAX, QuantConfig  # noqa: E402
from utils.qat import __version__  # noqa: E402
from utils.qat.model import checkpoint  # noqa: E402
from utils.qat.run import reports  # noqa: E402
from utils.qat.core.atomic import write_text  # noqa: E402

from parts import portable  # noqa: E402
from utils.qat.evaluation.backends import ORTBackend, TorchBackend  # noqa: E402
from utils.qat.evaluation.data import load_data_yaml  # noqa: E402
from utils.qat.core.device import select_device  # noqa: E402
from utils.qat.evaluation.evaluate import evaluate  # noqa: E402
from utils.qat.run.pipeline import Evaluation, ptq, sensitivity  # noqa: E402
from utils.qat.core.errors import run_cli  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402

STAGES = ("fp", "ptq", "qat", "sensitive", "qat_skip", "onnx")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True)
    add_trust_flag(p)
    p.add_argument("--data", required=True)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--methods", default=",".join(CALIB_METHODS), help="calibration methods for the PTQ table")
    p.add_argument("--calib-method", default=DEFAULT_CALIB_METHOD, help="method used for QAT")
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--head-amax", choices=HEAD_AMAX, default=DEFAULT_HEAD_AMAX,
                   help="search: PTQ rows with the head's input scales searched beside the calibrated ones, and "
                        "QAT started from the searched model")
    p.add_argument("--qat-args", default="", help="more qat.py quantize flags for the QAT stages, e.g. '--lr 1e-5 "
                   "--qat-loss mse' (default: qat.py's own defaults)")
    p.add_argument("--num-image", type=int, default=None, help="images for the sensitivity analysis")
    p.add_argument("--onnx-device", default="cpu", help="ONNX Runtime device (cpu or cuda:0)")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--no-simplify", action="store_true", help="export without onnxslim")
    p.add_argument("--name", default="qat", help="run name of the QAT stage (and the checkpoint the onnx stage exports)")
    p.add_argument("--skip-layers", default="", help="--skip-layers for the QAT stage")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default=None)
    p.add_argument("--render-only", action="store_true", help="only re-render results.md/png from results.json")
    return p


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / "results.json"
        self.results = json.loads(self.path.read_text()) if self.path.exists() else {"rows": {}, "timings": {}, "epochs": {}}
        if not args.render_only:
            self.results["command"] = portable.command(work=self.out)
            self.results["machine"] = machine(args.device)
            self.results["qat_args"] = args.qat_args  # fine-tuning flags beyond qat.py's defaults

    @contextmanager
    def timed(self, stage: str):
        start = time.time()
        print(f"\n==> {stage}", flush=True)
        yield
        self.results["timings"][stage] = round(time.time() - start, 1)
        self.save()

    def row(self, name: str, metrics, **extra):
        self.results["rows"][name] = reports.entry(name, extra.pop("weights", None), metrics, metrics.seconds, **extra)
        self.save()

    def save(self):
        write_text(self.path, portable.text(json.dumps(self.results, indent=2), work=self.out))
        write_text(self.out / "results.md", portable.text(render(self.results, self.args.title or
                                                                   Path(self.args.weights).name), work=self.out))
        if self.results["rows"]:
            plot(self.results, self.out / "results.png", self.args.title or Path(self.args.weights).name)


def plot(results: dict, path: Path, title: str) -> None:
    """Left: AP per QAT epoch with the Origin and PTQ levels. Right: INT8 - Origin AP per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.qat.core.atomic import atomic_path
    rows = results["rows"]
    origin = rows.get("Origin")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    for name, epochs in results.get("epochs", {}).items():
        if epochs:
            left.plot([e["epoch"] for e in epochs], [e["AP"] for e in epochs], "o-", ms=3,
                      label=f"QAT ({results.get('qat_args') or 'default'})" if name == "qat" else f"QAT ({name})")
    if origin:
        left.axhline(origin["AP"], color="gray", linestyle="--", label="Origin (FP)")
    ptq = [r for n, r in rows.items() if n.startswith("PTQ") and "(" not in n]
    if ptq:
        best = max(ptq, key=lambda r: r["AP"])
        left.axhline(best["AP"], color="tab:orange", linestyle=":", label=f"best {best['name']}")
    left.set_xlabel("QAT epoch")
    left.set_ylabel("mAP50-95")
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    if origin:
        others = [r for r in rows.values() if r is not origin]
        deltas = [r["AP"] - origin["AP"] for r in others]
        right.barh([r["name"] for r in others], deltas, color=["tab:green" if d >= -0.002 else "tab:red" for d in deltas])
        right.axvline(0, color="black", linewidth=0.8)
        right.axvline(-0.002, color="gray", linestyle=":", linewidth=0.8)
        right.set_xlabel("AP - Origin AP (mAP50-95)")
        right.tick_params(axis="y", labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def machine(device: str) -> dict:
    import modelopt
    import onnxruntime
    info = {"python": platform.python_version(), "torch": torch.__version__, "modelopt": modelopt.__version__,
            "onnxruntime": onnxruntime.__version__, "yolov9_qat": __version__, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count()}
    if torch.cuda.is_available() and device != "cpu":
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def render(results: dict, title: str) -> str:
    rows = list(results["rows"].values())
    origin = results["rows"].get("Origin")
    lines = [f"# Reference results: {title}", "", "## Evaluation results", "", reports.table(rows)]
    if origin:
        diff = [{"name": f"{r['name']} vs Origin", **{c: f"{r[c] - origin[c]:+.4f}" for c in reports.COLUMNS}}
                for r in rows if r is not origin]
        lines += ["", "## Evaluation comparison", "", reports.table(diff, first="Comparison")]
    if results["timings"]:
        lines += ["", "## Time per stage", "", "| Stage | seconds |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in results["timings"].items()]
    if results.get("epochs"):
        lines += ["", f"QAT flags beyond qat.py's defaults: `{results['qat_args']}`" if results.get("qat_args")
                  else "QAT with qat.py's default settings."]
    for name, epochs in results.get("epochs", {}).items():
        if epochs:
            lines += ["", f"QAT epochs ({name}): " + ", ".join(f"{e['epoch']}: AP {e['AP']:.4f} ({e['train_seconds']} s)" for e in epochs)]
    m = results.get("machine", {})
    lines += ["", "## Machine", "", ", ".join(f"{k} {v}" for k, v in m.items())]
    return "\n".join(lines) + "\n"


def qat_cli(args, *extra: str):
    argv = ["quantize", "--weights", args.weights, "--data", args.data, "--imgsz", str(args.imgsz),
            "--batch-size", str(args.batch_size), "--workers", str(args.workers), "--calib-method", args.calib_method,
            "--calib-batches", str(args.calib_batches), "--head-amax", args.head_amax,
            "--project", str(Path(args.out) / "runs"), "--exist-ok",
            "--no-eval-origin", *shlex.split(args.qat_args)] + (["--trust-weights"] if args.trust_weights else [])
    if args.device:
        argv += ["--device", args.device]
    return qat.main(qat.get_args_parser().parse_args(argv + list(extra)))


def main(args) -> None:
    stages = set(args.stages.split(","))
    bench = Bench(args)
    if args.render_only:
        bench.save()
        return
    device = select_device(args.device)
    data = load_data_yaml(args.data, splits=("train", "val"))
    common = dict(imgsz=args.imgsz, batch_size=args.batch_size, workers=args.workers)

    fp = checkpoint.load_fp(args.weights, trust=args.trust_weights) if stages & {"fp", "ptq", "sensitive"} else None
    if "fp" in stages:
        with bench.timed("eval FP"):
            from utils.qat.quantize.model_quant import fused_copy
            bench.row("Origin", evaluate(TorchBackend(fused_copy(fp, device), device), data, desc="Origin", **common))

    if "ptq" in stages:
        heads = ["calibrated"] + (["search"] if args.head_amax == "search" else [])
        for method, head in ((m, h) for m in args.methods.split(",") for h in heads):
            label = f"PTQ {method}" + (", head amax searched" if head == "search" else "")
            with bench.timed(f"calibrate {method}" + (" + head amax search" if head == "search" else "")):
                qmodel, _ = ptq(fp, data, QuantConfig(method=method, head_amax=head), calib_batches=args.calib_batches,
                                device=device, **common)
            with bench.timed(f"eval {label}"):
                bench.row(label, evaluate(TorchBackend(qmodel, device), data, desc=label, **common))
            del qmodel
            torch.cuda.empty_cache() if torch.cuda.is_available() else None

    def qat_run(name: str, *extra: str):
        with bench.timed(f"QAT {name} (calibration, fine-tuning, evaluations)"):
            run = qat_cli(args, "--name", name, *extra)
        report = json.loads((run / "report.json").read_text())
        for r in report["models"]:
            if r["name"] in ("PTQ", "QAT"):
                label = f"{'PTQ ' + args.calib_method if r['name'] == 'PTQ' else 'QAT'}{'' if name == 'qat' else ' (' + name + ')'}"
                bench.results["rows"][label] = {**r, "name": label}
        bench.results["epochs"][name] = report["epochs"]
        bench.save()
        return run

    if "qat" in stages:
        qat_run(args.name, *(["--skip-layers", args.skip_layers] if args.skip_layers else []))

    if "sensitive" in stages:
        with bench.timed("sensitivity analysis"):
            base, layers = sensitivity(fp, data, QuantConfig(method=args.calib_method),
                                       Evaluation(data, device=device, **common), calib_batches=args.calib_batches,
                                       num_images=args.num_image)
        bench.results["sensitive"] = {"top": layers[:5], "ptq_AP": round(base.mAP50_95, 4)}
        bench.save()

    if "qat_skip" in stages:
        top = bench.results.get("sensitive", {}).get("top")
        if top:
            qat_run(f"skip{top[0]['layer']}", "--skip-layers", str(top[0]["layer"]))

    if "onnx" in stages:
        from utils.qat.onnx.onnx_export import export_onnx
        from utils.qat.onnx.onnx_lint import lint
        best = Path(args.out) / "runs" / args.name / "weights" / f"qat_best_{Path(args.weights).stem}.pt"
        model, info, ckpt = checkpoint.load_quantized(best)
        onnx_path = best.with_suffix(".onnx")
        with bench.timed("export Q/DQ ONNX"):
            export_onnx(model, onnx_path, imgsz=(args.imgsz, args.imgsz), dynamic=True, simplify=not args.no_simplify,
                        metadata={"stride": int(model.stride.max()), "names": json.dumps(model.names), "task": "detect"})
        findings = lint(onnx_path, allow_fp=["*dfl*", *(f"*/model.{i}/*" for i in info.config.skip if i.isdigit())])
        bench.results["lint"] = {"total": findings["total"], "findings": {k: v["count"] for k, v in findings["findings"].items()},
                                 "stats": findings["stats"]}
        with bench.timed("eval INT8 ONNX Runtime"):
            m = evaluate(ORTBackend(onnx_path, args.onnx_device), data, desc="INT8 ONNX Runtime", **common)
            label = "" if args.name == "qat" else f" ({args.name})"
            bench.row(f"INT8 ONNX Runtime (QAT{label})", m, weights=onnx_path)
    bench.save()
    print(render(bench.results, args.title or Path(args.weights).name))


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
