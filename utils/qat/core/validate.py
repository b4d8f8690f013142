"""Up-front checks of numeric command-line flags: one table for every CLI of the toolkit.

Each CLI calls :func:`check_args` first thing in ``main``, before it reads a checkpoint or a dataset and
before it creates a run folder. A value out of range ends the command with one sentence naming the flag,
the value and the valid range (``run_cli``: exit 2). Choice flags are argparse's (``choices=``), which
names the valid choices the same way.

A new flag joins by adding a row to ``FLAGS``, keyed by the flag as typed; its value is read from the
argparse attribute of the same name (``--calib-batches`` -> ``args.calib_batches``). A flag that takes
several values (``--imgsz H W``) has each value checked.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from utils.qat.core.errors import QATError


@dataclass(frozen=True)
class Range:
    """Valid values: ``low`` .. ``high`` (either may be open or absent), and what to do instead."""
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    hint: str = ""

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None and not (self.low_open or self.high_open):
            return f"between {low} and {high}"
        parts = []
        if self.low is not None:
            parts.append(f"greater than {low}" if self.low_open else f"at least {low}")
        if self.high is not None:
            parts.append(f"less than {high}" if self.high_open else f"at most {high}")
        return " and ".join(parts)


def _number(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


_PTQ_ONLY = "for PTQ only, without fine-tuning, pass --ptq-only instead"

FLAGS: dict[str, Range] = {
    # data, evaluation (qat.py, segment/qat_seg.py, val_trt.py, export_qat.py, export_yoloV9.py)
    "--batch-size": Range(1),
    "--batch": Range(1),
    "--imgsz": Range(32, hint="e.g. 640; rounded up to a multiple of the model stride"),
    "--size": Range(32, hint="e.g. 640"),
    "--workers": Range(0),
    "--num-image": Range(1, hint="leave it out to evaluate every validation image"),
    "--conf-thres": Range(0, 1),
    "--iou-thres": Range(0, 1),
    "--max-det": Range(1),
    # calibration and QAT (qat.py quantize / sensitive)
    "--calib-batches": Range(1),
    "--head-batches": Range(1),
    "--percentile": Range(0, 100, low_open=True, hint="e.g. 99.99"),
    "--seed": Range(0, 2**32 - 1),
    "--epochs": Range(1, hint=_PTQ_ONLY),
    "--iters": Range(1, hint=_PTQ_ONLY),
    "--lr": Range(0, 1, low_open=True, hint="e.g. 3e-5"),
    "--weight-decay": Range(0, 1),
    "--ema": Range(0, 1, high_open=True, hint="0 turns the average off; e.g. 0.99"),
    "--supervision-stride": Range(1),
    "--amax-lr": Range(0, 1, hint="0 keeps the calibrated amax; e.g. 1e-3"),
    "--bias-lr": Range(0, 1000, low_open=True, hint="1 = the same rate as the weights"),
    "--box-gain": Range(0, 1000, hint="e.g. 1"),
    "--mask-gain": Range(0, 1000, hint="e.g. 5"),
    "--top": Range(1),
    # the accuracy budget (qat.py quantize --max-drop)
    "--max-drop": Range(0, 1, hint="mAP50-95 points below the FP model, e.g. 0.005"),
    "--holdout-fraction": Range(0, 1, low_open=True, high_open=True, hint="e.g. 0.2"),
    "--min-int8": Range(0, 1, hint="1 keeps every layer INT8; e.g. 0.9"),
    "--confidence": Range(0.5, 1, high_open=True, hint="0.5 decides on the held-out figures alone; e.g. 0.9"),
    # ONNX export (INT8 per-channel Q/DQ needs opset 13; torch's TorchScript exporter stops at 20)
    "--opset": Range(13, 20, hint="e.g. 17"),
    # benchmarks/ckpt_vs_graph.py
    "--silu-ulp-draws": Range(0, 100, hint="e.g. 10"),
    # reparameterization.py
    "--classes_num": Range(1),
    # TensorRT engines and benchmarks (scripts/trtexec_cli.py build, scripts/benchmark_trt.py)
    "--min": Range(1),
    "--opt": Range(1),
    "--max": Range(1),
    "--workspace-mib": Range(1),
    "--warmup": Range(0),  # QAT warm-up steps; trtexec warm-up milliseconds; CPU benchmark warm-up rounds
    "--duration": Range(1),
    # the CPU benchmark (scripts/benchmark_cpu.py)
    "--threads": Range(1, hint="leave it out to use every usable core"),
    "--runs": Range(1, hint="e.g. 10"),
}


def check_value(flag: str, value, valid: Range | None = None) -> None:
    """Raise a QATError unless ``value`` (or each of a list of values) is valid for ``flag``."""
    valid = valid or FLAGS[flag]
    for v in value if isinstance(value, (list, tuple)) else [value]:
        if v is not None and v not in valid:
            hint = f" ({valid.hint})" if valid.hint else ""
            raise QATError(f"{flag} {_number(v) if isinstance(v, (int, float)) else v} is out of range: "
                           f"it must be {valid}{hint}.")


def check_args(args: argparse.Namespace, flags: dict[str, Range] = FLAGS) -> None:
    """Check every flag of ``flags`` that ``args`` has (flags a command lacks, or left at None, are skipped)."""
    for flag, valid in flags.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is not None:
            check_value(flag, value, valid)


def image_size(values, flag: str = "--imgsz") -> tuple[int, int]:
    """``N`` or ``H W`` as ``(H, W)``; the one check a size flag needs beyond its ``FLAGS`` range (how many)."""
    values = list(values)
    if len(values) not in (1, 2):
        raise QATError(f"{flag} takes one or two sizes (N or H W), got {' '.join(map(str, values))}.")
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


def check_imgsz(imgsz: int, stride: int) -> int:
    """Round ``imgsz`` up to a multiple of the model stride, with a notice, as upstream does."""
    fixed = int(math.ceil(imgsz / stride) * stride)
    if fixed != imgsz:
        print(f"notice: --imgsz {imgsz} is not a multiple of the model stride {stride}; using {fixed}.")
    return fixed
