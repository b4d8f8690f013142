"""How far a difference of mAP between two models scored on the same images can be trusted: a paired bootstrap over
the images, from the per-image statistics an evaluation keeps (``Metrics.per_image``).

    paired = PairedBootstrap(fp_metrics)          # the reference: the draws and its AP on each, made once
    d = paired(int8_metrics)                      # the same draws for the candidate
    d.delta, d.low, d.spread                      # AP(candidate) - AP(reference); its lower bound; its spread
    d.interval, d.tie                             # its 95% interval over the draws; whether that holds 0
    shown(d)                                      # '-0.0017 [-0.0046, +0.0011]'

Each draw takes as many images as were scored, with replacement, and scores both models on the same draw as
upstream's ``ap_per_class`` would, so what the two models share (which images are hard, which classes have one
instance) cancels and what remains is how much their difference depends on which images happened to be held out.

A draw is scored without ``ap_per_class`` (whose sort and per-class loop made a row's 200 draws take 15 s on one
core): each evaluation's predictions are sorted once (:class:`_Curves`), and a draw is how many times it takes each
image, so that its precision-recall curves are cumulative counts over that one order. It gives ``ap_per_class``'s
mAP50-95 to within 1e-12 (tests/test_resample.py), predictions of one class with the same confidence aside, whose
order upstream's sort leaves open.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from utils.qat.evaluation.evaluate import Metrics

DRAWS = 200  # bootstrap draws: the 10% bound moves by about 0.001 from one seed to the next on 40-80 images
# Larger sets get fewer draws, down to MIN_DRAWS, so that a bound's cost stays bounded: their spread is smaller, and
# so is the quantile's error at the same relative precision.
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


THRESHOLDS = 10  # the IoU thresholds 0.50:0.95 of a prediction's ``correct`` row
GRID = np.linspace(0, 1, 101)  # upstream's compute_ap: the envelope at 101 recalls, integrated by trapezoids
_STEP = np.diff(GRID)
# each point's trapezoid weight, the last's 0: the envelope is 0 there (interp's closing point (1, 0)); running sums of
# the weights, and of the weights times the recall, so that a level sums the points it covers in two subtractions
_WEIGHT = np.append((np.append(_STEP, 0.0) + np.append(0.0, _STEP))[:-1] / 2, 0.0)
WEIGHTS, WEIGHTED_RECALLS = np.append(0.0, np.cumsum(_WEIGHT)), np.append(0.0, np.cumsum(_WEIGHT * GRID))
EPS = 1e-16  # ap_per_class's: recall = TP / (labels + EPS)


class _Curves:
    """One evaluation's predictions sorted once (by class, then by falling confidence, as ``ap_per_class`` takes
    them); :meth:`ap` scores a draw of its images. ``arrays``: per image ``(correct, conf, pred_cls, target_cls)``.

    Only true positives move a precision-recall curve: the curve of a class at one IoU threshold is known from the
    rank, among the draw's predictions of that class, of each of its true positives, so each true positive (each
    copy of one, for an image drawn twice) is kept with its rank, and the false positives only as counts."""

    def __init__(self, arrays: list[tuple[np.ndarray, ...]]):
        n = len(arrays)
        preds = [len(a[1]) for a in arrays]
        correct = np.concatenate([np.asarray(a[0], bool).reshape(-1, THRESHOLDS) for a in arrays])
        conf = np.concatenate([a[1] for a in arrays])
        target_cls = np.concatenate([a[3] for a in arrays])
        classes, cls = np.unique(np.concatenate([np.concatenate([a[2] for a in arrays]), target_cls]),
                                 return_inverse=True)
        self.classes = len(classes)
        pred_c, target_c = cls[:len(conf)], cls[len(conf):]
        target_image = np.repeat(np.arange(n), [len(a[3]) for a in arrays])
        self.targets = np.bincount(target_image * self.classes + target_c,
                                   minlength=n * self.classes).reshape(n, self.classes)  # labels per image and class
        order = np.argsort(-conf, kind="stable")
        order = order[np.argsort(pred_c[order], kind="stable")]
        self.image = np.repeat(np.arange(n), preds)[order]  # the image of each prediction, in sorted order
        sorted_c = pred_c[order]
        self.class_start = np.searchsorted(sorted_c, np.arange(self.classes + 1))
        # true positives, one per (prediction, threshold) it is correct at, grouped by segment (class, threshold)
        row, column = np.nonzero(correct[order])
        segment = sorted_c[row] * THRESHOLDS + column
        by = np.lexsort((row, segment))
        self.row, self.segment = row[by], segment[by]
        self.tp_class = sorted_c[self.row]
        segments = self.classes * THRESHOLDS
        self.segment_class = np.arange(segments) // THRESHOLDS
        self.segment_first = np.searchsorted(self.segment, np.arange(segments + 1))

    def ap(self, copies: np.ndarray) -> float:
        """mAP50-95 of the draw taking image ``i`` ``copies[i]`` times, as ``ap_per_class`` gives it on the draw's
        predictions (mean over the classes that have labels in the draw, of the mean over the thresholds; 0 when no
        prediction is correct)."""
        weight = copies[self.image]
        before = np.concatenate([[0], np.cumsum(weight)])  # predictions of the draw ahead of each sorted one
        class_base = before[self.class_start]
        n_p = np.diff(class_base)  # the draw's predictions of each class
        n_l = copies @ self.targets + EPS  # its labels of each class
        tp_copies = weight[self.row]
        entry = np.repeat(np.arange(len(tp_copies)), tp_copies)  # each copy of each true positive
        if not len(entry):
            return 0.0
        k = np.arange(len(entry))
        ahead = np.concatenate([[0], np.cumsum(tp_copies)])
        first = ahead[self.segment_first]  # copies ahead of each segment's first
        segment = self.segment[entry]
        cls = self.tp_class[entry]
        rank = (before[self.row] - class_base[self.tp_class])[entry] + (k - ahead[entry]) + 1  # among its class
        tp = k - first[segment] + 1  # true positives of its segment up to it
        recall, precision = tp / n_l[cls], tp / rank
        ap = _Levels(recall, precision, segment, rank, tp, n_p[cls], first).area().reshape(self.classes, THRESHOLDS)
        return float(ap[n_l > EPS].mean(1).mean())


class _Levels:
    """The precision envelopes of a draw's segments (class, IoU threshold) as ``np.interp`` reads ``compute_ap``'s
    curve: one level per recall (``0``, then one per true positive), each with the envelope at its last point and the
    slope to the next level's first point (where a run of equal recalls starts and ends is all that interpolation
    sees). Segment ``s`` has the levels ``first[s] + s`` to ``first[s + 1] + s``: its level 0, then its true positives
    in order.

    ``recall``, ``precision``, ``segment``, ``rank`` (among its class's predictions in the draw) and ``tp`` (its
    segment's true positives up to it): one per copy of a true positive, by segment; ``n_p``: the draw's predictions
    of its class; ``first``: the true positives ahead of each segment, and in all."""

    def __init__(self, recall, precision, segment, rank, tp, n_p, first):
        e, self.first = len(recall), first
        # the envelope at each true positive: the highest precision from it on in its segment (each segment set 2
        # below the one before, so that no maximum reaches back into it)
        top = np.maximum.accumulate((precision - 2.0 * segment)[::-1])[::-1] + 2.0 * segment
        last = np.append(segment[1:] != segment[:-1], True)  # the segment's last true positive
        next_rank, next_top, next_recall = (np.append(a[1:], fill) for a, fill in
                                            ((rank, 1), (top, 0.0), (recall, 1.0)))
        next_top[last], next_recall[last] = 0.0, 1.0  # after the last: the closing point (1, 0)
        # a level ends at the prediction before the next true positive; the last level at the class's last
        # prediction, or at the closing point where recall reached 1
        with np.errstate(divide="ignore"):
            ends = np.where(last, np.where(recall == 1.0, 0.0, tp / n_p), np.maximum(tp / (next_rank - 1), next_top))
        starts = np.flatnonzero(np.append(True, last[:-1]))  # each segment's first true positive
        zero = starts + segment[starts]  # its level 0
        levels = e + len(first) - 1
        self.recall, self.envelope = np.zeros(levels), np.zeros(levels)
        upper, following = np.ones(levels), np.zeros(levels)  # the next level's recall and envelope
        own = np.arange(e) + segment + 1
        self.recall[own], self.envelope[own], upper[own], following[own] = recall, ends, next_recall, next_top
        self.envelope[zero] = np.where(rank[starts] == 1, 1.0, top[starts])  # (0, 1) alone, or the FPs ahead
        upper[zero], following[zero] = recall[starts], top[starts]
        with np.errstate(divide="ignore", invalid="ignore"):
            self.slope = np.where(upper == self.recall, 0.0, (following - self.envelope) / (upper - self.recall))

    def area(self) -> np.ndarray:
        """Each segment's AP: ``compute_ap``'s trapezoids over the envelope at the :data:`GRID` points, a level
        holding the points from its recall up to the next level's (``searchsorted``: as floats compare them)."""
        segments = len(self.first) - 1
        low = np.searchsorted(GRID, self.recall, side="left")
        high = np.append(low[1:], len(GRID))
        high[self.first[1:] + np.arange(segments)] = len(GRID)  # each segment's last level: up to recall 1
        weight = WEIGHTS[high] - WEIGHTS[low]
        weighted_recall = WEIGHTED_RECALLS[high] - WEIGHTED_RECALLS[low]
        area = self.slope * (weighted_recall - self.recall * weight) + self.envelope * weight
        return np.bincount(np.repeat(np.arange(segments), np.diff(self.first) + 1), weights=area, minlength=segments)


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
        self.copies = [np.bincount(i, minlength=n) for i in self.index]
        self.reference_ap, self.reference_all = self._scores(self.reference)

    def _scores(self, arrays: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, float]:
        """mAP50-95 of ``arrays`` (ordered as :attr:`paths`) on each draw, and on all images once each."""
        curves = _Curves(arrays)
        return np.array([curves.ap(c) for c in self.copies]), curves.ap(np.ones(len(arrays), np.int64))

    def __call__(self, candidate: Metrics) -> Paired:
        arrays = _image_arrays(candidate)
        if sorted(arrays) != self.paths:
            raise ValueError("the two evaluations scored different images; a paired bootstrap needs the same ones")
        ap, ap_all = self._scores([arrays[p] for p in self.paths])
        diffs, delta = ap - self.reference_ap, ap_all - self.reference_all
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
