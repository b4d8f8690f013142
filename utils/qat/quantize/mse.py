"""The MSE clipping search over a histogram of |x| (``--method mse`` and ``mse-image``), shared by modelopt's
histogram calibrators (``calib.histogram_amax``) and the per-image histograms (``image_hist``). Plain torch."""
from __future__ import annotations

import torch


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
