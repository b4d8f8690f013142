"""Calibration: statistics over images, then one amax per quantizer; across the processes of a multi-GPU
run, the same amax on every rank. The only module that reads modelopt's calibrator internals.

    info = calibrate(qmodel, batches, info, num_batches=25)     # qmodel, info from models.quantize.prepare

- Max calibrators (weights always; inputs with ``--calib-method max``): amax is the max |x| seen. Across
  ranks, the element-wise max of the ranks' amax is the max over all images (one all-reduce).
- Histogram calibrators (percentile, mse, entropy): amax from the histogram of |x| (``histogram_amax``;
  the MSE search is this module's own, ``mse_amax``). Across ranks, ``seed_histograms`` starts every rank on
  the bins one process would start with; afterwards the ranks' histograms are gathered and merged
  (``merge_histograms``), and each merged histogram's amax is computed by one rank (round-robin, which
  also splits the minutes entropy takes) and shared by a max-reduction in which the other ranks contribute
  zeros (amax >= 0, so every rank ends with the owner's value exactly).
- Then the quantizers that must share one scale (``models/quantize_rules.scale_groups``) get their
  group's largest amax.
"""
from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from modelopt.torch.quantization.calib import HistogramCalibrator
from modelopt.torch.quantization.nn import TensorQuantizer
from torch import nn

from models import quantize_rules as rules
from models.quantize_state import amax_vector, collecting, enabled_quantizers, not_collecting
from utils.qat import distributed
from utils.qat.errors import QATError
from utils.qat.progress import progress

if TYPE_CHECKING:
    from models.quantize import QuantInfo


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], info: QuantInfo, example: torch.Tensor | None = None,
              num_batches: int | None = None) -> QuantInfo:
    """Collect statistics over ``batches`` (images as float tensors on the model's device), set amax on
    every enabled quantizer with ``info.calib_method``, then give each shared-scale group one amax.
    ``example``: the input traced to find the shared-scale groups (default: the first calibration image).

    In a multi-GPU run (process group joined) every rank calls this with its own shard of the images; the
    ranks then agree on amax from the statistics of all of them (below) and leave with identical quantizers
    (checked).

    modelopt 0.47's own histogram path calls ``compute_amax()`` without the method and computes each
    histogram amax twice; calibration is driven here instead: one pass, one ``compute_amax`` per quantizer.
    """
    quantizers = enabled_quantizers(model)
    training = model.training
    model.eval()
    seen = 0
    try:
        with collecting(quantizers):
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


# ---- across the ranks of a multi-GPU run --------------------------------------------------------------

