"""Calibration: statistics over images, then one amax per quantizer. The only module that reads modelopt
calibrators' internals (their histograms); where a quantizer keeps its amax is ``qdq.py``'s.

    groups, search = calibrate(qmodel, batches, config, num_batches=25)   # qmodel from model_quant.prepare

- Max calibrators (weights always; inputs with ``method="max"``): amax is the max |x| seen.
- Histogram calibrators (percentile, mse, entropy): amax from the histogram of |x| (``histogram_amax``;
  the MSE and entropy searches are the toolkit's own, vectorised over the candidates where modelopt loops in
  Python: ``mse_amax`` in ``utils/qat/quantize/mse.py``, ``entropy_amax`` here).
- ``mse-image``: the same MSE search over histograms in which every image weighs alike
  (``utils/qat/quantize/image_hist.py``), collected by this module's hooks instead of modelopt's calibrators.
- ``sample`` (``--calib-sample``; a CPU's default): each histogram counts about that many values of each image's
  tensor, evenly spread over it (:func:`sample_values`), over the range of the whole tensor (:func:`collect_sample`).
  On a CPU ``torch.histc`` over every value of YOLOv9's activations was most of a calibration's time
  (docs/QAT_CALIBRATION.md "Calibrating on a CPU").
- Then the quantizers that must share one scale (``utils/qat/quantize/rules.scale_groups``) get one amax:
  the group's largest (``tie="max"``), or the value with the least squared error summed over every member's
  histogram (``tie="mse"``: ``group_mse_amax``), which lets a member with a far wider range be clipped where
  that costs the group less than the resolution lost by the others; the groups are returned
  (``QuantInfo.scale_groups``).

In a multi-GPU run rank 0 calibrates alone, on the global batches (what one process reads), and sends
its amax and groups to the other ranks: every rank ends with one process's quantizers exactly
(docs/DEVELOPING.md, "Multi-GPU", says why this replaced merging the ranks' histograms).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator

import torch
import utils.qat.quantize.modelopt_import  # noqa: F401  (modelopt without its unused plugins: first)
from modelopt.torch.quantization.calib import HistogramCalibrator
from torch import nn

from utils.qat.quantize import rules
from utils.qat.quantize.config import QuantConfig
from utils.qat.quantize.head import recording_head_inputs, search_head_amax
from utils.qat.quantize.image_hist import ImageHistograms
from utils.qat.quantize.mse import group_mse_amax, mse_amax
from utils.qat.quantize.state import amax_state, amax_vector, collecting, enabled_quantizers, load_amax, quantizers_off
from utils.qat.core import distributed, timing
from utils.qat.core.errors import QATError
from utils.qat.core.progress import progress


@torch.no_grad()
def calibrate(model: nn.Module, batches: Iterable[torch.Tensor], config: QuantConfig,
              example: torch.Tensor | None = None,
              num_batches: int | None = None) -> tuple[list[list[str]], dict]:
    """Collect statistics over ``batches`` (images as float tensors on the model's device), set amax on
    every enabled quantizer with ``config.method``, then give each shared-scale group one amax and, with
    ``config.head_amax == "search"`` or ``config.search_layers``, search those scales (``head.py``). Returns
    ``(groups, head_search)``: the groups, and the search's summary (``{}`` without one; else ``factors``,
    ``loss_before``, ``loss_after``, ``batches``: ``QuantInfo.head_search``). ``example``: the input traced to
    find the groups (default: the first calibration image).

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
    kept: list[torch.Tensor] = []  # the first batches again, for the amax search
    try:
        modelopts = [q for q in quantizers if id(q) not in own_ids]
        histograms = [q._calibrator for q in modelopts if isinstance(q._calibrator, HistogramCalibrator)]
        with collecting(modelopts), quantizers_off(own), sampling(histograms, config.sample), \
                recording_head_inputs(model, config.head_batches if config.searches else 0) as fp_inputs:
            for images in progress(batches, total=num_batches, desc=f"calibrating ({config.method})"):
                model(images)
                if example is None:
                    example = images[:1]
                if config.searches and len(kept) < config.head_batches:
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
    # the calibrators keep their histograms for tie="mse"
    groups = rules.scale_groups(model, example, shared_pool=config.pool_scale == "shared")
    rules.tie_scales(model, groups, _group_amax(model) if config.tie == "mse" else None)
    search: dict = {}
    if config.searches:
        with timing.timed("amax search"):
            search = search_head_amax(model, kept, groups, layers=config.search_layers,
                                      head=config.head_amax == "search", fp_inputs=fp_inputs,
                                      bounded=config.search_cost == "bounded")
    return groups, search


