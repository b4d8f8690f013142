"""The Triton fake quantization (utils/qat/quantize/qdq_triton.py) against the eager reference (qdq._QDQ): the
same output and gradients in every bit. On CUDA the kernels QAT runs (skipped without a GPU); on the CPU the
same kernels under Triton's interpreter (numpy, in a subprocess: the interpreter is chosen when triton is
imported), which checks indexing, masks, casts and the residual but rounds half to even with floor and
compares instead of libdevice's rint. Cases: ties (x exactly on .5 steps), clipped values and the bounds,
float16 / bfloat16, per-channel amax with a 0, learned amax per tensor and per channel, a non-contiguous input and
more than one block of elements."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TRITON = pytest.importorskip("triton", reason="triton is not installed (the triton implementation needs it)")


def _inputs(shape, amax: torch.Tensor, dtype, g: torch.Generator) -> torch.Tensor:
    from utils.qat.quantize.qdq import qdq_scale
    x = torch.randn(shape, generator=g) * float(amax.max()) * 0.7
    steps = torch.randint(-140, 140, shape, generator=g) + 0.5  # ties, some beyond the clip range
    ties = torch.rand(shape, generator=g) < 0.3
    x = torch.where(ties, steps * qdq_scale(amax), x)
    flat = x.view(-1)
    flat[:4] = torch.tensor([100.0, -100.0, float(amax.flatten()[0]), -float(amax.flatten()[0])])  # clipped, bounds
    return x.to(dtype)


CASES = {  # name: (input shape, amax, input dtype, amax learned)
    "per-tensor": ((2, 8, 16, 16), torch.tensor(3.7), torch.float32, False),
    "float16": ((2, 8, 16, 16), torch.tensor(3.7), torch.float16, False),
    "bfloat16": ((2, 8, 16, 16), torch.tensor(0.37), torch.bfloat16, False),
    "per-channel": ((8, 4, 3, 3), torch.cat([torch.zeros(1), torch.rand(7) * 2 + 0.1]).view(8, 1, 1, 1),
                    torch.float32, False),
    "learned": ((2, 8, 16, 16), torch.tensor(3.7), torch.float32, True),
    "learned-float16": ((2, 8, 16, 16), torch.tensor(1.3), torch.float16, True),
    "learned-per-channel": ((8, 4, 3, 3), torch.rand(8).view(8, 1, 1, 1) + 0.2, torch.float32, True),
}


def _run(fn, x: torch.Tensor, amax: torch.Tensor, learned: bool, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    amax = amax.clone().requires_grad_(learned)
    y = fn.apply(x, amax, -128, 127)
    y.backward(grad)
    return y.detach(), x.grad, amax.grad


MORE_CASES = {  # name: (input shape, amax, input dtype, amax learned)
    "large": ((3, 40, 33, 31), torch.tensor(2.1), torch.float32, False),  # 122,760 elements: many blocks, a tail
    "learned-bfloat16-per-channel": ((6, 5, 7, 3), torch.rand(6).view(6, 1, 1, 1) + 0.2, torch.bfloat16, True),
    "per-channel-1d": ((5, 33), torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0]).view(5, 1), torch.float16, False),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def compare(device: str) -> int:
    """Every case through both functions on ``device``; returns how many were compared."""
    from utils.qat.quantize.qdq import _QDQ
    from utils.qat.quantize.qdq_triton import QDQTriton, usable
    g = torch.Generator().manual_seed(0)
    count = 0
    for name, (shape, amax, dtype, learned) in {**CASES, **MORE_CASES}.items():
        for layout in ("contiguous", "transposed"):
            x = _inputs(shape, amax, dtype, g).to(device)
            if layout == "transposed":  # same values and shape, other strides: made contiguous for the kernel
                x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
            grad = torch.randn(shape, generator=g).to(dtype).to(device)
            assert usable(x, amax.to(device)), name
            eager = _run(_QDQ, x, amax.to(device), learned, grad)
            fast = _run(QDQTriton, x, amax.to(device), learned, grad)
            assert fast[0].dtype == dtype, name
            for what, e, f in zip(("output", "input gradient", "amax gradient"), eager, fast):
                assert (e is None) == (f is None), f"{name} {layout}: {what}"
                if e is not None:  # same bits (-0.0 included), not only equal values
                    assert e.dtype == f.dtype and e.shape == f.shape, f"{name} {layout}: {what} dtype/shape"
                    assert torch.equal(_bits(e), _bits(f)), f"{name} {layout}: {what} differs"
            assert learned == (fast[2] is not None) and (not learned or bool(fast[2].abs().sum() > 0)), name
            count += 1
    return count


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernels QAT runs)")
def test_triton_fake_quant_is_the_eager_one_bit_for_bit_on_cuda(yolov9_tree):
    assert compare("cuda") == 2 * (len(CASES) + len(MORE_CASES))


@pytest.mark.slow  # the interpreter runs each block in numpy: about a minute on 2 CPU cores
def test_triton_kernels_in_the_interpreter_are_the_eager_one_bit_for_bit(yolov9_tree):
    here = os.path.dirname(__file__)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(yolov9_tree), here])}
    code = ("from utils.qat.core import compat; compat.apply(); from utils.qat.quantize import qdq_triton_kernels as k; "
            "assert not k.NATIVE; import test_qdq_triton as t; print('compared', t.compare('cpu'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=yolov9_tree, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"compared {2 * (len(CASES) + len(MORE_CASES))}" in r.stdout


def test_triton_falls_back_to_eager_without_cuda(yolov9_tree):
    from utils.qat.quantize import qdq
    from utils.qat.quantize.qdq_triton import QDQTriton
    x, amax = torch.randn(2, 3, 4, 4), torch.tensor(1.0)
    with qdq.implementation("triton"):
        assert qdq._function(x, amax) is qdq._QDQ  # the CPU: the reference
        if torch.cuda.is_available():
            assert qdq._function(x.cuda(), amax.cuda()) is QDQTriton
            assert qdq._function(x.cuda(), torch.rand(4, 1, 1, 1).cuda()) is qdq._QDQ  # amax on another axis
    assert qdq._function(x, amax) is qdq._QDQ


def test_kernels_compile_to_ieee_division_and_rint_for_the_h100():
    """What the GPU runs, checked without a GPU: the forward compiled for sm_90 divides with div.rn (IEEE, not
    Triton's approximate ``/``), rounds with cvt.rni (half to even) and casts with cvt.rn, and no multiply-add
    (one rounding where eager rounds twice) appears in either kernel."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from utils.qat.quantize import qdq_triton_kernels as k
    consts = {"QMIN": -128, "QMAX": 127, "PER_CHANNEL": True, "RESIDUAL": True, "NATIVE": True, "BLOCK": k.BLOCK}
    types = {"x_ptr": "*bf16", "amax_ptr": "*fp32", "y_ptr": "*bf16", "inside_ptr": "*i1", "residual_ptr": "*fp16",
             "n": "i32", "inner": "i32", **dict.fromkeys(consts, "constexpr")}
    ptx = triton_ptx(ASTSource(fn=k.qdq_forward, signature=types, constexprs=consts), GPUTarget("cuda", 90, 32))
    assert {"div.rn.f32", "cvt.rni.f32.f32", "cvt.rn.bf16.f32", "cvt.rn.f16.f32"} <= set(re.findall(r"\b[a-z]+\.[\w.]+", ptx))
    consts = {"RESIDUAL": True, "NATIVE": True, "BLOCK": k.BLOCK}
    types = {"grad_ptr": "*fp32", "inside_ptr": "*i1", "residual_ptr": "*fp16", "grad_x_ptr": "*fp32",
             "local_ptr": "*fp32", "n": "i32", **dict.fromkeys(consts, "constexpr")}
    ptx += triton_ptx(ASTSource(fn=k.qdq_backward, signature=types, constexprs=consts), GPUTarget("cuda", 90, 32))
    assert "div.rn.f32" in ptx and "div.approx" not in ptx and not re.search(r"\bfma\.|\bmad\.[a-z]*\.?f", ptx)


def triton_ptx(source, target) -> str:
    import triton
    return triton.compile(source, target=target, options={"num_warps": 4}).asm["ptx"]


def test_fake_quant_picks_triton_on_cuda_and_eager_elsewhere(yolov9_tree):
    """The default (qdq.py): the Triton kernels on CUDA, the eager reference elsewhere; either can be forced."""
    from utils.qat.quantize import qdq
    x, amax = torch.randn(4, 8), torch.tensor(1.0)
    assert qdq._function(x, amax) is qdq._QDQ
    if torch.cuda.is_available():
        assert qdq._function(x.cuda(), amax.cuda()) is qdq.QDQTriton
        with qdq.implementation("eager"):
            assert qdq._function(x.cuda(), amax.cuda()) is qdq._QDQ
    with pytest.raises(ValueError, match="choose one of auto, eager, triton"):
        with qdq.implementation("fused"):
            pass