def seed_histograms(model: nn.Module, quantizers: list[TensorQuantizer],
                    batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Start every rank's histogram calibrators on the bins one process would start with; returns
    ``batches`` unchanged (its first batch, read here, put back in front). Call on every rank before
    collecting, with calibration on (collectives inside).

    modelopt fixes a calibrator's bin width from the largest |x| of the first tensor it collects, and only
    adds bins of that width later. One process would collect global batch 1 first, the union of the ranks'
    first batches. So one plain forward of this rank's first batch records that largest |x| per quantizer
    (of its first call: a Concat's quantizer sees each input in turn), the ranks take the max, and every
    calibrator starts from empty bins spanning [0, max], built as modelopt's first collect builds them. The
    ranks' bins then coincide and merging adds counts bin for bin. In one process this changes nothing.
    """
    hist = [q for q in quantizers if isinstance(q._calibrator, HistogramCalibrator)]
    batches = iter(batches)
    first = next(batches, None) if hist else None
    if first is None:
        return batches
    peaks: dict[int, torch.Tensor] = {}

    def record(i: int) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            peaks.setdefault(i, args[0].detach().abs().float().max())
        return hook

    hooks = [q.register_forward_pre_hook(record(i)) for i, q in enumerate(hist)]
    try:
        with not_collecting(quantizers):
            model(first)
    finally:
        for h in hooks:
            h.remove()
    zero = torch.zeros((), device=first.device)
    top = distributed.all_reduce_max(torch.stack([peaks.get(i, zero) for i in range(len(hist))]))
    for q, m in zip(hist, top):
        if float(m) > 0:  # 0: the quantizer saw nothing (or only zeros); left to modelopt as in one process
            start_bins(q._calibrator, m)
    return itertools.chain([first], batches)


def start_bins(calibrator: HistogramCalibrator, top: torch.Tensor) -> None:
    """Give an empty calibrator the (empty) bins its first ``collect`` would create for data whose largest
    |x| is ``top`` (a 0-d float32 tensor on the data's device): modelopt's first collect is
    ``histc(x, bins=n, min=0, max=x_max)`` with edges ``linspace(0, x_max, n + 1)``, and a later one
    ``histc(x, bins=n, min=0, max=edges[-1])``, so collecting after this gives the same counts."""
    if calibrator._calib_hist is not None:
        raise RuntimeError("start_bins needs a calibrator that has collected nothing yet")
    calibrator._calib_hist = torch.zeros(calibrator._num_bins, device=top.device)
    calibrator._calib_bin_edges = torch.linspace(0, top, calibrator._num_bins + 1)


def merge_histograms(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One histogram ``(counts, edges)`` of the data behind ``parts``, the ``(counts, edges)`` of modelopt
    HistogramCalibrators that each saw part of the data.

    Each part's bins start at 0 and share one width, fixed by the largest value of the first batch that
    calibrator saw; later batches only add bins of that width. Seeded calibrators (``seed_histograms``) share
    the width; unseeded ones of different ranks do not. The merged histogram keeps the widest part's bins
    (the width one process would have fixed reading the same global batches: its first batch is the union
    of the ranks' first batches), extended to cover every part, and each count of every part goes whole to
    the merged bin that holds the centre of the count's own bin. Parts of one width add bin for bin; counts
    of a narrower part move by at most one bin; counts stay whole numbers; one part merges to itself.
    """
    if not parts:
        raise ValueError("no histogram to merge")
    parts = [(h.detach().cpu().flatten(), e.detach().cpu().flatten()) for h, e in parts]
    # modelopt's histc takes max=edges[-1] with len(counts) bins; where edges and counts disagree in
    # length (its arange can add an edge), the counts' own bins are those equal slices of [0, edges[-1]].
    bins = [e if len(e) == len(h) + 1 else torch.linspace(0, float(e[-1]), len(h) + 1) for h, e in parts]
    widest = max(range(len(parts)), key=lambda i: float(bins[i][1] - bins[i][0]))
    edges = bins[widest].double()
    width = float(edges[1] - edges[0])
    top = max(float(b[-1]) for b in bins)
    extra = max(0, math.ceil(top / width) - (len(edges) - 1))
    if extra:
        edges = torch.cat([edges, edges[-1] + width * torch.arange(1, extra + 1, dtype=torch.float64)])
    counts = torch.zeros(len(edges) - 1, dtype=torch.float64)
    for (h, _), b in zip(parts, bins):
        b = b.double()
        centres = (b[:-1] + b[1:]) / 2
        index = (torch.searchsorted(edges, centres, right=True) - 1).clamp_(0, len(counts) - 1)
        counts.index_add_(0, index, h.double())
    return counts.to(parts[widest][0].dtype), edges.to(bins[widest].dtype)


def _max_reduce(quantizers: list[TensorQuantizer]) -> None:
    """Every quantizer's amax becomes its element-wise max over the ranks (one collective for all)."""
    if not quantizers:
        return
    amaxes = [q.amax for q in quantizers]
    flat = distributed.all_reduce_max(torch.cat([a.detach().float().flatten() for a in amaxes]))
    for q, a, part in zip(quantizers, amaxes, flat.split([a.numel() for a in amaxes])):
        q.amax = part.view_as(a).to(a.dtype)


def _merged_calibrator(like: HistogramCalibrator, counts: torch.Tensor, edges: torch.Tensor) -> HistogramCalibrator:
    merged = HistogramCalibrator(num_bits=like._num_bits, unsigned=like._unsigned, num_bins=len(counts))
    merged._calib_hist, merged._calib_bin_edges = counts, edges
    return merged


def sync_calibration(quantizers: list[TensorQuantizer], method: str, percentile: float, device: torch.device) -> None:
    """Set every quantizer's amax from the calibration statistics of all ranks; the same on each rank.

    Call on every rank, after each has collected statistics on its own images (collectives inside).
    """
    hist = [q for q in quantizers if isinstance(q._calibrator, HistogramCalibrator)]
    plain = [q for q in quantizers if not isinstance(q._calibrator, HistogramCalibrator)]
    for q in plain:
        q.load_calib_amax()
    _max_reduce(plain)
    if not hist:
        return
    mine = [None if q._calibrator._calib_hist is None else
            (q._calibrator._calib_hist.detach().cpu(), torch.as_tensor(q._calibrator._calib_bin_edges).detach().cpu())
            for q in hist]
    gathered = distributed.all_gather_object(mine)
    rank, world = distributed.rank(), distributed.world_size()
    amax = torch.zeros(len(hist), dtype=torch.float64)
    with warnings.catch_warnings():  # modelopt warns that compute_amax does not synchronise: this module does
        warnings.filterwarnings("ignore", message="This method does not perform any synchronization")
        for i in range(rank, len(hist), world):
            parts = [g[i] for g in gathered if g[i] is not None]
            if not parts:
                raise RuntimeError("a quantizer saw no data during calibration on any rank")
            merged = _merged_calibrator(hist[i]._calibrator, *merge_histograms(parts))
            amax[i] = float(histogram_amax(merged, method, percentile))
    amax = distributed.all_reduce_max(amax)
    for q, a in zip(hist, amax):
        q.amax = torch.tensor(float(a), dtype=torch.float32, device=device)
