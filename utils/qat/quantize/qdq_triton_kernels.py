"""The two Triton kernels of ``utils/qat/quantize/qdq_triton.py`` (this module imports triton; that one may not).

Each element is computed exactly as ``qdq._QDQ`` computes it, in float32:

    scale  = div_rn(float32(amax), 127), 0 -> 1      IEEE division, as eager's division by a float32 tensor
    scaled = div_rn(x, scale)                        (Triton's ``/`` is an approximate division on GPUs)
    q      = min(max(rint(scaled), QMIN), QMAX)      round half to even, as torch.round; NaN stays NaN
    y      = q * scale, cast to x's dtype            (round to nearest even, as .to())

No multiply-add appears anywhere (a contracted FMA would round once where eager rounds twice). Under
``TRITON_INTERPRET=1`` (numpy, on the CPU) libdevice does not exist and the cast to bfloat16 does not round to
nearest even: there (``NATIVE`` False) the kernels round half to even with floor and compares and cast to
bfloat16 with integer bit operations, the same results by construction; the GPU runs ``libdevice.rint`` and
its own conversions.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - every triton 3 has it
    InterpretedFunction = ()

LEVELS = tl.constexpr(127.0)  # qdq.qdq_scale's divisor: 2 ** (8 - 1) - 1 whatever the bits, as the exported graph stores it
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _round_half_even(v, NATIVE: tl.constexpr):
    if NATIVE:
        r = libdevice.rint(v)
    else:
        f = tl.floor(v)
        d = v - f  # exact: v and floor(v) are within one binade's integer grid
        half = f * 0.5
        odd = tl.floor(half) != half
        r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
        r = tl.where(r == 0.0, v * 0.0, r)  # -0.3 rounds to -0.0, as rint does (f + 1.0 would give +0.0)
    return r


@triton.jit
def _cast(v, dtype: tl.constexpr, NATIVE: tl.constexpr):
    if NATIVE or dtype != tl.bfloat16:
        r = v.to(dtype)
    else:  # the interpreter's float32 -> bfloat16 rounds ties away and drops the carry: round to nearest even here
        u = v.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        r = (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return r


@triton.jit
def qdq_forward(x_ptr, amax_ptr, y_ptr, inside_ptr, residual_ptr, n, inner,
                QMIN: tl.constexpr, QMAX: tl.constexpr, PER_CHANNEL: tl.constexpr, RESIDUAL: tl.constexpr,
                NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    """y (x's dtype), inside = |x| <= amax (bool) and, with RESIDUAL, where(inside, q - scaled, q) in float16.
    Per channel, amax has one value per slice of ``inner`` consecutive elements (axis 0 of a contiguous x)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_CHANNEL:
        a = tl.load(amax_ptr + offs // inner, mask=mask, other=1.0).to(tl.float32)
    else:
        a = tl.load(amax_ptr).to(tl.float32)
    scale = tl.div_rn(a, LEVELS)
    scale = tl.where(scale == 0.0, 1.0, scale)
    scaled = tl.div_rn(x, scale)
    r = _round_half_even(scaled, NATIVE)
    q = tl.where(r < QMIN, QMIN, tl.where(r > QMAX, QMAX, r))  # compares, not min/max: NaN passes as in torch.clamp
    inside = tl.abs(x) <= a
    tl.store(y_ptr + offs, _cast(q * scale, y_ptr.dtype.element_ty, NATIVE), mask=mask)
    tl.store(inside_ptr + offs, inside, mask=mask)
    if RESIDUAL:
        tl.store(residual_ptr + offs, tl.where(inside, q - scaled, q).to(tl.float16), mask=mask)


@triton.jit
def qdq_backward(grad_ptr, inside_ptr, residual_ptr, grad_x_ptr, local_ptr, n,
                 RESIDUAL: tl.constexpr, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    """grad_x = grad * inside (grad's dtype) and, with RESIDUAL, the amax gradient before its sum:
    float32(grad) * float32(residual) / 127 (the eager reduction sums it, so the sum is the reference's)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    inside = tl.load(inside_ptr + offs, mask=mask, other=0)
    # times 0, not a select: -0 and NaN as eager; in float32 as eager's half-precision multiply (exact either way)
    tl.store(grad_x_ptr + offs, _cast(g * inside.to(tl.float32), grad_x_ptr.dtype.element_ty, NATIVE), mask=mask)
    if RESIDUAL:
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(local_ptr + offs, tl.div_rn(g * r, LEVELS), mask=mask)


# False under the interpreter (TRITON_INTERPRET=1 when triton was imported): no libdevice there
NATIVE = not isinstance(qdq_forward, InterpretedFunction)
