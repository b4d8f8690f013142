"""Histograms of |activation| in which every calibration image weighs the same (``--calib-method mse-image``).

    hists = ImageHistograms(activation_quantizers)   # forward pre-hooks: run the calibration batches with the
    ...                                              # quantizers passing their inputs through
    q.amax = hists.amax(q)                           # the MSE-best clipping value of that weighted histogram
    hists.close()

A pooled histogram (modelopt's, behind ``mse``) counts every value once. An image whose activations run 100x
above the rest then holds most of the squared error, and the MSE search hands it the scale at the expense of
every other image's resolution (docs/QAT_FINETUNING.md "GELAN-C run to run, and what limits GELAN-QS-seg": GELAN-QS-seg). Here each image's values are weighted
by the inverse of that image's energy at the quantizer (the sum of x^2), so the search minimises the sum over
images of each image's relative quantization error. Bins are logarithmic, ``PER_DECADE`` per decade from 1e-6
to 1e6: the same relative resolution at every scale, finer than an INT8 step below the clipping value.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import utils.qat.quantize.modelopt_import  # noqa: F401  (modelopt without its unused plugins: first)
from modelopt.torch.quantization.nn import TensorQuantizer

from utils.qat.quantize.mse import mse_amax

LOW, HIGH, PER_DECADE = -6, 6, 512
BINS = (HIGH - LOW) * PER_DECADE


def bin_edges() -> torch.Tensor:
    """The ``BINS + 1`` edges; the first bin also holds everything below 1e-6 (zeros included)."""
    edges = 10.0 ** (torch.arange(BINS + 1, dtype=torch.float64) / PER_DECADE + LOW)
    edges[0] = 0.0
    return edges


def image_weighted_histogram(x: torch.Tensor) -> torch.Tensor:
    """Counts of |x| per bin, each value weighted by 1 / (its image's sum of x^2); images along dim 0, taken one at
    a time (the bin indices of a whole 640 px batch would take gigabytes)."""
    hist = torch.zeros(BINS, dtype=torch.float64, device=x.device)
    for image in x.detach().reshape(x.shape[0], -1):
        image = image.float().abs()
        index = ((image.clamp(min=1e-30).log10() - LOW) * PER_DECADE).floor().clamp(0, BINS - 1).long()
        hist += torch.bincount(index, minlength=BINS).double() / image.pow(2).sum().clamp(min=1e-12).double()
    return hist


class ImageHistograms:
    """Per-image weighted histograms of each quantizer's input, collected by forward pre-hooks."""

    def __init__(self, quantizers: Iterable[TensorQuantizer]):
        self.hists: dict[int, torch.Tensor] = {}
        self.hooks = [q.register_forward_pre_hook(self._hook(id(q))) for q in quantizers]

    def _hook(self, key: int):
        def hook(module, args):
            hist = image_weighted_histogram(args[0])
            self.hists[key] = hist if key not in self.hists else self.hists[key] + hist
        return hook

    def amax(self, quantizer: TensorQuantizer) -> torch.Tensor:
        hist = self.hists.get(id(quantizer))
        if hist is None:
            raise RuntimeError("a quantizer saw no data during calibration")
        hist = hist.cpu()
        last = int(hist.nonzero().max()) + 2 if hist.any() else 2  # no candidate above the largest value seen
        return mse_amax(hist[:last], bin_edges()[:last + 1], quantizer.num_bits, quantizer.unsigned, start_bin=0)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