def _group_amax(model: nn.Module) -> Callable[[list[str]], torch.Tensor | None]:
    """``tie="mse"``: the amax of a group from its members' histograms (modelopt's calibrators; a group with a
    member that has none, as with ``max`` or ``mse-image``, keeps the largest amax)."""
    modules = dict(model.named_modules())

    def amax(group: list[str]) -> torch.Tensor | None:
        found = [getattr(modules[n], "_calibrator", None) for n in group]
        calibrators = [c for c in found if isinstance(c, HistogramCalibrator) and c._calib_hist is not None]
        if len(calibrators) != len(group):
            return None
        return group_mse_amax([(c._calib_hist, c._calib_bin_edges) for c in calibrators], calibrators[0]._num_bits,
                              calibrators[0]._unsigned)
    return amax


@contextlib.contextmanager
def sampling(calibrators: Iterable[HistogramCalibrator], per_image: int) -> Iterator[None]:
    """Inside the block each of ``calibrators`` counts :func:`sample_values` of what it is given into its histogram
    (:func:`collect_sample`; ``per_image`` 0: every value, modelopt's own ``collect``)."""
    calibrators = [c for c in calibrators if c._torch_hist and not c._skip_zeros] if per_image > 0 else []
    for c in calibrators:
        c.collect = functools.partial(collect_sample, c, per_image)
    try:
        yield
    finally:
        for c in calibrators:
            c.__dict__.pop("collect", None)


def collect_sample(calibrator: HistogramCalibrator, per_image: int, x: torch.Tensor) -> None:
    """modelopt's histogram update (``HistogramCalibrator.collect``, torch path: bins of |x| from 0, the first
    batch's range split into ``num_bins``, later batches extending it by whole bins) with the range from every
    value of ``x`` and the counts from :func:`sample_values`: the counts estimate the whole tensor's, scaled down
    alike, without the largest value counted as often as the sample is thinner (counted, it weighs on the MSE
    search as a clipped outlier: amax 17% higher on YOLOv9-t with 4096 values per image)."""
    values = sample_values(x, per_image)
    if values is x:
        return HistogramCalibrator.collect(calibrator, x)
    low, high = torch.aminmax(x.detach())
    top = torch.maximum(high, -low).float()
    values = values.detach().abs().float()
    c = calibrator
    if c._calib_bin_edges is None and c._calib_hist is None:
        c._calib_hist = torch.histc(values, bins=c._num_bins, min=0, max=top)
        c._calib_bin_edges = torch.linspace(0, top, c._num_bins + 1)
        return
    if top > c._calib_bin_edges[-1]:
        width = c._calib_bin_edges[1] - c._calib_bin_edges[0]
        c._num_bins = int((top / width).ceil().item())
        c._calib_bin_edges = torch.arange(0, top + width, width, device=values.device)
    hist = torch.histc(values, bins=c._num_bins, min=0, max=c._calib_bin_edges[-1])
    hist[: c._calib_hist.numel()] += c._calib_hist
    c._calib_hist = hist


