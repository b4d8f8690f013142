"""INT8 fake quantization computed the way ONNX QuantizeLinear / DequantizeLinear compute it.

modelopt's own INT8 fake quantization multiplies by ``127 / amax``; the exported graph (and so ONNX
Runtime and TensorRT) divides by the float32 scale ``amax / 127``. The two differ in the last bit for
some inputs, and where a value sits on a rounding tie (ADown's average of equal-scale values lands on
exact .5 steps) they round to different integers. Those flips accumulate over twenty layers: the model
evaluated during QAT was not quite the model a runtime executes (up to 0.0025 mAP50-95 apart on
GELAN-C at 640 px).

Every quantizer of a model made by ``utils.qat.quantize.model_quant`` runs through ``fake_quant`` below instead, a
backend joined through modelopt's own registry (``register_quant_backend``):

    scale = float32(amax) / 127            (0 -> 1, as the exported graph stores it)
    q     = clamp(round_half_to_even(x / scale), -128, 127)
    y     = q * scale

with the straight-through gradient inside [-amax, amax] and zero outside (modelopt's default). While
exporting to ONNX the quantizer hands over to modelopt's own function, whose symbolic writes the
QuantizeLinear / DequantizeLinear pair with exactly that scale.

While QAT learns amax (``utils/qat/quantize/amax.py``), amax also gets a gradient, LSQ's (Esser et al.,
2020): ``(q - x / scale) / 127`` inside the range, ``q / 127`` where the input is clipped. Where the amax
lives is a TensorQuantizer internal (its ``_amax`` slot: a buffer, or a parameter while learned): this
module is the one place that touches it (``learned_amax``, ``amax_to_parameter``, ``amax_to_buffer``), as
``utils/qat/quantize/calib.py`` is for the calibrators' internals.

Two implementations compute it, bit for bit alike (tests/test_qdq_triton.py). A QAT step waits on the CPU, which
issues thousands of small operations per step, so what counts is the CPU time per call:

- ``triton``, the default on CUDA (``utils/qat/quantize/qdq_triton.py``): two hand-written Triton kernels, one
  launch forward and one backward. On an H100 at 640 px, batch 16, a GELAN-C step took 0.212 s against 0.267 s
  eager, GELAN-E 0.375 s against 0.554 s (benchmarks/results/qat-step-h100.md), and the default recipe ended on
  GELAN-C with the eager run's AP at every epoch (benchmarks/results/gelan-c-default-triton-h100.md).
- ``eager``, ``_QDQ`` below: the reference, and the default on the CPU and wherever triton is missing. Where no
  gradient is wanted (calibration's searches, evaluation) it runs as ``qdq_values``: the same values in every bit,
  in fewer passes over memory.

The same arithmetic compiled by TorchInductor launched as few kernels as ``triton`` but cost more CPU per call than
the eager operations it replaced (0.369 s against 0.290 s a GELAN-C step, benchmarks/results/qat-step-fused-h100.md),
so it was dropped.

``implementation(name)`` chooses one for a block (benchmarks, tests). On one GPU a QAT step's forward and backward
are then replayed from a CUDA graph (``utils/qat/quantize/cuda_graph.py``), which takes the per-call CPU cost away
from every step after the first.
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from utils.qat.quantize import qdq_triton
from utils.qat.quantize.qdq_triton import QDQTriton

if TYPE_CHECKING:
    from modelopt.torch.quantization.nn import TensorQuantizer


BACKEND = "yolov9_qat_qdq"
IMPLEMENTATIONS = ("auto", "eager", "triton")  # auto: triton on CUDA, eager elsewhere (module docstring)
_implementation = ["auto"]


@functools.cache
def divisor(device: torch.device, levels: int = 127) -> torch.Tensor:
    """``levels`` (2 ** (8 - 1) - 1) as a float32 tensor on ``device``: dividing by it is an IEEE division on every
    device (CUDA computes ``t / 127.0`` as ``t * (1 / 127)``, which differs in the last bit for some values)."""
    return torch.tensor(float(levels), dtype=torch.float32, device=device)


def qdq_scale(amax: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """The float32 scale the exported QuantizeLinear carries for ``amax`` (modelopt's export_int8)."""
    scale = amax.detach().float() / divisor(amax.device, 2 ** (num_bits - 1) - 1)
    return torch.where(scale == 0, torch.ones_like(scale), scale)


@contextlib.contextmanager
def implementation(name: str):
    """Every quantizer runs ``name`` (one of ``IMPLEMENTATIONS``) inside the block (benchmarks, tests)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown fake-quant implementation {name!r}; choose one of {', '.join(IMPLEMENTATIONS)}")
    saved = _implementation[0]
    _implementation[0] = name
    try:
        yield
    finally:
        _implementation[0] = saved


def _function(inputs: torch.Tensor, amax: torch.Tensor) -> type[torch.autograd.Function]:
    """The autograd function that fake-quantizes ``inputs``: the implementation chosen (``auto``: triton on CUDA)
    where it serves the call (triton importable, the current CUDA device, amax per tensor or on axis 0), else the
    reference."""
    mode = _implementation[0]
    if mode == "triton" or (mode == "auto" and inputs.device.type == "cuda"):
        return QDQTriton if qdq_triton.usable(inputs, amax) else _QDQ
    return _QDQ


class _QDQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
        xf = x.float()
        scale = qdq_scale(amax)
        scaled = xf / scale
        q = torch.clamp(torch.round(scaled), qmin, qmax)
        inside = xf.abs() <= amax.detach().float()
        if ctx.needs_input_grad[1]:  # learned amax: keep d(q * scale) / d amax (times 127), in half precision
            ctx.save_for_backward(inside, torch.where(inside, q - scaled, q).half())
        else:
            ctx.save_for_backward(inside)
        ctx.amax_shape = amax.shape
        return (q * scale).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inside = ctx.saved_tensors[0]
        grad_x = grad * inside.to(grad.dtype)
        grad_amax = None
        if ctx.needs_input_grad[1]:
            # a tensor divisor: CUDA divides by a Python number as a multiplication by its reciprocal
            local = grad.float() * ctx.saved_tensors[1].float() / divisor(grad.device)
            grad_amax = local.sum_to_size(ctx.amax_shape) if len(ctx.amax_shape) else local.sum()
        return grad_x, grad_amax, None, None


def fake_quant(inputs: torch.Tensor, quantizer) -> torch.Tensor:
    """modelopt backend entry point: ``inputs`` fake-quantized by ``quantizer`` (its amax, bits, sign)."""
    learned = learned_amax(quantizer)
    # .data, not .detach(): while exporting, the scale must reach modelopt's symbolic as a constant
    amax = learned if learned is not None and torch.is_grad_enabled() else quantizer.amax.data
    if amax.device != inputs.device:
        amax = amax.to(inputs.device)
    num_bits, unsigned, narrow = quantizer.num_bits, quantizer.unsigned, quantizer.narrow_range
    if torch.onnx.is_in_onnx_export() or not isinstance(num_bits, int):
        from modelopt.torch.quantization.tensor_quant import fake_tensor_quant
        axis = quantizer.axis[0] if isinstance(quantizer.axis, tuple) else quantizer.axis
        # pass_through_bwd=True: no backward pass runs during export
        return fake_tensor_quant(inputs, amax, None, num_bits, unsigned, narrow,
                                 quantizer.trt_high_precision_dtype, True, None, axis)
    qmax = 2 ** (num_bits - 1 + int(unsigned)) - 1
    qmin = 0 if unsigned else (-qmax if narrow else -qmax - 1)
    function = _function(inputs, amax)
    if function is _QDQ and not (torch.is_grad_enabled() and (inputs.requires_grad or amax.requires_grad)):
        return qdq_values(inputs, amax, qmin, qmax)
    return function.apply(inputs, amax, qmin, qmax)


def qdq_values(x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """``_QDQ``'s forward where no gradient is wanted (calibration's searches, evaluation): the same values in every
    bit, computed in place on one new tensor and without the clip mask the backward pass would need (on a CPU the
    quantized forward of YOLOv9-t spent a third of its fake-quantization time making that mask)."""
    scale = qdq_scale(amax)
    return (x.float() / scale).round_().clamp_(qmin, qmax).mul_(scale).to(x.dtype)


def register() -> None:
    """Make the backend known to modelopt (idempotent)."""
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (is_registered_quant_backend,
                                                                          register_quant_backend)
    if not is_registered_quant_backend(BACKEND):
        register_quant_backend(BACKEND, fake_quant)


def use_qdq_rounding(model: nn.Module) -> nn.Module:
    """Route every quantizer of ``model`` through ``fake_quant`` (after quantize and after restore)."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    register()
    for m in model.modules():
        if isinstance(m, TensorQuantizer):
            m.backend = BACKEND
    return model


