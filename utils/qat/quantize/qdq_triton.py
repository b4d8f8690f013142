"""The fake quantization of ``utils/qat/quantize/qdq.py`` as two hand-written Triton kernels, launched directly.

The eager reference launches about twelve kernels forward and several backward per quantizer, and a QAT step is
bound by the CPU time of those calls; compiling them with TorchInductor halved the kernels but cost more CPU per
call (benchmarks/results/qat-step-fused-h100.md). Here a quantizer is one kernel forward (reads x once; writes y, the straight-through mask and,
while amax is learned, the float16 LSQ residual exactly as ``qdq._QDQ`` saves it) and one backward (the input's
gradient and, while amax is learned, the per-element amax gradient, summed afterwards by the same eager
``sum_to_size`` as the reference, so that it is bit for bit the reference's). The scale is computed in the
kernel (``qdq_triton_kernels.py`` says why that is the eager scale in every bit): no extra kernels per call.

    y = QDQTriton.apply(x, amax, -128, 127)   # what qdq.fake_quant calls where ``usable(x, amax)`` is True
"""
from __future__ import annotations

import functools

import torch

_MAX_ELEMENTS = 2 ** 31 - 2 ** 16  # the kernels index in int32


@functools.cache
def kernels():
    """The kernels module, or None where triton cannot be imported (its import costs about a second, once)."""
    try:
        from utils.qat.quantize import qdq_triton_kernels
    except ImportError:
        return None
    return qdq_triton_kernels


def usable(x: torch.Tensor, amax: torch.Tensor) -> bool:
    """Whether the kernels serve this call: triton importable, x on the current CUDA device (or the interpreter
    with CPU tensors), amax per tensor or one value per slice of axis 0, and x small enough for int32 indices."""
    k = kernels()
    if k is None or not 0 < x.numel() < _MAX_ELEMENTS or amax.device != x.device or not amax.is_contiguous():
        return False
    if k.NATIVE and (x.device.type != "cuda" or x.device.index != torch.cuda.current_device()):
        return False
    if amax.numel() == 1:
        return True
    return x.dim() > 0 and amax.numel() == x.shape[0] and amax.shape[:1] == x.shape[:1]


class QDQTriton(torch.autograd.Function):
    """``qdq._QDQ`` (same arguments, same results in every bit) running the Triton kernels; the caller checks
    ``usable`` first."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, amax: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
        k = kernels()
        x = x.contiguous()
        n = x.numel()
        per_channel = amax.numel() != 1
        learned = ctx.needs_input_grad[1]
        y = torch.empty_like(x)
        inside = torch.empty(x.shape, dtype=torch.bool, device=x.device)
        residual = torch.empty(x.shape, dtype=torch.float16, device=x.device) if learned else y
        k.qdq_forward[((n + k.BLOCK - 1) // k.BLOCK,)](
            x, amax, y, inside, residual, n, n // x.shape[0] if per_channel else 1,
            QMIN=qmin, QMAX=qmax, PER_CHANNEL=per_channel, RESIDUAL=learned, NATIVE=k.NATIVE,
            BLOCK=k.BLOCK, num_warps=k.NUM_WARPS)
        if learned:
            ctx.save_for_backward(inside, residual)
        else:
            ctx.save_for_backward(inside)
        ctx.amax_shape = amax.shape
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        k = kernels()
        learned = ctx.needs_input_grad[1]
        inside = ctx.saved_tensors[0]
        grad = grad.contiguous()
        n = grad.numel()
        grad_x = torch.empty_like(grad)
        local = torch.empty(grad.shape, dtype=torch.float32, device=grad.device) if learned else grad_x
        k.qdq_backward[((n + k.BLOCK - 1) // k.BLOCK,)](
            grad, inside, ctx.saved_tensors[1] if learned else inside, grad_x, local, n,
            RESIDUAL=learned, NATIVE=k.NATIVE, BLOCK=k.BLOCK, num_warps=k.NUM_WARPS)
        grad_amax = None
        if learned:
            grad_amax = local.sum_to_size(ctx.amax_shape) if len(ctx.amax_shape) else local.sum()
        return grad_x, grad_amax, None, None