def sample_values(x: torch.Tensor, per_image: int) -> torch.Tensor:
    """About ``per_image`` values of each image's part of ``x`` (a batch; ``x`` itself where an image holds no
    more): every ``k``-th value in memory order, ``k`` the least prime at least the image's count over
    ``per_image``.

    ``k`` depends on the image's size, not the batch's: every image weighs alike, also in a last, smaller batch. A
    prime stride drifts across a feature map's rows and columns where a round one would keep picking the same
    columns. Deterministic: the same tensor gives the same sample."""
    n = x[0].numel() if x.dim() > 1 else x.numel()
    if per_image <= 0 or n <= per_image:
        return x
    return x.reshape(-1)[::_prime_at_least(-(-n // per_image))]


def _prime_at_least(n: int) -> int:
    n = max(n, 2)
    while any(n % d == 0 for d in range(2, int(n ** 0.5) + 1)):
        n += 1
    return n


def histogram_amax(calibrator: HistogramCalibrator, method: str, percentile: float) -> torch.Tensor:
    """amax from a collected histogram. MSE is searched here: modelopt 0.47's ``_compute_amax_mse``
    calls ``fake_tensor_quant`` with its pre-``bias`` signature and returns the first candidate."""
    if calibrator._calib_hist is None:
        raise RuntimeError("a quantizer saw no data during calibration")
    if method in ("mse", "entropy"):
        search = mse_amax if method == "mse" else entropy_amax
        return search(calibrator._calib_hist, calibrator._calib_bin_edges, calibrator._num_bits, calibrator._unsigned)
    kwargs = {"percentile": percentile} if method == "percentile" else {}
    return torch.as_tensor(calibrator.compute_amax(method, **kwargs), dtype=torch.float32)


def entropy_amax(hist: torch.Tensor, edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
                 start_bin: int = 128) -> torch.Tensor:
    """modelopt's entropy method (``_compute_amax_entropy``: the bin edge ``i`` whose histogram, folded into
    ``2 ** (num_bits - 1)`` levels, has the least KL divergence from the histogram clipped at ``i``), for every
    candidate ``i`` at once.

    modelopt loops over the candidates in Python and spreads each level's count over its non-empty bins one bin
    at a time (minutes on GELAN-C). The divergence splits into sums over whole levels: with ``b`` the counts (the
    first bin set to the second's, as modelopt does), ``T`` their total, ``S_k`` / ``N_k`` the count and the number
    of non-empty bins of level ``k`` (``floor(j * levels / i) = k`` for bin ``j``), every non-empty bin ``j < i``
    gets ``q_j = (S_k / N_k) / C_i`` (``C_i``: counts below ``i``), the reference gets ``p_j = b_j / T`` plus the
    clipped counts on its last bin, so ``KL(i) = sum_j p_j log b_j - sum_k (S_k / T) log(S_k / N_k) + (C / T)
    log(C_i / T)`` plus the last bin's own term: prefix sums over the bins, then ``levels`` terms per candidate.
    The last of equal minima wins, as in modelopt; it differs from modelopt only where two candidates' divergences
    agree to rounding (tests/test_quantize.py compares every quantizer of a calibrated model)."""
    counts = torch.as_tensor(hist).detach().cpu().to(torch.int64).double().flatten()  # modelopt counts in int
    edges = torch.as_tensor(edges).detach().cpu().double().flatten()
    counts[0] = counts[1]
    n, levels = len(counts), 2 ** (num_bits - 1 + int(unsigned))
    total = counts.sum()
    zero = torch.zeros(1, dtype=torch.float64)
    xlogx = torch.where(counts > 0, counts * counts.clamp(min=1).log(), counts.new_zeros(()))
    below = torch.cat([zero, counts.cumsum(0)])  # below[m]: counts of bins < m
    nonempty = torch.cat([zero, (counts > 0).double().cumsum(0)])
    below_xlogx = torch.cat([zero, xlogx.cumsum(0)])
    best, best_kl = n, float("inf")
    k = torch.arange(levels + 1, dtype=torch.int64)
    for chunk in torch.arange(start_bin, n + 1).split(512):  # bounded memory: 512 x levels at a time
        i = chunk[:, None]
        bounds = (k[None] * i + levels - 1) // levels  # first bin of each level: ceil(k * i / levels)
        s = below[bounds[:, 1:]] - below[bounds[:, :-1]]
        cnt = nonempty[bounds[:, 1:]] - nonempty[bounds[:, :-1]]
        density = s / cnt.clamp(min=1)
        c_i = below[chunk]
        last = counts[chunk - 1]
        s_last = s[:, -1] - last  # the last level without the last bin, whose reference also holds the clipped counts
        log_d = density.clamp(min=1e-300).log()
        s_rest = torch.cat([s[:, :-1], s_last[:, None]], 1)
        kl = (below_xlogx[chunk - 1] - (s_rest * log_d).sum(1) + below[chunk - 1] * (c_i.log() - total.log())) / total
        p_last = last + (total - c_i)
        last_term = torch.where(p_last > 0, p_last / total * ((p_last / total).log() - (density[:, -1] / c_i).log()),
                                torch.zeros_like(p_last))
        kl = torch.where((last == 0) & (p_last > 0), torch.full_like(kl, float("inf")), kl + last_term)
        kl = torch.where(c_i > 0, kl, torch.full_like(kl, float("inf")))
        j = len(kl) - 1 - int(kl.flip(0).argmin())  # the last of equal minima
        if float(kl[j]) <= best_kl:
            best, best_kl = int(chunk[j]), float(kl[j])
    return edges[best].float()

