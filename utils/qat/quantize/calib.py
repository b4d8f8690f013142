"""Calibration: statistics over images, then one amax per quantizer. The only module that reads modelopt's
internals: the calibrators' histograms, and where a quantizer keeps its amax (``learned_amax``,
``amax_to_parameter``, ``amax_to_buffer``: a buffer, or a parameter while ``--amax-lr`` learns it).

    groups, search = calibrate(qmodel, batches, config, num_batches=25)   # qmodel from model_quant.prepare

- Max calibrators (weights always; inputs with ``method="max"``): amax is the max |x| seen.
- Histogram calibrators (percentile, mse, entropy): amax from the histogram of |x| (``histogram_amax``;
  the MSE search is this module's own, ``mse_amax``).
- ``mse-image``: the same MSE search over histograms in which every image weighs alike
  (``utils/qat/quantize/image_hist.py``), collected by this module's hooks instead of modelopt's calibrators.
- Then the quantizers that must share one scale (``utils/qat/quantize/rules.scale_groups``) get their
  group's largest amax; the groups are returned (``QuantInfo.scale_groups``).

In a multi-GPU run rank 0 calibrates alone, on the global batches (what one process reads), and sends
its amax and groups to the other ranks: every rank ends with one process's quantizers exactly
(docs/DEVELOPING.md, "Multi-GPU", says why this replaced merging the ranks' histograms).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from modelopt.torch.quantization.calib import HistogramCalibrator
from modelopt.torch.quantization.nn import TensorQuantizer
from torch import nn

from utils.qat.quantize import rules
from utils.qat.quantize.config import QuantConfig
from utils.qat.quantize.head import SEARCH_BATCHES, search_head_amax
from utils.qat.quantize.image_hist import ImageHistograms
from utils.qat.quantize.state import amax_state, amax_vector, collecting, enabled_quantizers, load_amax, quantizers_off
from utils.qat import distributed
from utils.qat.errors import QATError
from utils.qat.progress import progress


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], config: QuantConfig,
              example: torch.Tensor | None = None,
              num_batches: int | None = None) -> tuple[list[list[str]], dict]:
    """Collect statistics over ``batches`` (images as float tensors on the model's device), set amax on
    every enabled quantizer with ``config.method``, then give each shared-scale group one amax and, with
    ``config.head_amax == "search"``, search the head's input scales. Returns ``(groups, head_search)``:
    the groups, and the search's summary (``{}`` without one; else ``factors``, ``loss_before``,
    ``loss_after``, ``batches``: ``QuantInfo.head_search``). ``example``:
    the input traced to find the groups (default: the first calibration image).

    In a multi-GPU run (process group joined) every rank calls this; rank 0 alone reads ``batches`` (the
    others' are not read) and the others receive its amax and groups (checked identical afterwards).
    """
    if not distributed.active():
        return _calibrate(model, batches, config, example, num_batches)
    main = distributed.is_main()
    groups, search = _calibrate(model, batches, config, example, num_batches) if main else ([], {})
    groups, search, amax = distributed.broadcast_object((groups, search, amax_state(model) if main else {}))
    if not main:
        load_amax(model, amax)
    distributed.check_identical(amax_vector(model), "quantizer amax values after calibration")
    return groups, search


def _calibrate(model: nn.Module, batches: Iterable[torch.Tensor], config: QuantConfig,
               example: torch.Tensor | None, num_batches: int | None) -> tuple[list[list[str]], dict]:
    """One process: statistics, amax per quantizer, shared scales tied.

    modelopt 0.47's own histogram path calls ``compute_amax()`` without the method and computes each
    histogram amax twice; calibration is driven here instead: one pass, one ``compute_amax`` per quantizer.
    """
    quantizers = enabled_quantizers(model)
    # mse-image: the activation quantizers pass their inputs through to this module's hooks
    own = [q for q in quantizers if isinstance(q._calibrator, HistogramCalibrator)] if config.method == "mse-image" else []
    hists, own_ids = ImageHistograms(own), {id(q) for q in own}
    training = model.training
    model.eval()
    seen = 0
    kept: list[torch.Tensor] = []  # the first batches again, for the head amax search
    try:
        with collecting([q for q in quantizers if id(q) not in own_ids]), quantizers_off(own):
            for images in progress(batches, total=num_batches, desc=f"calibrating ({config.method})"):
                model(images)
                if example is None:
                    example = images[:1]
                if config.head_amax == "search" and len(kept) < SEARCH_BATCHES:
                    kept.append(images)
                seen += 1
                if num_batches is not None and seen >= num_batches:
                    break
            if example is None or seen == 0:
                raise QATError("no calibration images were read; check the 'train' entry of the dataset yaml.")
            for q in progress(quantizers, desc="computing amax", leave=False):
                if id(q) in own_ids:
                    q.amax = hists.amax(q).to(example.device)
                elif isinstance(q._calibrator, HistogramCalibrator):
                    q.amax = histogram_amax(q._calibrator, config.method, config.percentile).to(example.device)
                else:
                    q.load_calib_amax()
    finally:
        hists.close()
        model.train(training)
    groups = rules.scale_groups(model, example)
    rules.tie_scales(model, groups)
    search = search_head_amax(model, kept, groups) if config.head_amax == "search" else {}
    return groups, search


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


def mse_amax(hist: torch.Tensor, edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
             start_bin: int = 128) -> torch.Tensor:
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


# ---- where a quantizer keeps its amax --------------------------------------------------------------

def learned_amax(quantizer: TensorQuantizer) -> nn.Parameter | None:
    """The quantizer's amax parameter while QAT learns it, else None."""
    return quantizer._parameters.get("_amax")


def amax_to_parameter(quantizer: TensorQuantizer, param: nn.Parameter) -> None:
    """Make ``param`` the quantizer's amax (replacing its buffer): what the forward pass reads and differentiates."""
    del quantizer._buffers["_amax"]
    quantizer._parameters["_amax"] = param


def amax_to_buffer(quantizer: TensorQuantizer) -> None:
    """Put a plain buffer back in the amax slot, holding the parameter's current value."""
    param = quantizer._parameters.pop("_amax")
    quantizer._buffers["_amax"] = param.detach().clone()
