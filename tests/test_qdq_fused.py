"""The compiled fake quantization (utils/qat/quantize/qdq_fused.py) against the eager reference (qdq._QDQ): the
same output and gradients in every bit, on the CPU (Inductor's C++ kernels: the same graph the GPU compiles to
Triton) and on CUDA (the kernels QAT runs; skipped without a GPU). Ties (x exactly on .5 steps), clipped values
and the bounds, float16 / bfloat16 inputs, per-channel amax (one of them 0), and learned amax (LSQ gradient)."""
from __future__ import annotations

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA GPU (the device QAT runs on)"))]


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


@pytest.mark.slow  # compiling the kernels takes about a minute on 2 CPU cores
@pytest.mark.parametrize("device", DEVICES)
def test_fused_fake_quant_is_the_eager_one_bit_for_bit(yolov9_tree, device):
    from utils.qat.quantize.qdq import _QDQ
    from utils.qat.quantize.qdq_fused import QDQFunction
    g = torch.Generator().manual_seed(0)
    for name, (shape, amax, dtype, learned) in CASES.items():
        for trial in range(2):  # a second draw of the same shapes: no recompilation, same bits
            x = _inputs(shape, amax, dtype, g).to(device)
            grad = torch.randn(shape, generator=g).to(dtype).to(device)
            eager = _run(_QDQ, x, amax.to(device), learned, grad)
            fused = _run(QDQFunction, x, amax.to(device), learned, grad)
            assert fused[0].dtype == dtype, name
            for what, e, f in zip(("output", "input gradient", "amax gradient"), eager, fused):
                assert (e is None) == (f is None) and (e is None or torch.equal(e, f)), f"{name}: {what} differs"
            assert learned == (fused[2] is not None) and (not learned or bool(fused[2].abs().sum() > 0)), name


@pytest.mark.parametrize("device", DEVICES)
def test_fake_quant_picks_triton_on_cuda_and_eager_elsewhere(yolov9_tree, device):
    """The default (qdq.py): the Triton kernels on CUDA, the eager reference elsewhere; either can be forced, and the
    compiled one only runs when asked."""
    from utils.qat.quantize import qdq, qdq_triton
    x, amax = torch.randn(4, 8, device=device), torch.tensor(1.0, device=device)
    triton_here = device == "cuda" and qdq_triton.usable(x, amax)
    assert qdq._function(x, amax) is (qdq.QDQTriton if triton_here else qdq._QDQ)
    with qdq.implementation("eager"):
        assert qdq._function(x, amax) is qdq._QDQ
    with qdq.implementation("fused"):
        assert qdq._function(x, amax) is qdq.QDQFunction
    with pytest.raises(ValueError, match="choose one of auto, eager, fused, triton"):
        with qdq.implementation("cuda-graphs"):
            pass
