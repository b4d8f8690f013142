"""The quantization engine: fuse, insert Q/DQ, calibrate, tie shared scales.

Public surface::

    config = QuantConfig(method="mse", skip=("22",))
    qmodel, info = quantize(fp_model, batches, config)   # prepare, then calibrate: a calibrated fused copy

    qmodel, info = prepare(fp_model, config)            # the two steps: a fused copy with Q/DQ placed,
    groups, search = calibrate(qmodel, batches, config) # then amax for every enabled quantizer

``QuantConfig`` and ``QuantInfo`` (the settings, and the record a checkpoint carries) live in
``utils/qat/quantize/config.py``, importable without modelopt. Where each part lives: placement and shared
scales ``utils/qat/quantize/rules.py``, calibration ``utils/qat/quantize/calib.py``, quantizer state
``utils/qat/quantize/state.py``, the rounding ``utils/qat/quantize/qdq.py``, fine-tuning
``utils/qat/quantize/finetune.py`` with its objectives in ``utils/qat/quantize/objectives.py`` and learned scales in
``utils/qat/quantize/amax.py``.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable

import torch
import torch.nn as nn

from utils.qat.quantize.modelopt_import import mtq  # modelopt without its unused plugins: first
from modelopt.torch.quantization.nn import TensorQuantizer

from utils.qat.quantize import rules
from utils.qat.quantize.calib import calibrate
from utils.qat.quantize.config import QuantConfig, QuantInfo
from utils.qat.quantize.head import check_layers
from utils.qat.quantize.qdq import use_qdq_rounding
from utils.qat.core.errors import QATError

__all__ = ["QuantConfig", "QuantInfo", "calibrate", "fuse", "fused_copy", "is_quantized", "prepare", "quantize"]


def fuse(model: nn.Module) -> nn.Module:
    """Fold BatchNorm into convs and RepConvN branches into one conv, keeping every parameter trainable.

    Upstream's ``fuse()`` runs with autograd on and marks the fused RepConvN conv frozen; QAT needs
    leaf tensors that all receive gradients, so fusion runs under ``no_grad`` and grads are re-enabled.
    """
    from models.common import DFL, Conv, RepConvN
    from utils.torch_utils import fuse_conv_and_bn
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, RepConvN) and hasattr(m, "conv1"):
                m.fuse_convs()
                m.forward = m.forward_fuse
            if isinstance(m, Conv) and hasattr(m, "bn"):
                m.conv = fuse_conv_and_bn(m.conv, m.bn)
                delattr(m, "bn")
                m.forward = m.forward_fuse
    frozen = {id(p) for m in model.modules() if isinstance(m, DFL) for p in m.parameters()}  # fixed decode weights
    for p in model.parameters():
        p.requires_grad_(id(p) not in frozen)
    return model


def fused_copy(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A fused float32 copy of ``model``, folded on ``device`` (where it will run; None: where ``model`` is).

    BatchNorm folded on a GPU differs from the CPU's fold in the last bit of some weights, and calibration can
    turn that into a different scale (GELAN-C on an H100: 345 of 628 tensors differed, one activation amax by 14%,
    PTQ 0.7311 against 0.7333), so the fold must not depend on where the FP model happens to be: evaluating it
    first (``qat.py``'s Origin row) moves it to the GPU, ``--no-eval-origin`` left it on the CPU."""
    model = copy.deepcopy(model).float()
    if device is not None:
        model.to(device)
    return fuse(model)


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, TensorQuantizer) for m in model.modules())


def prepare(model: nn.Module, config: QuantConfig = QuantConfig(),
            device: torch.device | str | None = None) -> tuple[nn.Module, QuantInfo]:
    """Return a fused, float32 copy of ``model`` (``fused_copy``: folded on ``device``) with INT8 quantizers placed
    (not yet calibrated), and the record of how it is made (no shared-scale groups yet: ``calibrate`` finds them)."""
    if is_quantized(model):
        raise QATError("this model is already quantized; start from the floating-point checkpoint.")
    check_layers(model, config.search_layers)
    model = fused_copy(model, device)
    patterns = rules.fp_patterns(model, config.skip)
    settings = rules.int8_config(patterns)
    if config.method != "max":
        for entry in settings["quant_cfg"]:
            if entry["quantizer_name"] == "*input_quantizer":
                entry["cfg"]["calibrator"] = "histogram"
    rules.register_yolov9_modules()
    model = use_qdq_rounding(mtq.quantize(model, settings, forward_loop=None)).eval()
    return model, QuantInfo(config, fp_patterns=patterns)


def quantize(model: nn.Module, batches: Iterable[torch.Tensor], config: QuantConfig = QuantConfig(), *,
             device: torch.device | str | None = None, example: torch.Tensor | None = None,
             num_batches: int | None = None) -> tuple[nn.Module, QuantInfo]:
    """A calibrated, fused copy of ``model`` (on ``device`` when given) and its record: ``prepare``, then
    ``calibrate`` over ``batches`` (see there for ``example``, ``num_batches`` and multi-GPU runs)."""
    qmodel, info = prepare(model, config, device)
    if device is not None:
        qmodel.to(device)
    groups, search = calibrate(qmodel, batches, config, example=example, num_batches=num_batches)
    return qmodel, dataclasses.replace(info, scale_groups=groups, head_search=search)
