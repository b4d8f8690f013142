"""The state of a model's quantizers: which are on, switching them for a while, reading their amax.

    with quantizers_off(layer_quantizers):     # e.g. one layer in floating point for a sensitivity pass
        evaluate(...)
    with collecting(enabled_quantizers(model)):  # statistics in, no quantization (calibration)
        model(images)

Each context puts every quantizer back exactly as it found it, also when the block raises.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from modelopt.torch.quantization.nn import TensorQuantizer
from torch import nn


def enabled_quantizers(model: nn.Module) -> list[TensorQuantizer]:
    return [m for m in model.modules() if isinstance(m, TensorQuantizer) and m.is_enabled]


@contextlib.contextmanager
def quantizers_off(quantizers: Iterable[TensorQuantizer]) -> Iterator[None]:
    """Every quantizer of ``quantizers`` passes its input through unchanged inside the block."""
    quantizers = list(quantizers)
    was_on = [q.is_enabled for q in quantizers]
    for q in quantizers:
        q.disable()
    try:
        yield
    finally:
        for q, on in zip(quantizers, was_on):
            q.enable() if on else q.disable()


@contextlib.contextmanager
def collecting(quantizers: Iterable[TensorQuantizer]) -> Iterator[None]:
    """Calibration mode inside the block: each quantizer feeds its calibrator and does not quantize."""
    quantizers = list(quantizers)
    for q in quantizers:
        q.disable_quant()
        q.enable_calib()
    try:
        yield
    finally:
        for q in quantizers:
            q.disable_calib()
            q.enable_quant()


@contextlib.contextmanager
def not_collecting(quantizers: Iterable[TensorQuantizer]) -> Iterator[None]:
    """Inside a ``collecting`` block: neither collect nor quantize for a moment (a plain forward pass)."""
    quantizers = list(quantizers)
    for q in quantizers:
        q.disable_calib()
    try:
        yield
    finally:
        for q in quantizers:
            q.enable_calib()


def amax_vector(model: nn.Module) -> torch.Tensor:
    """All enabled quantizers' amax, flattened in module order (for comparing ranks or runs)."""
    parts = [m.amax.detach().float().flatten().cpu() for m in enabled_quantizers(model) if m.amax is not None]
    return torch.cat(parts) if parts else torch.zeros(0)


def amax_table(model: nn.Module) -> dict[str, list[float]]:
    """Each enabled quantizer's amax by module name (what ``YOLOV9_QAT_AMAX_DUMP`` writes per rank)."""
    return {n: m.amax.detach().float().flatten().cpu().tolist() for n, m in model.named_modules()
            if isinstance(m, TensorQuantizer) and m.is_enabled and m.amax is not None}
