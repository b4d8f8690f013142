"""Calibration across the processes of a multi-GPU run: each rank calibrates on its shard of the images;
here the ranks agree on one amax per quantizer, bit for bit.

- Max calibrators (weights always; inputs with ``--calib-method max``): the element-wise max of the ranks'
  amax is the max over all images. One all-reduce carries every quantizer's amax.
- Histogram calibrators (percentile, mse, entropy): before collecting, ``seed_histograms`` starts every
  rank on the bins one process would start with; afterwards the ranks' histograms are gathered and merged
  (``merge_histograms``), and each merged histogram's amax is computed by one rank (round-robin, which
  also splits the minutes entropy takes) and shared by a max-reduction in which the other ranks contribute
  zeros (amax >= 0, so every rank ends with the owner's value exactly).
"""
from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from modelopt.torch.quantization.calib import HistogramCalibrator
from modelopt.torch.quantization.nn import TensorQuantizer
from torch import nn

from utils.qat import distributed


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
    for q in quantizers:
        q.disable_calib()
    try:
        model(first)
    finally:
        for h in hooks:
            h.remove()
        for q in quantizers:
            q.enable_calib()
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
    from models.quantize import histogram_amax
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


def amax_vector(model: nn.Module) -> torch.Tensor:
    """All quantizers' amax, flattened in module order (for comparing ranks or runs)."""
    parts = [m.amax.detach().float().flatten().cpu() for m in model.modules()
             if isinstance(m, TensorQuantizer) and m.is_enabled and m.amax is not None]
    return torch.cat(parts) if parts else torch.zeros(0)


def amax_table(model: nn.Module) -> dict[str, list[float]]:
    """Each enabled quantizer's amax by module name (what ``YOLOV9_QAT_AMAX_DUMP`` writes per rank)."""
    return {n: m.amax.detach().float().flatten().cpu().tolist() for n, m in model.named_modules()
            if isinstance(m, TensorQuantizer) and m.is_enabled and m.amax is not None}
