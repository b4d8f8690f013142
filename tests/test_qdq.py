"""The eager fake quantization's gradient-free path (qdq.qdq_values, what ``fake_quant`` runs under no_grad on the
CPU): the same output as the autograd reference qdq._QDQ in every bit, on ties, clipped values, float16 / bfloat16,
per-channel amax with a 0 and a non-contiguous input; and a quantized model's forward under no_grad takes it."""
from __future__ import annotations

import pytest
import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


CASES = {  # name: (input shape, amax, dtype)
    "per-tensor": ((2, 8, 16, 16), torch.tensor(3.7), torch.float32),
    "float16": ((2, 8, 16, 16), torch.tensor(3.7), torch.float16),
    "bfloat16": ((2, 8, 16, 16), torch.tensor(0.37), torch.bfloat16),
    "per-channel": ((8, 4, 3, 3), torch.cat([torch.zeros(1), torch.rand(7) * 2 + 0.1]).view(8, 1, 1, 1),
                    torch.float32),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("transposed", [False, True])
def test_gradient_free_path_is_the_reference_bit_for_bit(yolov9_tree, name, transposed):
    from utils.qat.quantize.qdq import _QDQ, qdq_scale, qdq_values
    shape, amax, dtype = CASES[name]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * float(amax.max()) * 0.7
    ties = torch.rand(shape, generator=g) < 0.3  # exactly on .5 steps, some beyond the clip range
    x = torch.where(ties, (torch.randint(-140, 140, shape, generator=g) + 0.5) * qdq_scale(amax), x)
    x.view(-1)[:2] = torch.tensor([100.0, -100.0])
    x = x.to(dtype)
    if transposed:
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    for qmin, qmax in ((-128, 127), (-127, 127), (0, 255)):
        reference = _QDQ.apply(x.clone().requires_grad_(True), amax, qmin, qmax).detach()
        fast = qdq_values(x, amax, qmin, qmax)
        assert fast.dtype == dtype and fast.shape == x.shape
        assert torch.equal(_bits(fast), _bits(reference)), f"{name} [{qmin}, {qmax}]"


def test_no_grad_forward_takes_the_gradient_free_path(yolov9_tree, monkeypatch):
    """Under no_grad a quantizer calls qdq_values (no autograd node, no mask); with a gradient wanted, _QDQ."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    from utils.qat.quantize import qdq
    quantizer = TensorQuantizer()
    quantizer.amax = torch.tensor(2.0)
    qdq.use_qdq_rounding(torch.nn.Sequential(quantizer))
    calls = []
    monkeypatch.setattr(qdq, "qdq_values", lambda *a: calls.append(a) or qdq._QDQ.apply(*a))
    x = torch.randn(2, 4, 8, 8)
    with torch.no_grad():
        quantizer(x)
    assert len(calls) == 1
    y = quantizer(x.requires_grad_(True))
    assert len(calls) == 1 and y.grad_fn is not None
