"""Diagnostics: what one stage does on one model, asked when a figure needs explaining. One subcommand each; its
code is benchmarks/parts/NAME.py, and `diagnose.py SUBCOMMAND --help` gives its flags and what it writes.

  calib-sample   how far activation histograms built from a sample of each image's values (`qat.py quantize
                 --calib-sample`) move the calibrated scales, and the time they save (one calibration pass)
  ov-profile     an INT8 graph against its FP graph at OpenVINO's default precision, convolution by convolution,
                 and mixed graphs (some convolutions left in floating point) timed
  ptq-spread     how much of a PTQ figure is the setting and how much the draw: `qat.py quantize` reports
                 tabulated side by side per model and setting
  silu-probe     where a runtime's arithmetic parts from qat.py's: one quantized convolution and its SiLU on ONNX
                 Runtime (integer and float) and OpenVINO, compared element by element with the exact result

calib-sample and ov-profile run from the top of a patched YOLOv9 tree (they use its utils/qat); ptq-spread runs
and silu-probe run anywhere (this checkout's library):

    python3 /path/to/yolov9-qat/benchmarks/diagnose.py calib-sample --weights yolov9-t-coco.pt --data coco.yaml \\
        --sample 4096 16384 65536 --out runs/calib-sample --label yolov9-t-2core
    python3 /path/to/yolov9-qat/benchmarks/diagnose.py ov-profile --fp yolov9-t.onnx --int8 ptq_yolov9-t.onnx \\
        --out runs/ov-profile --label yolov9-t-16core
    python3 benchmarks/diagnose.py ptq-spread runs/sweep/*/report.json --out runs/ptq-spread --label ptq-spread
    python3 benchmarks/diagnose.py silu-probe --out runs/silu-probe --label amd-epyc
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

#: subcommand -> its module in benchmarks/parts/
SUBCOMMANDS = {"calib-sample": "calib_sample", "ov-profile": "ov_profile", "ptq-spread": "ptq_spread",
               "silu-probe": "silu_probe"}


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("subcommand", choices=SUBCOMMANDS, help="the diagnostic to run (its flags: SUBCOMMAND --help)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its flags")
    return p


def subcommand(name: str):
    """The module of a subcommand (imported only when it runs: two of them need a patched tree)."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(f"parts.{SUBCOMMANDS[name]}")


def parse(module, args: argparse.Namespace) -> argparse.Namespace:
    """The subcommand's own flags (its --help prints them and exits)."""
    parser = module.get_args_parser()
    parser.prog = f"{Path(sys.argv[0]).name} {args.subcommand}"
    return parser.parse_args(args.args)


def main(args: argparse.Namespace):
    module = subcommand(args.subcommand)
    return module.main(parse(module, args))


if __name__ == "__main__":
    top = get_args_parser().parse_args()
    chosen = subcommand(top.subcommand)
    flags = parse(chosen, top)
    from utils.qat.core.errors import run_cli  # the library the subcommand imported: the tree's, or this checkout's

    run_cli(lambda: chosen.main(flags))
