"""How far a difference of mAP between two models scored on the same images can be trusted: a paired bootstrap over
the images, from the per-image statistics an evaluation keeps (``Metrics.per_image``).

    paired = PairedBootstrap(fp_metrics)          # the reference: the draws and its AP on each, made once
    d = paired(int8_metrics)                      # the same draws for the candidate
    d.delta, d.low, d.spread                      # AP(candidate) - AP(reference); its lower bound; its spread

Each draw takes as many images as were scored, with replacement, and scores both models on the same draw with
upstream's ``ap_per_class``, so what the two models share (which images are hard, which classes have one instance)
cancels and what remains is how much their difference depends on which images happened to be held out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from utils.qat.evaluation.evaluate import Metrics

DRAWS = 200  # bootstrap draws: the 10% bound moves by about 0.001 from one seed to the next on 40-80 images
# A draw costs one ap_per_class over as many predictions as the images hold (about 0.1 s per 100,000 on one core).
# Larger sets get fewer draws, down to MIN_DRAWS, so that a bound stays under about 20 s: their spread is smaller,
# and so is the quantile's error at the same relative precision.
PREDICTIONS_PER_BOUND = 20_000_000
MIN_DRAWS = 50
LEVEL = 0.9  # the lower bound's confidence: the drop is at most -low in 9 draws out of 10


@dataclass(frozen=True)
class Paired:
    """``delta``: candidate minus reference AP on the scored images; ``low``: the lower ``1 - level`` quantile of
    that difference over the draws; ``spread``: its standard deviation over the draws."""
    delta: float
    low: float
    spread: float
    draws: int


def _image_arrays(metrics: Metrics) -> dict[str, tuple[np.ndarray, ...]]:
    """Path -> the primary statistics of one image ``(correct, conf, pred_cls, target_cls)`` as numpy arrays
    (the masks' for segmentation); an image with nothing to count gets empty arrays."""
    masks = metrics.mask is not None
    out = {}
    for image in metrics.per_image:
        stats = image.mask if masks else image.box
        if stats is None:
            out[image.path] = (np.zeros((0, 10), bool), np.zeros(0), np.zeros(0), np.zeros(0))
        else:
            out[image.path] = tuple(np.asarray(t.numpy() if hasattr(t, "numpy") else t) for t in stats)
    return out


def _ap(arrays: list[tuple[np.ndarray, ...]], index: np.ndarray) -> float:
    """mAP50-95 of the images at ``index`` (repeats count again), with upstream's ``ap_per_class``."""
    from utils.metrics import ap_per_class
    cat = [np.concatenate([arrays[i][k] for i in index]) for k in range(4)]
    if not cat[0].any():
        return 0.0
    ap = ap_per_class(*cat, plot=False, names={})[5]
    return float(ap.mean(1).mean())


def draws_for(predictions: int, draws: int = DRAWS) -> int:
    """How many draws a set of ``predictions`` gets: ``draws``, fewer for large sets (:data:`PREDICTIONS_PER_BOUND`),
    never below :data:`MIN_DRAWS`."""
    return max(min(draws, MIN_DRAWS), min(draws, PREDICTIONS_PER_BOUND // max(predictions, 1)))


class PairedBootstrap:
    """The draws over ``reference``'s images and its AP on each, made once (``seed`` fixes them: the same run decides
    the same way); calling it with another evaluation of the same images gives their :class:`Paired` difference.
    ``draws``: at most that many (:func:`draws_for`)."""

    def __init__(self, reference: Metrics, draws: int = DRAWS, level: float = LEVEL, seed: int = 0):
        if not reference.per_image:
            raise ValueError("the reference evaluation kept no per-image statistics")
        self.level = level
        arrays = _image_arrays(reference)
        self.paths = sorted(arrays)
        self.reference = [arrays[p] for p in self.paths]
        rng = np.random.default_rng(seed)
        n = len(self.paths)
        predictions = sum(len(a[1]) for a in self.reference)
        self.index = [rng.integers(0, n, n) for _ in range(draws_for(predictions, draws))]
        self.reference_ap = np.array([_ap(self.reference, i) for i in self.index])
        self.reference_all = _ap(self.reference, np.arange(n))

    def __call__(self, candidate: Metrics) -> Paired:
        arrays = _image_arrays(candidate)
        if sorted(arrays) != self.paths:
            raise ValueError("the two evaluations scored different images; a paired bootstrap needs the same ones")
        ordered = [arrays[p] for p in self.paths]
        diffs = np.array([_ap(ordered, i) for i in self.index]) - self.reference_ap
        delta = _ap(ordered, np.arange(len(self.paths))) - self.reference_all
        return Paired(delta=float(delta), low=float(np.quantile(diffs, 1 - self.level)),
                      spread=float(diffs.std()), draws=len(self.index))
