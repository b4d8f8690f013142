#!/usr/bin/env python3
"""Benchmark FP32 against INT8 on the CPU, with ONNX Runtime and OpenVINO; write the tables and a plot.

    python3 scripts/benchmark_cpu.py --model gelan-c yolov9-c-fp32.onnx qat_best_yolov9-c.onnx \\
        [--model NAME FP32.onnx INT8.onnx ...] [--runtime onnxruntime openvino] [--batch 1 8] [--imgsz 640] \\
        [--threads N] [--out runs/benchmark_cpu]

Each --model is the FP32 graph (export_qat.py of the FP checkpoint) and the Q/DQ graph (export_qat.py of its
qat.py checkpoint) of one model; export both with --dynamic to run any --batch and --imgsz. Either graph may also be
an OpenVINO IR (.xml, e.g. NNCF's INT8 model), timed on OpenVINO only. For every runtime and batch both graphs run
with --threads threads (default: every usable core) after --warmup rounds, timed over --runs rounds that alternate
FP32 and INT8 (utils/qat/evaluation/cpu_bench.py). OpenVINO computes what is not INT8 in f32, so the FP32 column
is FP32; where OpenVINO's own default precision on this CPU is not f32 (bf16 on CPUs with AMX or AVX512-BF16: what
users get when they do not ask), the FP32 graph is timed at that default precision too, in the same rounds, as a
column of its own, and each row gives the INT8 speed-up over both. Writes OUT/results.json, OUT/results.md (the CPU
and its instruction sets, median latency with its 10th-90th percentile, images per second and the INT8 speed-ups
per batch, and OpenVINO's INT8 execution graph: which layers run in floating point and why) and OUT/results.png
(images per second). OpenVINO: ./install_dependencies.sh --openvino.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.core.validate import check_args  # noqa: E402
from utils.qat.evaluation.backends import ONNX_RUNTIMES  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="benchmark_cpu.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs=3, action="append", required=True, metavar=("NAME", "FP32", "INT8"),
                    help="a model's name, its FP32 graph and its INT8 (Q/DQ) graph: ONNX, or an OpenVINO IR (.xml, "
                         "timed on OpenVINO only); repeatable")
    ap.add_argument("--runtime", nargs="+", choices=ONNX_RUNTIMES, default=list(ONNX_RUNTIMES),
                    help="runtimes to compare (default: onnxruntime openvino)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes (default: 1 8)")
    ap.add_argument("--imgsz", type=int, default=640, help="image size (default 640)")
    ap.add_argument("--threads", type=int, default=None, help="inference threads (default: every usable core)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds per case (default 3)")
    ap.add_argument("--runs", type=int, default=10, help="timed rounds per case (default 10)")
    ap.add_argument("--no-layers", action="store_true",
                    help="leave out OpenVINO's INT8 execution graph (which layers run in floating point)")
    ap.add_argument("--out", default="runs/benchmark_cpu", help="output folder (default runs/benchmark_cpu)")
    return ap


def main(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation import cpu_bench
    check_args(args)
    names = [name for name, _fp32, _int8 in args.model]
    if len(set(names)) != len(names):
        raise QATError(f"--model names must differ, got {' '.join(names)}; give each model its own name.")
    models = {name: {"FP32": Path(fp32), "INT8": Path(int8)} for name, fp32, int8 in args.model}
    if "openvino" in args.runtime:
        from utils.qat.evaluation.backends import require_openvino
        require_openvino()  # before any timing: one sentence naming the install command
    doc = cpu_bench.measure(models, runtimes=args.runtime, batches=args.batch, imgsz=args.imgsz, threads=args.threads,
                            warmup=args.warmup, runs=args.runs, layers=not args.no_layers)
    paths = cpu_bench.write_report(doc, args.out)
    print(cpu_bench.render_markdown(doc))
    print("\n".join(f"wrote {p}" for p in paths.values()))
    return doc


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
