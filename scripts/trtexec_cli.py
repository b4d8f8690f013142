#!/usr/bin/env python3
"""trtexec from the command line: build an engine with flags for its TensorRT version, find trtexec, check
the TensorRT install, or turn a saved trtexec log into JSON.

    python3 scripts/trtexec_cli.py build ONNX ENGINE [--min B] [--opt B] [--max B] [--imgsz N] [--graph] [-- FLAGS]
    python3 scripts/trtexec_cli.py find | check
    python3 scripts/trtexec_cli.py parse LOG

``scripts/generate_trt_engine.sh`` runs ``build``; ``scripts/val_trt.sh`` runs ``check``. The work is done by
``utils.qat.trt.trtexec`` (flags per TensorRT version: docs/TENSORRT.md).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.qat.trt import trtexec  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402


def cmd_build(a: argparse.Namespace) -> None:
    cmd = trtexec.build_engine(a.onnx, a.engine, min_batch=a.min, opt_batch=a.opt, max_batch=a.max, imgsz=a.imgsz,
                               fp16_only=a.fp16_only, strongly_typed=a.strongly_typed, graph=a.graph,
                               timing_cache=a.timing_cache, workspace_mib=a.workspace_mib, plugins=a.plugins,
                               trt_version=a.trt_version, extra=a.extra, dry_run=a.dry_run, echo=not a.quiet)
    if a.dry_run:
        print(shlex.join(cmd))
        return
    print(f"engine: {a.engine}")
    if a.graph:
        print(f"layer info: {a.engine}.layer.json\nprofile: {a.engine}.profile.json")


def cmd_check(_a: argparse.Namespace) -> None:
    """What val_trt.sh needs before a long export: trtexec and the TensorRT Python package."""
    from utils.qat.trt.trt_common import trt_version_string
    exe = trtexec.find_trtexec()
    python_version = trt_version_string()
    print(f"trtexec: {exe}\ntrtexec version: {trtexec.trtexec_version(exe) or python_version}\n"
          f"tensorrt: {python_version}")


def cmd_parse(a: argparse.Namespace) -> None:
    p = Path(a.log)
    if not p.is_file():
        raise QATError(f"log file {p} not found; save trtexec's output with `trtexec ... | tee LOG`.")
    print(json.dumps(trtexec.parse_trtexec_output(p.read_text(errors="replace")), indent=2))


def get_args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 scripts/trtexec_cli.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    build = "build an engine from an ONNX with trtexec (TensorRT-version-aware flags)"
    b = sub.add_parser("build", help=build, description=build + "; writes ENGINE whole, ENGINE.json (TensorRT "
                       "version, stride, names, image size) and ENGINE.build.log")
    b.add_argument("onnx", help="the graph export_qat.py wrote")
    b.add_argument("engine", help="the engine file to write")
    b.add_argument("--min", type=int, default=1, help="min batch of the profile (default 1)")
    b.add_argument("--opt", type=int, default=None, help="opt batch (default: --max)")
    b.add_argument("--max", type=int, default=16, help="max batch (default 16)")
    b.add_argument("--imgsz", type=int, default=None, help="image size for dynamic H/W inputs")
    b.add_argument("--fp16-only", action="store_true", help="FP16 baseline: no --int8 (TensorRT <= 10)")
    b.add_argument("--strongly-typed", action="store_true", help="--stronglyTyped on TensorRT 10 (always on 11)")
    b.add_argument("--graph", action="store_true", help="also export X.engine.layer.json and X.engine.profile.json")
    b.add_argument("--timing-cache", default=None, help="timing cache file (default: X.engine.timing.cache)")
    b.add_argument("--workspace-mib", type=int, default=None, help="workspace pool limit (default: trtexec's)")
    b.add_argument("--plugins", action="append", default=[], metavar="LIB.so",
                   help="plugin library for trtexec --staticPlugins (repeatable), e.g. one providing EfficientNMSX_TRT")
    b.add_argument("--trt-version", default=None, help="TensorRT version of trtexec (default: asked from it)")
    b.add_argument("--dry-run", action="store_true", help="print the trtexec command and exit")
    b.add_argument("--quiet", action="store_true", help="do not echo trtexec's output (it is logged anyway)")
    b.add_argument("extra", nargs="*", help="more trtexec flags, after --")
    b.set_defaults(func=cmd_build)
    find = "print where trtexec is: TRTEXEC if set, else trtexec on PATH, else the usual install folders"
    sub.add_parser("find", help=find, description=find + "; one error sentence naming where to get it if none "
                   "is found").set_defaults(func=lambda a: print(trtexec.find_trtexec()))
    check = "check trtexec and the TensorRT Python package"
    sub.add_parser("check", help=check, description=check + " (what val_trt.sh needs before a long export): prints "
                   "where trtexec is, its version and the tensorrt package's").set_defaults(func=cmd_check)
    parse = "parse a saved trtexec log into JSON"
    p = sub.add_parser("parse", help=parse, description=parse + " (throughput, latency percentiles, GPU compute time, "
                       "as scripts/benchmark_trt.py reads them), printed on standard output")
    p.add_argument("log", help="trtexec's output, saved (trtexec ... | tee LOG)")
    p.set_defaults(func=cmd_parse)
    return ap


def main(args: argparse.Namespace) -> None:
    from utils.qat.core.validate import check_args
    check_args(args)
    args.func(args)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
