"""One evaluation loop for every backend (PyTorch FP, fake-quant, ONNX Runtime, TensorRT) and every task.

The loop (:func:`evaluate`) is dataloader -> backend -> detections -> matching -> metrics; a task changes
its hooks only: ``utils.qat.evaluation.detect.DetectHooks`` (boxes), ``utils.qat.evaluation.evaluate_seg.SegmentHooks`` (boxes, then masks).
Dataloader, NMS and ``ap_per_class`` are upstream YOLOv9's own (``utils.dataloaders``, ``utils.general``,
``utils.metrics``), and ``detect.match`` is upstream val.py's ``process_batch`` rule (tests/test_segment.py
checks them equal), so numbers from every backend compare with each other and with upstream ``val.py``.

The result, :class:`Metrics`, holds box :class:`Scores` and, for segmentation, mask scores. In code the
number that ranks models is ``mAP50_95`` (mAP over IoU 0.50:0.95); report.json calls it ``AP``, and
``mAP50-95`` in its Box / Mask groups (``utils.qat.run.reports``).

``Metrics.halves`` scores the two halves of the evaluated images from the same per-image statistics (no second
pass): the images sorted by file path, alternately, positions 0, 2, 4, ... in ``even`` and 1, 3, 5, ... in
``odd`` (:func:`half_of`). A checkpoint chosen on one half and scored on the other gets a score free of the
choice (``utils.qat.run.reports.selection``).
"""
from __future__ import annotations

import functools
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from utils.qat.core.atomic import write_text
from utils.qat.evaluation.data import RECT_GROUP, dataloader
from utils.qat.evaluation.detect import DetectHooks, match
from utils.qat.evaluation.evaluate_seg import SegmentHooks
from utils.qat.core.progress import progress

if TYPE_CHECKING:
    from utils.qat.evaluation.backends import Backend


@dataclass
class Scores:
    """P, R, mAP50 and mAP50_95 of one kind of prediction (boxes or masks), as upstream's ``ap_per_class``
    defines them; ``per_class``: mAP50_95 by class name."""
    P: float = 0.0
    R: float = 0.0
    mAP50: float = 0.0
    mAP50_95: float = 0.0
    per_class: dict[str, float] = field(default_factory=dict)


@dataclass
class Metrics:
    """What one evaluation measured: ``box`` scores, ``mask`` scores for segmentation (None otherwise);
    ``halves``: the same scores of each half of the images (:data:`HALVES`, :func:`half_of`); ``per_image``: the
    statistics they were computed from, one :class:`ImageStats` per image (``utils/qat/evaluation/resample.py``
    draws from them)."""
    box: Scores = field(default_factory=Scores)
    mask: Scores | None = None
    images: int = 0
    instances: int = 0
    seconds: float = 0.0
    halves: dict[str, Metrics] = field(default_factory=dict)
    per_image: list[ImageStats] = field(default_factory=list, repr=False)

    @property
    def primary(self) -> Scores:
        """The scores that rank models (name checkpoints, pick the best QAT epoch): the masks' for segmentation."""
        return self.mask if self.mask is not None else self.box

    # the primary numbers, as the callers that rank models (checkpoint names, epochs, benchmarks) read them
    mAP50 = property(lambda self: self.primary.mAP50)
    mAP50_95 = property(lambda self: self.primary.mAP50_95)


@dataclass
class ImageStats:
    """One evaluated image: its file and its ``(correct, conf, pred_cls, target_cls)`` tuples for boxes and
    masks (None: nothing to count, no prediction and no label)."""
    path: str
    box: tuple | None = None
    mask: tuple | None = None


#: The two halves of the evaluated images, by position in their sorted list of paths.
HALVES = ("even", "odd")


def half_of(paths: Sequence[str]) -> list[str]:
    """The half of each image: ``even`` for positions 0, 2, 4, ... of the sorted distinct ``paths``, ``odd``
    for 1, 3, 5, ... (the files alternate, so both halves sample every part of a folder alike)."""
    position = {p: i for i, p in enumerate(sorted(set(paths)))}
    return [HALVES[position[p] % 2] for p in paths]


