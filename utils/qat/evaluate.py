"""One evaluation loop for every backend (PyTorch FP, fake-quant, ONNX Runtime, TensorRT).

Dataloader, NMS and metrics are upstream YOLOv9's own (``utils.dataloaders``, ``utils.general``,
``utils.metrics``, ``val.process_batch``), so numbers from every backend compare with each other and
with upstream ``val.py``.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from utils.qat.atomic import write_text
from utils.qat.data import dataloader
from utils.qat.progress import progress

@dataclass
class Metrics:
    P: float = 0.0
    R: float = 0.0
    mAP50: float = 0.0
    mAP50_95: float = 0.0
    images: int = 0
    instances: int = 0
    seconds: float = 0.0
    per_class: dict = field(default_factory=dict)


def end2end_detections(out: dict) -> list[torch.Tensor]:
    """End2End outputs -> per-image ``(n, 6)`` tensors ``x1, y1, x2, y2, score, class``."""
    dets = []
    for i in range(out["num_dets"].shape[0]):
        n = int(out["num_dets"][i].reshape(-1)[0])
        dets.append(torch.cat([out["det_boxes"][i, :n].float(), out["det_scores"][i, :n, None].float(),
                               out["det_classes"][i, :n, None].float()], 1))
    return dets


def topk_detections(pred: torch.Tensor, conf_thres: float, max_det: int) -> list[torch.Tensor]:
    """NMS-free decoding: the top ``max_det`` (box, class) scores per image above ``conf_thres``."""
    from utils.general import xywh2xyxy
    dets = []
    nc = pred.shape[1] - 4
    for p in pred:
        boxes, scores = xywh2xyxy(p[:4].T), p[4:].T  # (A, 4), (A, nc)
        flat = scores.flatten()
        k = min(max_det, flat.numel())
        top, idx = flat.topk(k)
        keep = top > conf_thres
        top, idx = top[keep], idx[keep]
        dets.append(torch.cat([boxes[idx // nc], top[:, None], (idx % nc)[:, None].float()], 1))
    return dets


def val_batches(backend, data: dict, make_loader, *, imgsz: int, batch_size: int, workers: int,
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


def evaluate(backend, data: dict, *, imgsz: int = 640, batch_size: int = 16, conf_thres: float = 0.001,
             iou_thres: float = 0.7, max_det: int = 300, workers: int = 8, num_images: int | None = None,
             nms: bool = True, save_json: str | Path | None = None, desc: str = "evaluating") -> Metrics:
    """Score ``backend`` on the ``val`` split of ``data`` (a dict from ``load_data_yaml``)."""
    from utils.general import non_max_suppression, scale_boxes, xywh2xyxy
    from val import process_batch

    names = backend.names or data["names"]
    iouv = torch.linspace(0.5, 0.95, 10)
    stats, jdict, seen = [], [], 0
    start = time.time()
    limit, batches = val_batches(backend, data, dataloader, imgsz=imgsz, batch_size=batch_size, workers=workers,
                                 num_images=num_images, desc=desc)
    for im, targets, paths, shapes in batches:
        out = backend(im)
        if isinstance(out, dict):
            dets = end2end_detections(out)
        elif nms:
            dets = non_max_suppression(out, conf_thres, iou_thres, multi_label=True, max_det=max_det)
        else:
            dets = topk_detections(out, conf_thres, max_det)
        for si, pred in enumerate(dets):
            if seen >= limit:
                break
            seen += 1
            pred = pred.cpu().float()
            labels = targets[targets[:, 0] == si, 1:]
            nl, npr = labels.shape[0], pred.shape[0]
            correct = torch.zeros(npr, len(iouv), dtype=torch.bool)
            if npr == 0:
                if nl:
                    stats.append((correct, torch.zeros(0), torch.zeros(0), labels[:, 0]))
                continue
            predn = pred.clone()
            scale_boxes(im[si].shape[1:], predn[:, :4], shapes[si][0], shapes[si][1])
            if nl:
                tbox = xywh2xyxy(labels[:, 1:5])
                scale_boxes(im[si].shape[1:], tbox, shapes[si][0], shapes[si][1])
                correct = process_batch(predn, torch.cat((labels[:, 0:1], tbox), 1), iouv)
            stats.append((correct, pred[:, 4], pred[:, 5], labels[:, 0]))
            if save_json:
                jdict.extend(_json_records(predn, Path(paths[si])))
    metrics = summarize(stats, names, seen, time.time() - start)
    if save_json:
        write_text(save_json, json.dumps(jdict))
    return metrics


def summarize(stats: list[tuple], names: dict, images: int, seconds: float) -> Metrics:
    """Metrics from per-image ``(correct, conf, pred_cls, target_cls)`` tuples, with upstream's
    ``ap_per_class`` (P and R at the best mean F1, AP by 101-point interpolation)."""
    from utils.metrics import ap_per_class
    metrics = Metrics(images=images, seconds=seconds)
    if stats:
        cat = [torch.cat(x, 0).numpy() for x in zip(*stats)]
        metrics.instances = int(len(cat[3]))
        if cat[0].any():
            _, _, p, r, _, ap, ap_class = ap_per_class(*cat, plot=False, names=names)
            ap50, ap = ap[:, 0], ap.mean(1)
            metrics.P, metrics.R = float(p.mean()), float(r.mean())
            metrics.mAP50, metrics.mAP50_95 = float(ap50.mean()), float(ap.mean())
            metrics.per_class = {names.get(int(c), str(int(c))): float(a) for c, a in zip(ap_class, ap)}
    return metrics


def _json_records(predn: torch.Tensor, path: Path) -> list[dict]:
    """COCO-style detection records (class ids as in the dataset; image id from the file stem)."""
    image_id = int(path.stem) if path.stem.isnumeric() else path.stem
    box = predn[:, :4].clone()
    box[:, 2:] -= box[:, :2]
    return [{"image_id": image_id, "category_id": int(p[5]), "bbox": [round(float(x), 3) for x in b],
             "score": round(float(p[4]), 5)} for p, b in zip(predn.tolist(), box.tolist())]
