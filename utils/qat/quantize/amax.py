"""Activation amax learned during QAT (LSQ-style), with shared-scale groups kept shared.

    learned = LearnedAmax(model, groups)        # groups: QuantInfo.scale_groups (or traced)
    optimizer.add_param_group(...)               # learned.param_groups(lr)
    with learned.as_buffers():                   # evaluate / save between epochs
        ...
    learned.release()                            # amax back to plain buffers, values kept

Calibration picks each activation amax to minimise that tensor's own error; learning it lets the scale
trade resolution against clipping for what the network outputs. Only per-tensor input quantizers learn
(weights keep their per-channel max: the weights themselves are trained). A shared-scale group (the
inputs of a concat, which TensorRT needs on one scale) learns one parameter, registered on every
quantizer of the group, so the group stays on one scale. Each parameter's learning rate is its own
calibrated value times ``lr``: amax values range from below 1 to about 100, and Adam moves a parameter by
about its learning rate per step, so the steps are relative. The gradient is LSQ's
(``utils/qat/quantize/qdq.py``).

While learning, a quantizer's amax is an ``nn.Parameter`` (so DistributedDataParallel averages its
gradient over the ranks and the quantizers stay identical); checkpoints and ONNX export see the buffer
modelopt expects, because ``as_buffers`` / ``release`` put one back with the learned value (the slot itself
is handled by ``utils/qat/quantize/calib.py``).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from utils.qat.quantize.qdq import amax_to_buffer, amax_to_parameter
from utils.qat.quantize.rules import input_quantizers

MIN_AMAX = 1e-4


class LearnedAmax:
    def __init__(self, model: nn.Module, groups: list[list[str]]):
        quantizers = {n: q for n, q in input_quantizers(model).items()
                      if q.amax is not None and q.amax.numel() == 1}
        grouped = {n for g in groups for n in g}
        members = [[n for n in g if n in quantizers] for g in groups] + [[n] for n in quantizers if n not in grouped]
        self.groups: list[tuple[nn.Parameter, list[nn.Module]]] = []
        for names in filter(None, members):
            first = quantizers[names[0]].amax
            start = torch.stack([quantizers[n].amax.detach().float().reshape(()) for n in names]).max()
            param = nn.Parameter(start.reshape(first.shape).to(first.dtype).clone())
            self.groups.append((param, [quantizers[n] for n in names]))
        self.start = [float(p.detach()) for p, _ in self.groups]
        self.attached = False
        self.attach()

    @property
    def parameters(self) -> list[nn.Parameter]:
        return [p for p, _ in self.groups]

    def param_groups(self, lr: float) -> list[dict]:
        """Optimizer groups: one per parameter, learning rate ``lr`` times its calibrated amax."""
        return [{"params": [p], "lr": lr * s, "weight_decay": 0.0} for p, s in zip(self.parameters, self.start)]

    def attach(self) -> None:
        """Register the learned parameters as the quantizers' amax (replacing the buffers)."""
        if self.attached:
            return
        for param, quantizers in self.groups:
            for q in quantizers:
                amax_to_parameter(q, param)
        self.attached = True

    def detach(self) -> None:
        """Put plain buffers back, holding the learned values."""
        if not self.attached:
            return
        for _, quantizers in self.groups:
            for q in quantizers:
                amax_to_buffer(q)
        self.attached = False

    @torch.no_grad()
    def clamp(self) -> None:
        """Keep every amax positive after a step (one multi-tensor operation over the hundreds of parameters)."""
        if self.groups:
            torch._foreach_clamp_min_(self.parameters, MIN_AMAX)

    @contextlib.contextmanager
    def as_buffers(self):
        """Plain buffers inside the block (evaluate, save a checkpoint), parameters again after it."""
        self.detach()
        try:
            yield
        finally:
            self.attach()

    def release(self) -> None:
        """Buffers for good: the model is as calibration left it, with the learned values."""
        self.detach()
        self.groups = []

    def summary(self) -> dict[str, float]:
        """How far amax moved: median and largest relative change over the parameters."""
        if not self.groups:
            return {}
        change = torch.tensor([abs(float(p.detach()) / s - 1) for p, s in zip(self.parameters, self.start)])
        return {"amax_change_median": round(float(change.median()), 5), "amax_change_max": round(float(change.max()), 5)}
