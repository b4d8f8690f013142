"""One evaluation loop for every backend (PyTorch FP, fake-quant, ONNX Runtime, TensorRT) and every task.

The loop (:func:`evaluate`) is dataloader -> backend -> detections -> matching -> metrics; a task changes
its hooks only: :class:`DetectHooks` (boxes), ``utils.qat.evaluate_seg.SegmentHooks`` (boxes, then masks).
Dataloader, NMS and ``ap_per_class`` are upstream YOLOv9's own (``utils.dataloaders``, ``utils.general``,
``utils.metrics``), and :func:`match` is upstream val.py's ``process_batch`` rule (tests/test_segment.py
checks them equal), so numbers from every backend compare with each other and with upstream ``val.py``.

The result, :class:`Metrics`, holds box :class:`Scores` and, for segmentation, mask scores. In code the
number that ranks models is ``mAP50_95`` (mAP over IoU 0.50:0.95); report.json calls it ``AP``, and
``mAP50-95`` in its Box / Mask groups (``utils.qat.reports``).
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from utils.qat.artifact import END2END_OUTPUTS
from utils.qat.atomic import write_text
from utils.qat.data import dataloader
from utils.qat.progress import progress

if TYPE_CHECKING:
    from utils.qat.backends import Backend
    from utils.qat.yolov9 import Output


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
    """What one evaluation measured: ``box`` scores, ``mask`` scores for segmentation (None otherwise)."""
    box: Scores = field(default_factory=Scores)
    mask: Scores | None = None
    images: int = 0
    instances: int = 0
    seconds: float = 0.0

    @property
    def primary(self) -> Scores:
        """The scores that rank models (name checkpoints, pick the best QAT epoch): the masks' for segmentation."""
        return self.mask if self.mask is not None else self.box

    # the primary numbers, as the callers that rank models (checkpoint names, epochs, benchmarks) read them
    mAP50 = property(lambda self: self.primary.mAP50)
    mAP50_95 = property(lambda self: self.primary.mAP50_95)


def match(iou: torch.Tensor, label_cls: torch.Tensor, pred_cls: torch.Tensor, iouv: torch.Tensor) -> torch.Tensor:
    """Correct-prediction matrix (n_pred, n_iou): at each IoU threshold, each label is matched to at most one
    prediction of its class, highest IoU first (upstream's rule). ``iou`` is (n_label, n_pred)."""
    correct = np.zeros((iou.shape[1], len(iouv)), dtype=bool)
    same_class = label_cls[:, None] == pred_cls[None]
    for i, t in enumerate(iouv.tolist()):
        li, pi = torch.where((iou >= t) & same_class)
        if li.numel():
            m = torch.stack([li.float(), pi.float(), iou[li, pi]], 1).cpu().numpy()
            if li.numel() > 1:
                m = m[m[:, 2].argsort()[::-1]]
                m = m[np.unique(m[:, 1], return_index=True)[1]]
                m = m[np.unique(m[:, 0], return_index=True)[1]]
            correct[m[:, 1].astype(int), i] = True
    return torch.from_numpy(correct)


def end2end_detections(out: dict) -> list[torch.Tensor]:
    """End2End outputs -> per-image ``(n, 6)`` tensors ``x1, y1, x2, y2, score, class``."""
    num_dets, boxes, scores, classes = (out[k] for k in END2END_OUTPUTS)
    dets = []
    for i in range(num_dets.shape[0]):
        n = int(num_dets[i].reshape(-1)[0])
        dets.append(torch.cat([boxes[i, :n].float(), scores[i, :n, None].float(), classes[i, :n, None].float()], 1))
    return dets


class DetectHooks:
    """Detection: boxes, the part of the loop every task has. A task subclass adds instance masks to the
    dataloader (``masks``) and scores them in :meth:`image`."""
    masks = False

    def __init__(self, nc: int, *, conf_thres: float, iou_thres: float, max_det: int, save_json: bool):
        self.nc, self.conf_thres, self.iou_thres, self.max_det = nc, conf_thres, iou_thres, max_det
        self.save_json = save_json

    def detections(self, out: Output, shape: tuple[int, int]) -> list[torch.Tensor]:
        """Per-image detections ``(n, 6 + ...)``: x1, y1, x2, y2 in input pixels (``shape``), score, class.
        A segmentation model's output is scored for its boxes (its masks and mask coefficients left out)."""
        from utils.general import non_max_suppression
        if isinstance(out, dict):
            return end2end_detections(out)
        if isinstance(out, tuple):  # (pred, protos): the rows after 4 + nc are mask coefficients, not classes
            out = out[0][:, :4 + self.nc]
        return non_max_suppression(out, self.conf_thres, self.iou_thres, multi_label=True, max_det=self.max_det)

    def image(self, i: int, det: torch.Tensor, labels: torch.Tensor, gt_masks: torch.Tensor | None,
              iouv: torch.Tensor) -> torch.Tensor | None:
        """The correct-mask matrix of image ``i`` of the batch (None: the task has no masks)."""
        return None

    def records(self, predn: torch.Tensor, image_id: int | str, shapes) -> list[dict]:
        """COCO-style detection records of one image (class ids as in the dataset), boxes ``predn`` in its pixels
        (``shapes``: the dataloader's original shape and letterbox of the image)."""
        box = predn[:, :4].clone()
        box[:, 2:] -= box[:, :2]
        return [{"image_id": image_id, "category_id": int(p[5]), "bbox": [round(float(x), 3) for x in b],
                 "score": round(float(p[4]), 5)} for p, b in zip(predn.tolist(), box.tolist())]


