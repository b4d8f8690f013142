"""The paired bootstrap's draws (utils/qat/evaluation/resample.py) scored without upstream's ``ap_per_class``: each
draw's mAP50-95 and a row's difference and interval as scoring every draw with ``ap_per_class`` gives them, on the
embedded model's real per-image statistics and on made-up images that reach every corner of a precision-recall
curve (no prediction, no label, every label found, an image drawn many times, nothing correct)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import REPO

QS = REPO / "weights" / "gelan-qs-shapes.pt"


def _upstream_ap(arrays: list[tuple], index: np.ndarray) -> float:
    """mAP50-95 of the images at ``index`` (repeats count again) with upstream's ``ap_per_class``: the computation
    every draw made before :class:`resample._Curves`, kept here as the reference."""
    from utils.metrics import ap_per_class
    cat = [np.concatenate([arrays[i][k] for i in index]) for k in range(4)]
    if not cat[0].any():
        return 0.0
    return float(ap_per_class(*cat, plot=False, names={})[5].mean(1).mean())


def _upstream_paired(reference, candidate, draws: int):
    """``resample.Paired`` as the bootstrap made it with :func:`_upstream_ap` on every draw (the same draws)."""
    from utils.qat.evaluation import resample
    paired = resample.PairedBootstrap(reference, draws=draws)
    ref, cand = resample._image_arrays(reference), resample._image_arrays(candidate)
    ref, cand = [ref[p] for p in paired.paths], [cand[p] for p in paired.paths]
    everything = np.arange(len(ref))
    diffs = np.array([_upstream_ap(cand, i) - _upstream_ap(ref, i) for i in paired.index])
    tail = (1 - resample.INTERVAL) / 2
    return resample.Paired(delta=_upstream_ap(cand, everything) - _upstream_ap(ref, everything),
                           low=float(np.quantile(diffs, 1 - paired.level)), spread=float(diffs.std()),
                           draws=len(diffs), interval=(float(np.quantile(diffs, tail)),
                                                       float(np.quantile(diffs, 1 - tail))))


@pytest.fixture(scope="module")
def scored(yolov9_tree, shapes):
    """The embedded model's per-image statistics on the shapes val images at 256 px (the reference) and at 160 px
    (a model that scores lower on the same images)."""
    from utils.qat.evaluation.backends import TorchBackend
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.evaluation.evaluate import evaluate
    from utils.qat.model import checkpoint
    backend = TorchBackend(checkpoint.load_fp(QS), torch.device("cpu"))
    data = load_data_yaml(shapes)
    return [evaluate(backend, data, imgsz=size, batch_size=8, workers=0) for size in (256, 160)]


def test_draws_score_as_upstream_on_real_statistics(scored):
    """Every draw's mAP50-95, the score of all images, and the row's difference, bound and interval equal what
    ``ap_per_class`` on each draw gives (to 1e-9: the published figures to the last digit)."""
    from utils.qat.evaluation import resample
    reference, candidate = scored
    arrays = resample._image_arrays(reference)
    arrays = [arrays[p] for p in sorted(arrays)]
    curves = resample._Curves(arrays)
    paired = resample.PairedBootstrap(reference, draws=100)
    assert curves.ap(np.ones(len(arrays), np.int64)) == pytest.approx(reference.mAP50_95, abs=1e-12)
    for index, copies, ap in zip(paired.index, paired.copies, paired.reference_ap):
        assert ap == curves.ap(copies) == pytest.approx(_upstream_ap(arrays, index), abs=1e-12)
    new, old = paired(candidate), _upstream_paired(reference, candidate, draws=100)
    assert new.delta < 0 and new.draws == old.draws == 100
    pairs = ((new.delta, old.delta), (new.low, old.low), (new.spread, old.spread), *zip(new.interval, old.interval))
    for a, b in pairs:
        assert a == pytest.approx(b, abs=1e-9)
    assert resample.shown(new) == resample.shown(old) and resample.record(new) == resample.record(old)


def _made_up(n: int, seed: int) -> list[tuple]:
    """``n`` images of 0-5 labels of 4 classes, each label found by a prediction correct down to a random IoU
    threshold, plus false predictions (some of a class the image has no label of); some images have no prediction,
    some no label, some neither. Confidences are distinct within a class (ties there are ordered by the sort, as
    upstream's own sort leaves them open)."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n):
        labels = rng.integers(0, 4, rng.integers(0, 6)).astype(np.float32)
        found = labels[rng.random(len(labels)) < 0.8]
        cls = np.concatenate([found, rng.integers(0, 5, rng.integers(0, 4)).astype(np.float32)])
        if rng.random() < 0.15:
            cls = cls[:0]
        correct = np.zeros((len(cls), 10), bool)
        correct[:min(len(found), len(cls))] = np.arange(10) < rng.integers(0, 11, (min(len(found), len(cls)), 1))
        images.append((correct, rng.random(len(cls)).astype(np.float32), cls, labels))
    return images


@pytest.mark.parametrize("seed", range(6))
def test_draws_score_as_upstream_on_made_up_images(yolov9_tree, seed):
    """Draws of made-up images, including draws of few images taken many times and images that hold one class's
    every label, score as ``ap_per_class`` scores them; a draw with nothing correct scores 0."""
    from utils.qat.evaluation import resample
    images = _made_up(30, seed)
    curves = resample._Curves(images)
    rng = np.random.default_rng(seed)
    draws = [rng.integers(0, 30, 30) for _ in range(20)] + [rng.integers(0, 3, 30), np.full(30, seed), np.arange(30)]
    for index in draws:
        assert curves.ap(np.bincount(index, minlength=30)) == pytest.approx(_upstream_ap(images, index), abs=1e-12)
    nothing = [(np.zeros_like(c), f, p, t) for c, f, p, t in images]
    assert resample._Curves(nothing).ap(np.ones(30, np.int64)) == 0.0
