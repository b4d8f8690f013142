"""The fake quantization of ``utils/qat/quantize/qdq.py`` as compiled kernels: one kernel forward, one backward.

Written as plain PyTorch operations (``qdq._QDQ``, the reference), a quantizer launches about twelve kernels
forward and several backward, and a YOLOv9 model has 500 to 700 quantizers: on a GPU the QAT step then waits
for kernel launches, not for arithmetic. Here the same arithmetic is compiled by TorchInductor
(``torch.compile(dynamic=True)``: one compilation serves every shape) into one fused kernel that writes the
output and the saved mask (and, while amax is learned, the LSQ residual), and one that writes the input's
gradient (and the residual times the gradient, summed afterwards by the same eager reduction as the reference,
so that the amax gradient is bit-for-bit the reference's). It launches as few kernels as ``qdq_triton.py`` but
each compiled call costs more CPU than the operations it replaces, so it is slower per QAT step than both and runs
only when asked (``qdq.implementation("fused")``; docs/QAT.md "What a QAT step costs, and what made it cheaper").

Bit-exactness with the reference rests on three things, each checked by tests/test_qdq_fused.py:
- divisions stay IEEE divisions: the divisor 127 is a tensor argument (Inductor turns a division by a constant
  into a multiplication by its reciprocal on GPUs), and Triton's ``/`` is an approximate division unless
  Inductor's eager division rounding is on (``_EXACT``);
- ``torch.round`` is lowered to round-half-to-even (``nearbyint``), as in eager;
- everything is computed in float32 and cast once at the end, as the reference does.

    y = QDQFunction.apply(x, amax, -128, 127)      # what qdq.fake_quant calls under implementation("fused")
"""
from __future__ import annotations

import functools

import torch

LEVELS = 127  # 2 ** (8 - 1) - 1: the scale is float32(amax) / 127, as the exported QuantizeLinear stores it


def _exact_options() -> dict:
    """Inductor settings that keep divisions IEEE-exact on GPUs (their names moved between torch releases)."""
    from torch._inductor import config
    options = {}
    if hasattr(config, "eager_numerics"):
        options["eager_numerics.division_rounding"] = True
    elif hasattr(config, "emulate_division_rounding"):
        options["emulate_division_rounding"] = True
    return options


def _forward(x: torch.Tensor, amax: torch.Tensor, levels: torch.Tensor, qmin: int, qmax: int):
    xf = x.float()
    a = amax.float()
    scale = a / levels
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = xf / scale
    q = torch.clamp(torch.round(scaled), qmin, qmax)
    inside = xf.abs() <= a
    return (q * scale).to(x.dtype), inside, scaled, q


def forward_plain(x, amax, levels, qmin: int, qmax: int):
    y, inside, _, _ = _forward(x, amax, levels, qmin, qmax)
    return y, inside


def forward_residual(x, amax, levels, qmin: int, qmax: int):
    y, inside, scaled, q = _forward(x, amax, levels, qmin, qmax)
    return y, inside, torch.where(inside, q - scaled, q).half()


def backward_plain(grad, inside):
    return grad * inside.to(grad.dtype)


def backward_residual(grad, inside, residual, levels):
    return grad * inside.to(grad.dtype), grad.float() * residual.float() / levels


@functools.cache
def kernels() -> dict:
    """The four functions compiled (lazily: compiling costs seconds, once per dtype and amax rank)."""
    options = _exact_options()
    compile_ = functools.partial(torch.compile, dynamic=True, fullgraph=True, options=options)
    return {f.__name__: compile_(f) for f in (forward_plain, forward_residual, backward_plain, backward_residual)}


@functools.cache
def divisor(device: torch.device, levels: int = LEVELS) -> torch.Tensor:
    """``levels`` as a float32 tensor on ``device``: dividing by it is an IEEE division on every device
    (CUDA computes ``t / 127.0`` as ``t * (1 / 127)``, which differs in the last bit for some values)."""
    return torch.tensor(float(levels), dtype=torch.float32, device=device)


def flat_shapes(x: torch.Tensor, amax: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shapes the kernels see: per-tensor ``(N,)`` and ``()``, per-channel on axis 0 ``(C, N)`` and ``(C, 1)``;
    None for another layout (the eager reference runs it). Two layouts per dtype is all there is to compile
    for (a weight is a parameter, whose every shape dynamo would otherwise compile for anew)."""
    if amax.numel() == 1:
        return (x.numel(),), ()
    if x.dim() and amax.numel() == x.shape[0] and amax.shape[:1] == x.shape[:1]:
        return (x.shape[0], x.numel() // max(x.shape[0], 1)), (x.shape[0], 1)
    return None


class QDQFunction(torch.autograd.Function):
    """``qdq._QDQ`` (same arguments, same results in every bit) running the compiled kernels; the caller checks
    ``flat_shapes`` first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
        k, levels = kernels(), divisor(x.device)
        x_shape, a_shape = flat_shapes(x, amax)
        xf, af = x.detach().reshape(x_shape), amax.detach().reshape(a_shape)
        if ctx.needs_input_grad[1]:
            y, inside, residual = k["forward_residual"](xf, af, levels, qmin, qmax)
            ctx.save_for_backward(inside, residual)
        else:
            y, inside = k["forward_plain"](xf, af, levels, qmin, qmax)
            ctx.save_for_backward(inside)
        ctx.shapes = x.shape, amax.shape, a_shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        k = kernels()
        x_shape, amax_shape, a_shape = ctx.shapes
        flat = grad.reshape(ctx.saved_tensors[0].shape)
        if not ctx.needs_input_grad[1]:
            return k["backward_plain"](flat, ctx.saved_tensors[0]).view(x_shape), None, None, None
        inside, residual = ctx.saved_tensors
        grad_x, local = k["backward_residual"](flat, inside, residual, divisor(grad.device))
        grad_amax = (local.sum_to_size(a_shape) if len(a_shape) else local.sum()).view(amax_shape)
        return grad_x.view(x_shape), grad_amax, None, None
