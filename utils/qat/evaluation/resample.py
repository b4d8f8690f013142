"""How far a difference of mAP between two models scored on the same images can be trusted: a paired bootstrap over
the images, from the per-image statistics an evaluation keeps (``Metrics.per_image``).

    paired = PairedBootstrap(fp_metrics)          # the reference: the draws and its AP on each, made once
    d = paired(int8_metrics)                      # the same draws for the candidate
    d.delta, d.low, d.spread                      # AP(candidate) - AP(reference); its lower bound; its spread
    d.interval, d.tie                             # its 95% interval over the draws; whether that holds 0
    shown(d)                                      # '-0.0017 [-0.0046, +0.0011]'

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
INTERVAL = 0.95  # the two-sided interval published beside a difference: 95 draws in 100 fall inside it


@dataclass(frozen=True)
class Paired:
    """``delta``: candidate minus reference AP on the scored images; ``low``: the lower ``1 - level`` quantile of
    that difference over the draws; ``spread``: its standard deviation over the draws; ``interval``: the central
    :data:`INTERVAL` of the draws' differences."""
    delta: float
    low: float
    spread: float
    draws: int
    interval: tuple[float, float] = (float("nan"), float("nan"))

    @property
    def tie(self) -> bool:
        """The interval holds 0: these images cannot tell the two models apart."""
        return self.interval[0] <= 0 <= self.interval[1]


def shown(d: Paired) -> str:
    """A difference as published: ``-0.0017 [-0.0046, +0.0011]``."""
    return f"{d.delta:+.4f} [{d.interval[0]:+.4f}, {d.interval[1]:+.4f}]"


def record(d: Paired) -> dict:
    """A difference as report.json keeps it: ``{"AP": delta, "interval": [low, high], "draws": n}``."""
    return {"AP": round(d.delta, 4), "interval": [round(d.interval[0], 4), round(d.interval[1], 4)], "draws": d.draws}


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
        tail = (1 - INTERVAL) / 2
        return Paired(delta=float(delta), low=float(np.quantile(diffs, 1 - self.level)),
                      spread=float(diffs.std()), draws=len(self.index),
                      interval=(float(np.quantile(diffs, tail)), float(np.quantile(diffs, 1 - tail))))


# ------------------------------------------------------------------------- per-image statistics kept on disk
#: The file a run keeps its FP model's per-image statistics in, so that a later evaluation of the same images (the
#: exported graph, ``val_trt.py --report``) gets its interval against FP too.
REFERENCE_FILE = "origin_images.npz"


class Stored:
    """Per-image statistics read back from :func:`save_images`: what :class:`PairedBootstrap` takes of a
    ``Metrics`` (``per_image``, and ``mask`` None: the stored statistics are the primary ones)."""

    def __init__(self, per_image: list):
        self.per_image = per_image
        self.mask = None


def save_images(metrics: Metrics, path) -> None:
    """The primary per-image statistics of ``metrics`` (the masks' for segmentation) as plain arrays (``.npz``, no
    pickle), written atomically."""
    from utils.qat.core.atomic import atomic_path
    arrays = _image_arrays(metrics)
    paths = sorted(arrays)
    if not paths:
        return
    rows = [arrays[p] for p in paths]
    pred = np.cumsum([0] + [len(r[1]) for r in rows])
    target = np.cumsum([0] + [len(r[3]) for r in rows])
    columns = rows[0][0].shape[1] if rows and rows[0][0].ndim == 2 else 10
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, paths=np.array(paths, dtype=str), pred_offsets=pred, target_offsets=target,
                 correct=np.concatenate([r[0].reshape(-1, columns) for r in rows]).astype(bool),
                 conf=np.concatenate([r[1] for r in rows]).astype(np.float32),
                 pred_cls=np.concatenate([r[2] for r in rows]).astype(np.float32),
                 target_cls=np.concatenate([r[3] for r in rows]).astype(np.float32))


def load_images(path) -> Stored:
    """:func:`save_images`' file read back as data (no pickle), its offsets checked against its arrays."""
    from utils.qat.evaluation.evaluate import ImageStats
    with np.load(path, allow_pickle=False) as z:
        paths, pred, target = z["paths"], z["pred_offsets"], z["target_offsets"]
        correct, conf, pred_cls, target_cls = z["correct"], z["conf"], z["pred_cls"], z["target_cls"]
    n = len(paths)
    consistent = (len(pred) == len(target) == n + 1 and pred[0] == target[0] == 0 and np.all(np.diff(pred) >= 0)
                  and np.all(np.diff(target) >= 0) and pred[-1] == len(conf) == len(pred_cls) == len(correct)
                  and target[-1] == len(target_cls))
    if not consistent:
        raise ValueError(f"{path} does not hold per-image statistics as save_images writes them")
    images = []
    for i, p in enumerate(paths):
        image = ImageStats(str(p))
        a, b, c, d = int(pred[i]), int(pred[i + 1]), int(target[i]), int(target[i + 1])
        image.box = (correct[a:b], conf[a:b], pred_cls[a:b], target_cls[c:d])
        images.append(image)
    return Stored(images)
