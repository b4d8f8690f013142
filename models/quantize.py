"""The quantization engine: fuse, insert Q/DQ, calibrate, tie shared scales.

Public surface::

    qmodel = prepare(fp_model, method="mse", skip=["22"])      # fused copy with Q/DQ placed
    calibrate(qmodel, batches, info)                          # amax for every enabled quantizer

Fine-tuning (QAT) lives in ``models/quantize_finetune.py``, its objectives in ``models/qat_objectives.py``.

The rules of where Q/DQ go and which scales are shared live in ``models/quantize_rules.py``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.nn as nn

import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.calib import HistogramCalibrator
from modelopt.torch.quantization.nn import TensorQuantizer

from models import quantize_rules as rules
from models.quantize_defaults import CALIB_METHODS, DEFAULT_CALIB_METHOD, DEFAULT_PERCENTILE
from models.quantize_dist import amax_vector, seed_histograms, sync_calibration
from models.quantize_qdq import use_qdq_rounding
from utils.qat import distributed
from utils.qat.errors import QATError
from utils.qat.progress import progress


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


def prepare(model: nn.Module, method: str = DEFAULT_CALIB_METHOD, skip: Sequence[str | int] = ()) -> tuple[nn.Module, QuantInfo]:
    """Return a fused, float32 copy of ``model`` with INT8 quantizers placed (not yet calibrated)."""
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
    return model, QuantInfo(calib_method=method, skip=[str(s) for s in skip], fp_patterns=patterns)


def _enabled_quantizers(model: nn.Module) -> list[TensorQuantizer]:
    return [m for m in model.modules() if isinstance(m, TensorQuantizer) and m.is_enabled]


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], info: QuantInfo, example: torch.Tensor | None = None,
              num_batches: int | None = None) -> QuantInfo:
    """Collect statistics over ``batches`` (images as float tensors on the model's device), set amax on
    every enabled quantizer with ``info.calib_method``, then give each shared-scale group one amax.
    ``example``: the input traced to find the shared-scale groups (default: the first calibration image).

    In a multi-GPU run (process group joined) every rank calls this with its own shard of the images; the
    ranks then agree on amax from the statistics of all of them (``models/quantize_dist.py``) and leave
    with identical quantizers (checked).

    modelopt 0.47's own histogram path calls ``compute_amax()`` without the method and computes each
    histogram amax twice; calibration is driven here instead: one pass, one ``compute_amax`` per quantizer.
    """
    quantizers = _enabled_quantizers(model)
    training = model.training
    model.eval()
    for q in quantizers:
        q.disable_quant()
        q.enable_calib()
    seen = 0
    try:
        if distributed.active():  # every rank starts its histograms on the bins of the global first batch
            batches = seed_histograms(model, quantizers, batches)
        for images in progress(batches, total=num_batches, desc=f"calibrating ({info.calib_method})"):
            model(images)
            if example is None:
                example = images[:1]
            seen += 1
            if num_batches is not None and seen >= num_batches:
                break
        if seen == 0:
            raise QATError("no calibration images were read; check the 'train' entry of the dataset yaml.")
        if distributed.active():  # each rank saw its shard: agree on amax from the statistics of all
            sync_calibration(quantizers, info.calib_method, info.percentile, images.device)
        else:
            for q in progress(quantizers, desc="computing amax", leave=False):
                if isinstance(q._calibrator, HistogramCalibrator):
                    q.amax = histogram_amax(q._calibrator, info.calib_method, info.percentile).to(images.device)
                else:
                    q.load_calib_amax()
    finally:
        for q in quantizers:
            q.disable_calib()
            q.enable_quant()
        model.train(training)
    info.scale_groups = rules.scale_groups(model, example)
    rules.tie_scales(model, info.scale_groups)
    if distributed.active():
        distributed.check_identical(amax_vector(model), "quantizer amax values after calibration")
    return info


def histogram_amax(calibrator: HistogramCalibrator, method: str, percentile: float) -> torch.Tensor:
    """amax from a collected histogram. MSE is searched here: modelopt 0.47's ``_compute_amax_mse``
    calls ``fake_tensor_quant`` with its pre-``bias`` signature and returns the first candidate."""
    if calibrator._calib_hist is None:
        raise RuntimeError("a quantizer saw no data during calibration")
    if method == "mse":
        return mse_amax(calibrator._calib_hist, calibrator._calib_bin_edges, calibrator._num_bits,
                        calibrator._unsigned)
    kwargs = {"percentile": percentile} if method == "percentile" else {}
    return torch.as_tensor(calibrator.compute_amax(method, **kwargs), dtype=torch.float32)


def mse_amax(hist, edges, num_bits: int = 8, unsigned: bool = False, start_bin: int = 128) -> torch.Tensor:
    """The clipping value (a bin centre from ``start_bin`` on) minimising the histogram-weighted
    squared error of symmetric fake quantization of |x|."""
    counts = torch.as_tensor(hist).detach().cpu().double().flatten()
    edges = torch.as_tensor(edges).detach().cpu().double().flatten()
    if len(edges) != len(counts) + 1:
        # modelopt grows its histogram with torch.arange(0, max + width, width), which can yield one edge more
        # than histc's bins; histc itself split [0, edges[-1]] into len(counts) equal bins
        edges = torch.linspace(0.0, float(edges[-1]), len(counts) + 1, dtype=torch.float64)
    centers = (edges[1:] + edges[:-1]) / 2
    candidates = centers[min(start_bin, len(centers) - 1):]
    levels = 2 ** num_bits - 1 if unsigned else 2 ** (num_bits - 1) - 1
    best, best_err = candidates[-1], float("inf")
    for chunk in candidates.split(256):  # bounded memory: 256 x bins at a time
        scale = chunk[:, None] / levels
        quant = torch.clamp(torch.round(centers[None] / scale), max=levels) * scale
        err = ((quant - centers[None]) ** 2 * counts[None]).sum(1)
        i = int(err.argmin())
        if float(err[i]) < best_err:
            best, best_err = chunk[i], float(err[i])
    return best.float()
