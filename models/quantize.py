"""The quantization engine: fuse, insert Q/DQ, calibrate, tie shared scales.

Public surface::

    qmodel, info = prepare(fp_model, method="mse", skip=["22"])   # fused copy with Q/DQ placed
    calibrate(qmodel, batches, info)                             # amax for every enabled quantizer

Where each part lives: placement and shared scales ``models/quantize_rules.py``, calibration
``models/quantize_calib.py`` (re-exported here), quantizer state ``models/quantize_state.py``, the
rounding ``models/quantize_qdq.py``, fine-tuning ``models/quantize_finetune.py`` with its objectives in
``models/qat_objectives.py`` and learned scales in ``models/quantize_amax.py``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.nn import TensorQuantizer

from models import quantize_rules as rules
from models.quantize_calib import calibrate
from models.quantize_defaults import CALIB_METHODS, DEFAULT_CALIB_METHOD, DEFAULT_PERCENTILE
from models.quantize_qdq import use_qdq_rounding
from utils.qat.errors import QATError

__all__ = ["QuantInfo", "calibrate", "fuse", "is_quantized", "prepare"]


@dataclass
class QuantInfo:
    """What a quantized model was made with; travels in its checkpoint."""
    calib_method: str = DEFAULT_CALIB_METHOD
    percentile: float = DEFAULT_PERCENTILE
    skip: list[str] = field(default_factory=list)  # user's --skip-layers items
    fp_patterns: list[str] = field(default_factory=list)  # module-name patterns kept in FP
    scale_groups: list[list[str]] = field(default_factory=list)


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


def is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, TensorQuantizer) for m in model.modules())


def prepare(model: nn.Module, method: str = DEFAULT_CALIB_METHOD, skip: Sequence[str | int] = (),
            percentile: float = DEFAULT_PERCENTILE) -> tuple[nn.Module, QuantInfo]:
    """Return a fused, float32 copy of ``model`` with INT8 quantizers placed (not yet calibrated), and
    the record of how it is made (``percentile``: for ``method="percentile"``)."""
    if method not in CALIB_METHODS:
        raise QATError(f"unknown calibration method '{method}'; choose one of {', '.join(CALIB_METHODS)}.")
    if is_quantized(model):
        raise QATError("this model is already quantized; start from the floating-point checkpoint.")
    model = fuse(copy.deepcopy(model).float())
    patterns = rules.fp_patterns(model, skip)
    config = rules.int8_config(patterns)
    if method != "max":
        for entry in config["quant_cfg"]:
            if entry["quantizer_name"] == "*input_quantizer":
                entry["cfg"]["calibrator"] = "histogram"
    rules.register_yolov9_modules()
    model = use_qdq_rounding(mtq.quantize(model, config, forward_loop=None)).eval()
    return model, QuantInfo(calib_method=method, percentile=percentile, skip=[str(s) for s in skip],
                            fp_patterns=patterns)