def val_batches(backend: Backend, data: dict, make_loader, *, imgsz: int, batch_size: int, workers: int,
                num_images: int | None, desc: str):
    """The val split as ``backend`` takes it: ``(limit, batches)``, ``limit`` the number of images to score and
    ``batches`` yielding ``(images, targets, paths, shapes, *rest)`` of upstream's dataloader
    (``make_loader``), images float in [0, 1] on the backend's device, target boxes in input pixels, with a
    progress bar, for as many batches as ``limit`` images fill. Fixed-size graphs and engines get their own
    batch size and input size (letterboxed squares); others get upstream's rect batches."""
    rect = backend.imgsz is None and backend.batch_size is None
    if backend.batch_size is not None:
        batch_size = backend.batch_size
    if backend.imgsz is not None:
        imgsz = max(backend.imgsz)
    loader, dataset = make_loader(data, "val", imgsz, batch_size, backend.stride, workers=workers, rect=rect,
                                  prefix=f"{desc}: ")
    limit = len(dataset) if num_images is None else min(num_images, len(dataset))
    n_batches = (limit + batch_size - 1) // batch_size

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
             desc: str = "evaluating") -> Metrics:
    """Score ``backend`` on the ``val`` split of ``data`` (a dict from ``load_data_yaml``): boxes, and for
    ``task == "segment"`` masks too (the dataset needs polygon labels). ``save_json``: COCO-style predictions."""
    from utils.general import scale_boxes, xywh2xyxy
    from utils.metrics import box_iou

    names = backend.names or data["names"]
    hooks_class = DetectHooks
    if task == "segment":
        from utils.qat.evaluate_seg import SegmentHooks as hooks_class
    hooks = hooks_class(len(names), conf_thres=conf_thres, iou_thres=iou_thres, max_det=max_det,
                        save_json=bool(save_json))
    iouv = torch.linspace(0.5, 0.95, 10)
    box_stats: list[tuple] = []
    mask_stats: list[tuple] = []
    jdict: list[dict] = []
    seen = 0
    start = time.time()
    limit, batches = val_batches(backend, data, functools.partial(dataloader, masks=hooks.masks), imgsz=imgsz,
                                 batch_size=batch_size, workers=workers, num_images=num_images, desc=desc)
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
            if npr == 0:
                if nl:
                    empty = (torch.zeros(0, len(iouv), dtype=torch.bool), torch.zeros(0), torch.zeros(0), labels[:, 0])
                    box_stats.append(empty)
                    if hooks.masks:
                        mask_stats.append(empty)
                continue
            predn = det.clone()
            scale_boxes(im[si].shape[1:], predn[:, :4], shapes[si][0], shapes[si][1])
            correct = torch.zeros(npr, len(iouv), dtype=torch.bool)
            if nl:
                tbox = xywh2xyxy(labels[:, 1:5])
                scale_boxes(im[si].shape[1:], tbox, shapes[si][0], shapes[si][1])
                correct = match(box_iou(tbox, predn[:, :4]), labels[:, 0], det[:, 5], iouv)
            box_stats.append((correct, det[:, 4], det[:, 5], labels[:, 0]))
            correct_masks = hooks.image(si, det, labels, extra[0][in_image] if extra else None, iouv)
            if correct_masks is not None:
                mask_stats.append((correct_masks, det[:, 4], det[:, 5], labels[:, 0]))
            if save_json:
                stem = Path(paths[si]).stem
                jdict.extend(hooks.records(predn, int(stem) if stem.isnumeric() else stem, shapes[si]))
    seconds = time.time() - start
    metrics = Metrics(images=seen, seconds=seconds)
    metrics.box, metrics.instances = summarize(box_stats, names)
    if hooks.masks:
        metrics.mask = summarize(mask_stats, names)[0]
    if save_json:
        write_text(save_json, json.dumps(jdict))
    return metrics


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