def batch_lengths(loader) -> list[int]:
    """How many images each batch of one pass of ``loader`` holds, in order (upstream's InfiniteDataLoader keeps its
    batch sampler inside a repeating one)."""
    sampler = loader.batch_sampler
    return [len(b) for b in getattr(sampler, "sampler", sampler)]


def val_batches(backend: Backend, data: dict, make_loader, *, imgsz: int, batch_size: int, workers: int,
                num_images: int | None, desc: str, loaders: dict | None = None):
    """The val split as ``backend`` takes it: ``(limit, batches)``, ``limit`` the number of images to score and
    ``batches`` yielding ``(images, targets, paths, shapes, *rest)`` of upstream's dataloader
    (``make_loader``), images float in [0, 1] on the backend's device, target boxes in input pixels, with a
    progress bar, for as many batches as ``limit`` images fill. Fixed-size graphs and engines get their own
    batch size and input size (letterboxed squares); others get upstream's rect shapes, fixed per group of
    ``data.RECT_GROUP`` images whatever ``batch_size`` is (the evaluation protocol: a score does not depend on the
    batch it ran in).

    ``loaders``: a dict that keeps the loader of a pass over every image for the next one with the same sizes
    (a run's evaluations after each stage): upstream's loader keeps its workers, which read the first batches of
    the next pass ahead while the run trains. Any ``len(loader)`` consecutive batches of it hold every image once
    (its batches repeat in one order), so a pass that ended early leaves the next pass's images the same; a pass
    over fewer images makes a loader of its own."""
    rect = backend.imgsz is None and backend.batch_size is None
    if backend.batch_size is not None:
        batch_size = backend.batch_size
    if backend.imgsz is not None:
        imgsz = max(backend.imgsz)
    key = (imgsz, batch_size, backend.stride, rect, workers)
    made = loaders.get(key) if loaders is not None and num_images is None else None
    if made is None:
        made = make_loader(data, "val", imgsz, batch_size, backend.stride, workers=workers, rect=rect,
                           prefix=f"{desc}: ", group=RECT_GROUP)
        if loaders is not None and num_images is None:
            loaders[key] = made
    loader, dataset = made
    limit = len(dataset) if num_images is None else min(num_images, len(dataset))
    filled = itertools.accumulate(batch_lengths(loader))
    n_batches = next((i + 1 for i, n in enumerate(filled) if n >= limit), 0)

    def batches():
        for i, (im, targets, *rest) in enumerate(progress(loader, total=n_batches, desc=desc)):
            if i >= n_batches:
                return
            im = im.to(backend.device).float() / 255
            height, width = im.shape[2:]
            targets[:, 2:] *= torch.tensor((width, height, width, height))
            yield (im, targets, *rest)
    return limit, batches()


