"""The MSE clipping search over a histogram of |x| (``--method mse`` and ``mse-image``), shared by modelopt's
histogram calibrators (``calib.histogram_amax``) and the per-image histograms (``image_hist``), and over several
histograms at once for a shared-scale group (``--tie mse``). Plain torch."""
from __future__ import annotations

import torch


def mse_amax(hist: torch.Tensor, edges: torch.Tensor, num_bits: int = 8, unsigned: bool = False,
             start_bin: int = 128) -> torch.Tensor:
    """The clipping value (a bin centre from ``start_bin`` on) minimising the histogram-weighted
    squared error of symmetric fake quantization of |x|."""
    counts, centers = _centers(hist, edges)
    return _least_error(centers[min(start_bin, len(centers) - 1):], [(counts, centers)], num_bits, unsigned)


def group_mse_amax(histograms: list[tuple[torch.Tensor, torch.Tensor]], num_bits: int = 8, unsigned: bool = False,
                   start_bin: int = 128) -> torch.Tensor:
    """One clipping value for tensors that must share a scale: the candidate (a bin centre of the widest
    histogram from ``start_bin`` on) minimising the squared error summed over every ``(hist, edges)``, each
    weighted by its own counts."""
    hists = [_centers(h, e) for h, e in histograms]
    widest = max(hists, key=lambda ch: float(ch[1][-1]))[1]
    return _least_error(widest[min(start_bin, len(widest) - 1):], hists, num_bits, unsigned)


def _centers(hist: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and bin centres in float64, on the device the histogram was collected on (a GPU runs the search in
    a fraction of the CPU's time: every candidate against every bin, for each of hundreds of quantizers)."""
    counts = torch.as_tensor(hist).detach().double().flatten()
    edges = torch.as_tensor(edges).detach().to(counts.device).double().flatten()
    if len(edges) != len(counts) + 1:
        # modelopt grows its histogram with torch.arange(0, max + width, width), which can yield one edge more
        # than histc's bins; histc itself split [0, edges[-1]] into len(counts) equal bins
        edges = torch.linspace(0.0, float(edges[-1]), len(counts) + 1, dtype=torch.float64, device=counts.device)
    return counts, (edges[1:] + edges[:-1]) / 2


def _least_error(candidates: torch.Tensor, hists: list[tuple[torch.Tensor, torch.Tensor]], num_bits: int,
                 unsigned: bool) -> torch.Tensor:
    """The candidate with the least histogram-weighted squared error of fake quantization, summed over ``hists``
    (``(counts, centers)`` pairs); the first of equal minima. Returned on the CPU."""
    levels = 2 ** num_bits - 1 if unsigned else 2 ** (num_bits - 1) - 1
    errors = []
    for chunk in candidates.split(256):  # bounded memory: 256 x bins at a time
        scale = chunk[:, None] / levels
        err = torch.zeros(len(chunk), dtype=torch.float64, device=chunk.device)
        for counts, centers in hists:
            quant = torch.clamp(torch.round(centers[None] / scale), max=levels) * scale
            err += ((quant - centers[None]) ** 2 * counts[None]).sum(1)
        errors.append(err)
    return candidates[int(torch.cat(errors).argmin())].float().cpu()
