"""calib.entropy_amax (the vectorised entropy calibration) against modelopt's own ``_compute_amax_entropy``: on
histograms of real activations (the embedded GELAN-QS model calibrated on real photos) and on synthetic ones
(heavy tails, empty bins, a histogram grown past its first range), the same bin edge."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import REPO
from helpers import real_images

QS = REPO / "weights" / "gelan-qs-shapes.pt"


def _modelopt(hist, edges) -> float:
    from modelopt.torch.quantization.calib.histogram import _compute_amax_entropy
    h = hist.int().cpu().numpy() if isinstance(hist, torch.Tensor) else np.array(hist)
    e = edges.cpu().numpy() if isinstance(edges, torch.Tensor) else np.array(edges)
    return float(_compute_amax_entropy(h, e, 8, False))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_amax_is_modelopts_on_synthetic_histograms(yolov9_tree, seed):
    from utils.qat.quantize.calib import entropy_amax
    rng = np.random.default_rng(seed)
    x = np.abs(rng.standard_normal(50000) * rng.uniform(0.1, 3)) ** rng.uniform(0.5, 2)
    x = x[x > 0.2] if seed == 1 else x  # empty low bins
    hist, edges = np.histogram(x, bins=2048 + 300 * seed)  # 2048 bins, and grown past them
    assert float(entropy_amax(torch.from_numpy(hist), torch.from_numpy(edges))) == pytest.approx(
        _modelopt(hist, edges), abs=0)


@pytest.mark.slow  # modelopt's own method takes 1-2 s per quantizer on 2 cores: about 9 of GELAN-QS's, spread over the model
def test_entropy_amax_is_modelopts_on_real_activations(yolov9_tree, shared):
    """Histogram quantizers of GELAN-QS on 4 real images, every k-th from the first to the last (every one of
    GELAN-C's 195 matched modelopt exactly when compared once, docs/QAT_FINETUNING.md): within one bin of modelopt."""
    from modelopt.torch.quantization.calib import HistogramCalibrator

    from utils.qat.model import checkpoint
    from utils.qat.quantize.calib import entropy_amax
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.quantize.state import enabled_quantizers
    images = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 4, 96)
    qmodel, _ = quantize(checkpoint.load_fp(QS), [images[:2], images[2:]],
                         QuantConfig(method="entropy", head_amax="calibrated"))
    calibrators = [q._calibrator for q in enabled_quantizers(qmodel) if isinstance(q._calibrator, HistogramCalibrator)]
    assert len(calibrators) > 100
    step = len(calibrators) // 8
    for c in calibrators[::step] + calibrators[-1:]:
        width = float(c._calib_bin_edges[1] - c._calib_bin_edges[0])
        ours = float(entropy_amax(c._calib_hist, c._calib_bin_edges))
        assert abs(ours - _modelopt(c._calib_hist, c._calib_bin_edges)) <= width * 1.0001
