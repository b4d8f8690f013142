"""Box and mask mAP for segmentation models, on every backend (PyTorch, ONNX Runtime, TensorRT).

The metric definitions are upstream ``segment/val.py``'s as it runs by itself: upstream's segmentation
dataloader (one mask per instance at input resolution, letterbox, rect batches), NMS with mask
coefficients, masks as ``sigmoid(coefficients @ prototypes)`` cropped to their box at prototype
resolution (``process_mask``; the ground truth is resized to it), greedy IoU matching at 0.50:0.95, and
``ap_per_class`` for boxes and for masks. As upstream, saving COCO JSON switches to masks upsampled to the
input size before cropping (``process_mask_upsample``), which scores a little differently. The loop is written here (a few lines) rather than imported from
``segment/val.py``, which some YOLOv9 trees do not have.

End2End graphs give ``det_masks`` (each detection's mask pooled inside its box at R x R); they are
pasted back into the image (bilinear, > 0.5) and scored the same way.
"""
from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from utils.qat.atomic import write_text
from utils.qat.data import dataloader
from utils.qat.errors import QATError
from utils.qat.evaluate import Metrics, end2end_detections, summarize, val_batches

PROTO_STRIDE = 4  # every YOLOv9 segmentation head has its prototypes at 1/4 of the input


@dataclass
class SegMetrics(Metrics):
    """Mask metrics in the fields every evaluator has (the primary numbers: they name checkpoints and pick
    the best QAT epoch), the box metrics in ``box``."""
    box: Metrics = field(default_factory=Metrics)

    @property
    def mask(self) -> Metrics:
        return Metrics(self.P, self.R, self.mAP50, self.mAP50_95, self.images, self.instances, self.seconds,
                       self.per_class)


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