def evaluate(backend: Backend, data: dict, *, task: str = "detect", imgsz: int = 640, batch_size: int = 16,
             conf_thres: float = 0.001, iou_thres: float = 0.7, max_det: int = 300, workers: int = 8,
             num_images: int | None = None, save_json: str | Path | None = None,
             desc: str = "evaluating", loaders: dict | None = None) -> Metrics:
    """Score ``backend`` on the ``val`` split of ``data`` (a dict from ``load_data_yaml``): boxes, and for
    ``task == "segment"`` masks too (the dataset needs polygon labels). ``save_json``: COCO-style predictions.
    ``loaders``: val loaders kept from one evaluation to the next (:func:`val_batches`)."""
    from utils.general import scale_boxes, xywh2xyxy
    from utils.metrics import box_iou

    names = backend.names or data["names"]
    hooks_class = SegmentHooks if task == "segment" else DetectHooks
    hooks = hooks_class(len(names), conf_thres=conf_thres, iou_thres=iou_thres, max_det=max_det,
                        save_json=bool(save_json))
    iouv = torch.linspace(0.5, 0.95, 10)
    images: list[ImageStats] = []
    jdict: list[dict] = []
    seen = 0
    start = time.time()
    limit, batches = val_batches(backend, data, functools.partial(dataloader, masks=hooks.masks), imgsz=imgsz,
                                 batch_size=batch_size, workers=workers, num_images=num_images, desc=desc,
                                 loaders=None if loaders is None else loaders.setdefault(task, {}))
    for im, targets, paths, shapes, *extra in batches:
        dets = hooks.detections(backend(im), im.shape[2:])
        for si, det in enumerate(dets):
            if seen >= limit:
                break
            seen += 1
            det = det.cpu().float()
            in_image = targets[:, 0] == si
            labels = targets[in_image, 1:]
            nl, npr = labels.shape[0], det.shape[0]
            image = ImageStats(str(paths[si]))
            images.append(image)
            if npr == 0:
                if nl:
                    image.box = (torch.zeros(0, len(iouv), dtype=torch.bool), torch.zeros(0), torch.zeros(0), labels[:, 0])
                    image.mask = image.box if hooks.masks else None
                continue
            predn = det.clone()
            scale_boxes(im[si].shape[1:], predn[:, :4], shapes[si][0], shapes[si][1])
            correct = torch.zeros(npr, len(iouv), dtype=torch.bool)
            if nl:
                tbox = xywh2xyxy(labels[:, 1:5])
                scale_boxes(im[si].shape[1:], tbox, shapes[si][0], shapes[si][1])
                correct = match(box_iou(tbox, predn[:, :4]), labels[:, 0], det[:, 5], iouv)
            image.box = (correct, det[:, 4], det[:, 5], labels[:, 0])
            correct_masks = hooks.image(si, det, labels, extra[0][in_image] if extra else None, iouv)
            if correct_masks is not None:
                image.mask = (correct_masks, det[:, 4], det[:, 5], labels[:, 0])
            if save_json:
                stem = Path(paths[si]).stem
                jdict.extend(hooks.records(predn, int(stem) if stem.isnumeric() else stem, shapes[si]))
    seconds = time.time() - start
    metrics = score_images(images, names, hooks.masks)
    metrics.seconds = seconds
    metrics.halves = split_halves(images, names, hooks.masks)
    metrics.per_image = images
    if save_json:
        write_text(save_json, json.dumps(jdict))
    return metrics


def score_images(images: Sequence[ImageStats], names: dict, masks: bool) -> Metrics:
    """Box (and with ``masks``, mask) scores of ``images``, one ``ap_per_class`` each."""
    metrics = Metrics(images=len(images))
    metrics.box, metrics.instances = summarize([i.box for i in images if i.box is not None], names)
    if masks:
        metrics.mask = summarize([i.mask for i in images if i.mask is not None], names)[0]
    return metrics


def split_halves(images: Sequence[ImageStats], names: dict, masks: bool) -> dict[str, Metrics]:
    """:func:`score_images` of each half of ``images`` (:func:`half_of`)."""
    half = half_of([i.path for i in images])
    return {h: score_images([i for i, x in zip(images, half) if x == h], names, masks) for h in HALVES}


def summarize(stats: list[tuple], names: dict) -> tuple[Scores, int]:
    """Scores and the number of labelled instances from per-image ``(correct, conf, pred_cls, target_cls)``
    tuples, with upstream's ``ap_per_class`` (P and R at the best mean F1, AP by 101-point interpolation)."""
    from utils.metrics import ap_per_class
    scores, instances = Scores(), 0
    if stats:
        cat = [torch.cat(x, 0).numpy() for x in zip(*stats)]
        instances = int(len(cat[3]))
        if cat[0].any():
            _, _, p, r, _, ap, ap_class = ap_per_class(*cat, plot=False, names=names)
            ap50, ap = ap[:, 0], ap.mean(1)
            scores = Scores(P=float(p.mean()), R=float(r.mean()), mAP50=float(ap50.mean()), mAP50_95=float(ap.mean()),
                            per_class={names.get(int(c), str(int(c))): float(a) for c, a in zip(ap_class, ap)})
    return scores, instances
