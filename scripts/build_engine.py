#!/usr/bin/env python3
"""Build a TensorRT 10/11 engine from an exported ONNX with the TensorRT Python API (no trtexec needed).

    python3 scripts/build_engine.py ONNX ENGINE [--min B] [--opt B] [--max B] [--imgsz N] [--graph]

Writes ENGINE and ENGINE.json (and ENGINE.layer.json with --graph). The work is done by
``utils.qat.trt.trt_engine.build_engine``; ``scripts/generate_trt_engine.sh`` builds with trtexec instead.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from utils.qat.core.errors import run_cli  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 scripts/build_engine.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("onnx")
    ap.add_argument("engine")
    ap.add_argument("--min", type=int, default=1)
    ap.add_argument("--opt", type=int, default=None)
    ap.add_argument("--max", type=int, default=16)
    ap.add_argument("--imgsz", type=int, default=None)
    ap.add_argument("--strongly-typed", action="store_true", default=None)
    ap.add_argument("--fp16-only", action="store_true")
    ap.add_argument("--workspace", type=float, default=None, help="GiB (default: free GPU memory)")
    ap.add_argument("--timing-cache", default=None)
    ap.add_argument("--plugins", action="append", default=[], metavar="LIB.so",
                    help="plugin library to load (repeatable), e.g. one providing EfficientNMSX_TRT")
    ap.add_argument("--graph", action="store_true",
                    help="build with detailed profiling verbosity and write X.engine.layer.json (IEngineInspector)")
    ap.add_argument("--verbose", action="store_true")
    return ap


def main(a: argparse.Namespace) -> None:
    from utils.qat.trt.trt_engine import build_engine
    print(build_engine(a.onnx, a.engine, min_batch=a.min, opt_batch=a.opt, max_batch=a.max, imgsz=a.imgsz,
                       strongly_typed=a.strongly_typed, int8=not a.fp16_only, workspace_gib=a.workspace,
                       timing_cache=a.timing_cache, plugins=a.plugins, layer_info=a.graph, verbose=a.verbose))


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