def paste_masks(masks: torch.Tensor, boxes: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(n, R, R) box-relative masks (End2End ``det_masks``) -> (n, H, W) binary masks in the image: each is
    resampled bilinearly onto the pixels of its box (pixel centres; edge values extend to the box edge), zero
    outside the box, then thresholded at 0.5."""
    n = masks.shape[0]
    h, w = shape
    if n == 0:
        return torch.zeros((0, h, w), dtype=torch.float32)
    x1, y1, x2, y2 = (boxes[:, i, None] for i in range(4))
    xs = torch.arange(w, dtype=torch.float32)[None] + 0.5
    ys = torch.arange(h, dtype=torch.float32)[None] + 0.5
    gx = (xs - x1) / (x2 - x1).clamp(min=1e-6) * 2 - 1  # (n, W), -1 / 1 at the box edges
    gy = (ys - y1) / (y2 - y1).clamp(min=1e-6) * 2 - 1  # (n, H)
    grid = torch.stack([gx[:, None, :].expand(n, h, w), gy[:, :, None].expand(n, h, w)], -1)
    pasted = F.grid_sample(masks[:, None].float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    inside = (gx.abs() <= 1)[:, None, :] & (gy.abs() <= 1)[:, :, None]
    return ((pasted[:, 0] > 0.5) & inside).float()


def evaluate_seg(backend, data: dict, *, imgsz: int = 640, batch_size: int = 16, conf_thres: float = 0.001,
                 iou_thres: float = 0.7, max_det: int = 300, workers: int = 8, num_images: int | None = None,
                 save_json: str | Path | None = None, desc: str = "evaluating") -> SegMetrics:
    """Box and mask metrics of ``backend`` on the ``val`` split of ``data`` (polygon labels)."""
    from utils.general import non_max_suppression, scale_boxes, xywh2xyxy
    from utils.metrics import box_iou
    from utils.segment.general import mask_iou, process_mask, process_mask_upsample

    if save_json:
        _rle_encoder()  # a missing pycocotools stops here, before any work
    names = backend.names or data["names"]
    nc = len(names)
    iouv = torch.linspace(0.5, 0.95, 10)
    box_stats, mask_stats, jdict, seen = [], [], [], 0
    start = time.time()
    limit, batches = val_batches(backend, data, functools.partial(dataloader, masks=True), imgsz=imgsz,
                                 batch_size=batch_size, workers=workers, num_images=num_images, desc=desc)
    for im, targets, paths, shapes, masks in batches:
        height, width = im.shape[2:]
        out = backend(im)
        if isinstance(out, dict):
            if "det_masks" not in out:
                raise QATError("this End2End graph has no det_masks output; export the segmentation model with "
                               "export_qat.py --include onnx_end2end (it adds det_masks), or evaluate with "
                               "--task detect for boxes only.")
            dets, protos = end2end_detections(out), None
            r = int(round(out["det_masks"].shape[-1] ** 0.5))
            box_masks = [out["det_masks"][i, :len(d)].reshape(-1, r, r).cpu() for i, d in enumerate(dets)]
        else:
            pred, protos = out
            nm = pred.shape[1] - 4 - nc
            if nm <= 0 or protos is None:
                raise QATError(f"the model's output has {pred.shape[1] - 4} class/mask rows for {nc} classes: it "
                               "is not a segmentation model for this dataset; use qat.py / val_trt.py --task detect.")
            dets = non_max_suppression(pred, conf_thres, iou_thres, multi_label=True, max_det=max_det, nm=nm)
        for si, det in enumerate(dets):
            if seen >= limit:
                break
            seen += 1
            det = det.cpu().float()
            labels = targets[targets[:, 0] == si, 1:]
            nl, npr = labels.shape[0], det.shape[0]
            if npr == 0:
                if nl:
                    empty = torch.zeros(0, len(iouv), dtype=torch.bool)
                    for stats in (box_stats, mask_stats):
                        stats.append((empty, torch.zeros(0), torch.zeros(0), labels[:, 0]))
                continue
            if protos is not None:
                process = process_mask_upsample if save_json else process_mask
                pred_masks = process(protos[si].cpu().float(), det[:, 6:], det[:, :4], (height, width))
            else:
                s = 1 if save_json else PROTO_STRIDE
                pred_masks = paste_masks(box_masks[si], det[:, :4] / s, (height // s, width // s))
            predn = det.clone()
            scale_boxes(im[si].shape[1:], predn[:, :4], shapes[si][0], shapes[si][1])
            correct_b = correct_m = torch.zeros(npr, len(iouv), dtype=torch.bool)
            if nl:
                tbox = xywh2xyxy(labels[:, 1:5])
                scale_boxes(im[si].shape[1:], tbox, shapes[si][0], shapes[si][1])
                gt_masks = masks[targets[:, 0] == si].float()
                if gt_masks.shape[1:] != pred_masks.shape[1:]:
                    gt_masks = F.interpolate(gt_masks[None], pred_masks.shape[1:], mode="bilinear",
                                             align_corners=False)[0].gt_(0.5)
                correct_b = match(box_iou(tbox, predn[:, :4]), labels[:, 0], det[:, 5], iouv)
                correct_m = match(mask_iou(gt_masks.view(nl, -1), pred_masks.view(npr, -1)), labels[:, 0], det[:, 5],
                                  iouv)
            box_stats.append((correct_b, det[:, 4], det[:, 5], labels[:, 0]))
            mask_stats.append((correct_m, det[:, 4], det[:, 5], labels[:, 0]))
            if save_json:
                jdict.extend(_json_records(predn, pred_masks, im[si].shape[1:], shapes[si], Path(paths[si])))
    seconds = time.time() - start
    mask = summarize(mask_stats, names, seen, seconds)
    result = SegMetrics(**{f.name: getattr(mask, f.name) for f in fields(Metrics)},
                        box=summarize(box_stats, names, seen, seconds))
    if save_json:
        write_text(save_json, json.dumps(jdict))
    return result


def _json_records(predn: torch.Tensor, masks: torch.Tensor, input_shape, shapes, path: Path) -> list[dict]:
    """COCO-style records with RLE masks in the original image's pixels (needs pycocotools)."""
    from utils.segment.general import scale_image
    encode = _rle_encoder()
    image_id = int(path.stem) if path.stem.isnumeric() else path.stem
    full = scale_image(input_shape, masks.permute(1, 2, 0).contiguous().numpy(), shapes[0], shapes[1])
    box = predn[:, :4].clone()
    box[:, 2:] -= box[:, :2]
    records = []
    for i, (p, b) in enumerate(zip(predn.tolist(), box.tolist())):
        rle = encode(np.asfortranarray(full[:, :, i, None] > 0.5, dtype=np.uint8))[0]
        rle["counts"] = rle["counts"].decode("utf-8")
        records.append({"image_id": image_id, "category_id": int(p[5]), "bbox": [round(x, 3) for x in b],
                        "score": round(p[4], 5), "segmentation": rle})
    return records


def _rle_encoder():
    try:
        from pycocotools.mask import encode
    except ImportError as e:
        raise QATError("--save-json for segmentation writes COCO RLE masks and needs pycocotools; "
                       "pip install pycocotools, or drop --save-json.") from e
    return encode