@contextlib.contextmanager
def full_fp32():
    """Convolutions and matmuls in full float32 inside the block (TF32 off).

    cuDNN runs float32 convolutions in TF32 by default on Ampere and newer GPUs (10-bit mantissa): about
    1e-3 relative error on every conv output, which moves values across rounding boundaries of the next
    quantizer far more often than the runtimes' own last-bit differences. A fake-quantized model is
    therefore evaluated in full float32, the arithmetic of ONNX Runtime on the CPU and the closest to
    TensorRT's INT8 kernels (exact integer accumulation, then float scaling)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


# ---- where a quantizer keeps its amax --------------------------------------------------------------

def learned_amax(quantizer: TensorQuantizer) -> nn.Parameter | None:
    """The quantizer's amax parameter while QAT learns it, else None."""
    return quantizer._parameters.get("_amax")


def amax_to_parameter(quantizer: TensorQuantizer, param: nn.Parameter) -> None:
    """Make ``param`` the quantizer's amax (replacing its buffer): what the forward pass reads and differentiates."""
    del quantizer._buffers["_amax"]
    quantizer._parameters["_amax"] = param


def amax_to_buffer(quantizer: TensorQuantizer) -> None:
    """Put a plain buffer back in the amax slot, holding the parameter's current value."""
    param = quantizer._parameters.pop("_amax")
    quantizer._buffers["_amax"] = param.detach().clone()
