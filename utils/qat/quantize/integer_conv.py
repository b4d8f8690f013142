"""A quantized model evaluated the way INT8 runtimes compute it: each quantized convolution sums integer codes.

A fake-quantized convolution, ``conv(q_x * s_x, q_w * s_w)``, adds float32 products, and the order of those additions
depends on the kernel, the device and the number of threads. Each last-bit difference that lands near a rounding
boundary of the next quantizer flips a code there, and the network carries the flips to its output: one checkpoint of
the embedded model scored 0.7661 on a CPU with two threads and 0.7685 with one (docs/RESULTS.md "One model, one
score"). TensorRT, ONNX Runtime's and OpenVINO's integer kernels sum the integer codes instead, exactly, and scale the
sum once. :func:`integer_form` gives a copy of a model whose quantized convolutions do the same:

    acc = conv(q_x, q_w)                   (exact: every product and partial sum an integer)
    y   = acc * (s_x * s_w[c]) + bias[c]

with ``q_x``, ``q_w`` the codes the model's own quantizers produce (``utils.qat.quantize.qdq``). On a CPU the sum runs
in float32, exact where no partial sum can reach 2**24 (checked per convolution from its weight codes: one that could
sums in float64); on a GPU it runs in float64 and is rounded to the integer, exact whatever algorithm cuDNN picks
(Winograd and FFT transforms are not exact in float32). So a model's score no longer depends on the thread count or
the kernel, only on its codes, its scales and the elementwise operations between them.

Two of those round by the library, and a last bit near a rounding boundary of the next quantizer flips a code there
just as a summation order does. An average pool of four dequantized values sums float products in its kernel's
order; over a quantized input it now averages the codes (exact) and scales once (``rules.quantized_avg_pool``). The
SiLU's sigmoid each library rounds its own way (CUDA's, PyTorch's vectorised CPU and ONNX Runtime's exp and sigmoid
differ in the last bit for a share of inputs). :class:`ExactSiLU` computes the sigmoid in
float64, ``1 / (1 + exp(-x))``, and rounds it once to float32: ``x * float32(sigmoid64(x))``, which every library
computes alike but where the exact sigmoid lies within a few float64 steps of a float32 rounding boundary.
``utils/qat/onnx/integer_graph.py`` gives ONNX Runtime the same convolutions, pools and SiLU, so a graph scores as
its checkpoint does.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from utils.qat.quantize.qdq import qdq_scale

EXACT_FLOAT32 = 2 ** 24  # integers below this are exact in float32, and so is every sum of them that stays below it
CODE_MAX = 128  # the largest |code| of a signed 8-bit quantizer


class IntegerConv2d(nn.Module):
    """A quantized ``Conv2d`` (modelopt's ``QuantConv2d``: input per tensor, weights per output channel) computed from
    integer codes. Keeps the convolution's input quantizer (its amax may be learned) and its weights' codes and scales
    as they were when it was made."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.input_quantizer = conv.input_quantizer
        with torch.no_grad():
            fake = conv.weight_quantizer(conv.weight).float()
            scale = qdq_scale(conv.weight_quantizer.amax).reshape(-1, 1, 1, 1)
            codes = torch.round(fake / scale)
        self.register_buffer("weight_codes", codes)
        self.register_buffer("weight_scale", scale.reshape(1, -1, 1, 1))
        self.register_buffer("bias", None if conv.bias is None else conv.bias.detach().float().reshape(1, -1, 1, 1))
        self.stride, self.padding, self.dilation, self.groups = conv.stride, conv.padding, conv.dilation, conv.groups
        largest = codes.abs().flatten(1).sum(1).max().item() * CODE_MAX  # bounds |every partial sum| of any output
        self.float32_exact = largest < EXACT_FLOAT32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input_quantizer(x).float()
        scale = qdq_scale(self.input_quantizer.amax)
        codes = torch.round(x / scale)
        wide = x.device.type != "cpu" or not self.float32_exact
        dtype = torch.float64 if wide else torch.float32
        acc = F.conv2d(codes.to(dtype), self.weight_codes.to(dtype), None, self.stride, self.padding, self.dilation,
                       self.groups)
        if wide:
            acc = torch.round(acc).float()
        y = acc * (scale * self.weight_scale)
        return y if self.bias is None else y + self.bias


class UlpJitter:
    """Seeded draws that move a random half of a SiLU's sigmoids one float32 step up or down: a runtime whose sigmoid
    rounds its own way, for measuring how far that alone moves a score (``benchmarks/ckpt_vs_graph.py
    --silu-ulp-draws``). One generator per device, shared by every SiLU of a model, in the order they run."""

    def __init__(self, seed: int):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, s: torch.Tensor) -> torch.Tensor:
        if s.device not in self._generators:
            self._generators[s.device] = torch.Generator(device=s.device).manual_seed(self.seed)
        r = torch.rand(s.shape, generator=self._generators[s.device], device=s.device)
        down, up = torch.nextafter(s, torch.zeros_like(s)), torch.nextafter(s, torch.full_like(s, 2.0))
        return torch.where(r < 0.25, down, torch.where(r < 0.5, up, s))


class ExactSiLU(nn.Module):
    """``x * sigmoid(x)`` with the sigmoid computed in float64 and rounded once to float32: the same bits on a CPU, a
    GPU and ONNX Runtime (``integer_graph``), where each float32 sigmoid rounds its own way. ``jitter`` (for
    measurement only): a :class:`UlpJitter` applied to the rounded sigmoid."""

    def __init__(self, jitter: UlpJitter | None = None):
        super().__init__()
        self.jitter = jitter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = (1 / (1 + torch.exp(-x.double()))).to(x.dtype)
        return x * (s if self.jitter is None else self.jitter(s))


def convertible(module: nn.Module) -> bool:
    """A quantized Conv2d whose input is quantized per tensor and whose weights per output channel."""
    inp, weight = getattr(module, "input_quantizer", None), getattr(module, "weight_quantizer", None)
    if not isinstance(module, nn.Conv2d) or inp is None or weight is None:
        return False
    if not (inp.is_enabled and weight.is_enabled) or inp.amax is None or weight.amax is None:
        return False
    output = getattr(module, "output_quantizer", None)
    return (inp.amax.numel() == 1 and weight.amax.numel() == module.out_channels
            and not (output is not None and output.is_enabled) and module.padding_mode == "zeros")


@torch.no_grad()
def integer_form(model: nn.Module, silu_ulp_seed: int | None = None) -> nn.Module:
    """A copy of ``model`` (for evaluation: no gradient flows through it) whose quantized convolutions sum integer
    codes (:class:`IntegerConv2d`), whose SiLUs round once (:class:`ExactSiLU`) and whose average pools average codes
    (``rules.quantized_avg_pool``); every other module as it was.
    The model itself is not changed. ``silu_ulp_seed``: measurement only, every SiLU one step off on a random half
    of its outputs (:class:`UlpJitter`, seeded)."""
    jitter = None if silu_ulp_seed is None else UlpJitter(silu_ulp_seed)
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules(remove_duplicate=False)):  # YOLOv9's Conv share one SiLU module
        if hasattr(module, "avgpool_input_quantizer"):  # ADown, AConv: the pool averages codes (rules.py)
            module.integer_pool = True
        if convertible(module) or type(module) is nn.SiLU:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, IntegerConv2d(module) if isinstance(module, nn.Conv2d) else ExactSiLU(jitter))
    return model.eval()
