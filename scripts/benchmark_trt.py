#!/usr/bin/env python3
"""Benchmark an FP16 baseline and a QAT INT8 model with trtexec over batch sizes; write the tables.

    python3 scripts/benchmark_trt.py --fp16 yolov9-c.onnx --int8 qat_best_yolov9-c.onnx \\
        [--batch 1 4 8 12] [--imgsz 640] [--out runs/benchmark_trt]
    python3 scripts/benchmark_trt.py --from-logs runs/benchmark_trt/logs   # re-render saved logs

Each model is an ONNX (an engine is built per batch: min 1, opt = max = batch, as in the reference
README; TensorRT-version-aware precision flags; a static-shape ONNX runs at its own batch, with no shape
flags) or an engine (``--loadEngine`` + ``--shapes``). Every run uses ``--warmUp=500 --duration=10`` (and,
before TensorRT 11, where they became the defaults, ``--useCudaGraph --useSpinWait --noDataTransfers``);
its full output is kept in OUT/logs/LABEL_bN.log. Writes OUT/results.json, OUT/results.md (latency p99,
throughput, IPS per batch and the INT8 vs FP16 change) and OUT/ips.png.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.qat.trt.bench_report import build_results, collect_logs, log_name, render_markdown, write_report  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.trt.trt_common import read_image_input, version_tuple  # noqa: E402
from utils.qat.trt.trtexec import (benchmark_command, find_trtexec, parse_trtexec_output, run_trtexec,  # noqa: E402
                               trtexec_version)
from utils.qat.core.validate import check_args  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp16", help="FP16 baseline: ONNX (TensorRT 11: exported with --half) or engine")
    ap.add_argument("--int8", help="QAT model: Q/DQ ONNX or its engine")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 12], help="batch sizes (default 1 4 8 12)")
    ap.add_argument("--imgsz", type=int, default=640, help="image size (default 640)")
    ap.add_argument("--input-name", default="images", help="engine input name (default images)")
    ap.add_argument("--warmup", type=int, default=500, help="trtexec --warmUp in ms (default 500)")
    ap.add_argument("--duration", type=int, default=10, help="trtexec --duration in s (default 10)")
    ap.add_argument("--strongly-typed", action="store_true", help="TensorRT 10: build ONNX strongly typed")
    ap.add_argument("--plugins", action="append", default=[], metavar="LIB.so",
                    help="plugin library for trtexec --staticPlugins (repeatable)")
    ap.add_argument("--out", default=None, help="output folder (default runs/benchmark_trt, or the parent of "
                                                "--from-logs)")
    ap.add_argument("--from-logs", default=None, help="re-render the tables from saved LABEL_bN.log files")
    ap.add_argument("--trt-version", default=None, help="TensorRT version of trtexec (default: asked from it)")
    ap.add_argument("--dry-run", action="store_true", help="print the trtexec commands and exit")
    return ap


def _fixed_batch(engine: Path) -> int | None:
    from utils.qat.trt.trt_engine import read_engine_metadata
    b = read_engine_metadata(engine).get("batch") or {}
    return int(b["min"]) if b.get("min") is not None and b.get("min") == b.get("max") else None


def _static_batch(onnx: Path) -> int | None:
    """The batch of a fully static ONNX (trtexec takes no shape flags for it), else None."""
    try:
        _name, dims = read_image_input(onnx)
    except QATError:
        raise
    except Exception as e:  # onnx raises its own types for files that are not ONNX
        raise QATError(f"{onnx} is not a readable ONNX file ({type(e).__name__}); pass the file export_qat.py wrote.")
    batch = dims[0] if dims else None
    return batch if batch is not None and all(d is not None for d in dims) else None


def main(args: argparse.Namespace) -> None:
    check_args(args)
    if args.from_logs:
        runs = collect_logs(args.from_logs)
        out = Path(args.out) if args.out else Path(args.from_logs).resolve().parent
        sources: dict[str, str] = {}
    else:
        models = [(label, Path(src), int8) for label, src, int8 in (("FP16", args.fp16, False),
                                                                    ("INT8", args.int8, True)) if src]
        if not models:
            raise QATError("nothing to benchmark: pass --fp16 and/or --int8 (ONNX or engine), or --from-logs DIR.")
        for _label, src, _ in models:
            if not src.is_file():
                raise QATError(f"{src} not found; pass an exported ONNX or a built engine.")
        trtexec = Path("trtexec") if args.dry_run and args.trt_version else find_trtexec()
        version = args.trt_version or trtexec_version(trtexec)
        if version is None:
            raise QATError(f"cannot tell which TensorRT {trtexec} belongs to; pass --trt-version MAJOR.MINOR.")
        if version_tuple(version)[0] >= 11 and any(s.suffix == ".onnx" for _, s, int8 in models if not int8):
            print("note: TensorRT 11 is strongly typed: the FP16 baseline ONNX must be exported with --half, "
                  "or it runs in FP32.", file=sys.stderr)
        static = {src: _static_batch(src) for _, src, _ in models if src.suffix == ".onnx"}
        for src, sb in static.items():
            if sb is not None and any(b != sb for b in args.batch):
                raise QATError(f"{src} is a static-shape ONNX with batch {sb}, so it cannot run batch "
                               f"{next(b for b in args.batch if b != sb)}: pass --batch {sb}, or export with --dynamic.")
        out = Path(args.out or "runs/benchmark_trt")
        logs = out / "logs"
        runs = {}
        sources = {label: str(src) for label, src, _ in models}
        jobs = [(label, src, int8, b) for label, src, int8 in models for b in args.batch]
        try:
            from tqdm import tqdm
            progress = tqdm(jobs, desc="trtexec", unit="run", disable=args.dry_run)
        except ImportError:
            progress = jobs
        for label, src, int8, b in progress:
            shape: tuple[int, int, int] | None = (3, args.imgsz, args.imgsz)
            if src.suffix == ".onnx":
                if static[src] is not None:
                    shape = None  # trtexec: "Static model does not take explicit shapes"
            else:
                fixed = _fixed_batch(src)
                if fixed is not None and fixed != b:
                    raise QATError(f"{src} has a fixed batch of {fixed}, so it cannot run batch {b}: pass the ONNX "
                                   f"(an engine is then built per batch) or --batch {fixed}.")
            cmd = benchmark_command(src, batch=b, version=version, shape=shape,
                                    input_name=args.input_name, int8=int8, fp16=True,
                                    strongly_typed=args.strongly_typed, warmup=args.warmup, duration=args.duration,
                                    timing_cache=out / f"{label}.timing.cache", plugins=args.plugins,
                                    trtexec=trtexec)
            if args.dry_run:
                print(shlex.join(cmd))
                continue
            log = logs / log_name(label, b)
            rc, text = run_trtexec(cmd, log_path=log, echo=False)
            if rc != 0:
                raise QATError(f"trtexec failed (exit {rc}) for {label} at batch {b}; its output is in {log}.")
            runs.setdefault(label, {})[b] = parse_trtexec_output(text)
        if args.dry_run:
            return
    results = build_results(runs, sources=sources)
    paths = write_report(results, out)
    print(render_markdown(results))
    print("\n".join(f"wrote {p}" for p in paths.values()))


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
