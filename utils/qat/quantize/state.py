"""The state of a model's quantizers: which are on, switching them for a while, reading their amax.

    with quantizers_off(layer_quantizers):     # e.g. one layer in floating point for a sensitivity pass
        evaluate(...)
    with collecting(enabled_quantizers(model)):  # statistics in, no quantization (calibration)
        model(images)
    load_amax(other_model, amax_state(model))   # the amax of one model given to another of the same structure
    with weights_quantized(model):              # many forward passes with the weights fixed (the amax searches)
        model(images)

Each context puts every quantizer back exactly as it found it, also when the block raises.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import utils.qat.quantize.modelopt_import  # noqa: F401  (modelopt without its unused plugins: first)
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
@torch.no_grad()
def weights_quantized(model: nn.Module) -> Iterator[None]:
    """Inside the block each module's weight holds what its enabled weight quantizer makes of it, and that quantizer
    is off: the same forward pass in every bit (the quantizer's own function computed it), without fake-quantizing
    the unchanged weights again on every pass. For work that runs the network many times with fixed weights and no
    gradients (the amax searches); the weights and quantizers are put back after it, also when the block raises."""
    saved = []
    try:
        for module in model.modules():
            q = getattr(module, "weight_quantizer", None)
            weight = getattr(module, "weight", None)
            if isinstance(q, TensorQuantizer) and q.is_enabled and isinstance(weight, torch.Tensor):
                quantized = q(weight).to(weight.dtype)
                saved.append((weight, weight.data, q))
                weight.data = quantized
                q.disable()
        yield
    finally:
        for weight, data, q in saved:
            weight.data = data
            q.enable()


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


def amax_vector(model: nn.Module) -> torch.Tensor:
    """All enabled quantizers' amax, flattened in module order (for comparing ranks or runs)."""
    parts = [m.amax.detach().float().flatten().cpu() for m in enabled_quantizers(model) if m.amax is not None]
    return torch.cat(parts) if parts else torch.zeros(0)


def amax_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each enabled quantizer's amax by module name (a CPU copy), as ``load_amax`` takes it."""
    return {n: m.amax.detach().cpu().clone() for n, m in model.named_modules()
            if isinstance(m, TensorQuantizer) and m.is_enabled and m.amax is not None}


def load_amax(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Set the amax of the quantizers named in ``state`` (from ``amax_state`` of a model of the same structure)."""
    modules = dict(model.named_modules())
    for name, amax in state.items():
        q = modules[name]
        device = q.amax.device if q.amax is not None else next((t.device for t in model.parameters()), amax.device)
        q.amax = amax.to(device)


def amax_table(model: nn.Module) -> dict[str, list[float]]:
    """Each enabled quantizer's amax by module name (what ``YOLOV9_QAT_AMAX_DUMP`` writes per rank)."""
    return {n: a.float().flatten().tolist() for n, a in amax_state(model).items()}
