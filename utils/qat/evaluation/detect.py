"""What detection scoring needs, for every task: matching predictions to labels (upstream val.py's rule), the
detections of an End2End output, and :class:`DetectHooks`, the evaluator's hooks for boxes (the base of the
segmentation hooks, ``utils.qat.evaluation.evaluate_seg``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from utils.qat.core.artifact import END2END_OUTPUTS

if TYPE_CHECKING:
    from utils.qat.core.yolov9 import Output


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
