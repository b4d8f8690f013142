"""What segmentation adds to the evaluation loop (``utils.qat.evaluation.evaluate``): mask mAP, on every backend.

The definitions are upstream ``segment/val.py``'s as it runs by itself: upstream's segmentation dataloader
(one mask per instance at input resolution, letterbox, rect batches), NMS with mask coefficients, masks as
``sigmoid(coefficients @ prototypes)`` cropped to their box at prototype resolution (``process_mask``; the
ground truth is resized to it), the same matching as boxes at IoU 0.50:0.95, and ``ap_per_class``. As
upstream, saving COCO JSON switches to masks upsampled to the input size before cropping
(``process_mask_upsample``), which scores a little differently. Written here (a few lines) rather than
imported from ``segment/val.py``, which some YOLOv9 trees do not have.

End2End graphs give ``det_masks`` (each detection's mask pooled inside its box at R x R); they are
pasted back into the image (bilinear, > 0.5) and scored the same way.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from utils.qat.core.artifact import MASK_OUTPUT
from utils.qat.core.errors import QATError
from utils.qat.evaluation.detect import DetectHooks, end2end_detections, match

PROTO_STRIDE = 4  # every YOLOv9 segmentation head has its prototypes at 1/4 of the input


class SegmentHooks(DetectHooks):
    """Boxes as detection scores them, then each image's masks: from the prototypes (plain outputs) or from
    End2End's ``det_masks``. Keeps the batch's prototypes / masks and the image's predicted masks in between."""
    masks = True

    def __init__(self, nc: int, **kw):
        super().__init__(nc, **kw)
        if self.save_json:
            _rle_encoder()  # a missing pycocotools stops here, before any work
        self.shape: tuple[int, int] = (0, 0)
        self.protos: torch.Tensor | None = None
        self.box_masks: list[torch.Tensor] = []
        self.pred_masks = torch.zeros(0)

    def detections(self, out, shape: tuple[int, int]) -> list[torch.Tensor]:
        from utils.general import non_max_suppression
        self.shape = (int(shape[0]), int(shape[1]))
        if isinstance(out, dict):
            if MASK_OUTPUT not in out:
                raise QATError(f"this End2End graph has no {MASK_OUTPUT} output; export the segmentation model with "
                               f"export_qat.py --include onnx_end2end (it adds {MASK_OUTPUT}), or evaluate with "
                               "--task detect for boxes only.")
            dets, self.protos = end2end_detections(out), None
            r = int(round(out[MASK_OUTPUT].shape[-1] ** 0.5))
            self.box_masks = [out[MASK_OUTPUT][i, :len(d)].reshape(-1, r, r).cpu() for i, d in enumerate(dets)]
            return dets
        pred, protos = out if isinstance(out, tuple) else (out, None)
        nm = pred.shape[1] - 4 - self.nc
        if nm <= 0 or protos is None:
            raise QATError(f"the model's output has {pred.shape[1] - 4} class/mask rows for {self.nc} classes: it "
                           "is not a segmentation model for this dataset; use qat.py / val_trt.py --task detect.")
        self.protos = protos
        return non_max_suppression(pred, self.conf_thres, self.iou_thres, multi_label=True, max_det=self.max_det,
                                   nm=nm)

    def image(self, i: int, det: torch.Tensor, labels: torch.Tensor, gt_masks: torch.Tensor | None,
              iouv: torch.Tensor) -> torch.Tensor:
        from utils.segment.general import mask_iou, process_mask, process_mask_upsample
        height, width = self.shape
        if self.protos is not None:
            process = process_mask_upsample if self.save_json else process_mask
            self.pred_masks = process(self.protos[i].cpu().float(), det[:, 6:], det[:, :4], (height, width))
        else:
            s = 1 if self.save_json else PROTO_STRIDE
            self.pred_masks = paste_masks(self.box_masks[i], det[:, :4] / s, (height // s, width // s))
        nl, npr = labels.shape[0], det.shape[0]
        if not nl:
            return torch.zeros(npr, len(iouv), dtype=torch.bool)
        assert gt_masks is not None  # the dataloader of a task with masks yields them
        gt = gt_masks.float()
        if gt.shape[1:] != self.pred_masks.shape[1:]:
            gt = F.interpolate(gt[None], self.pred_masks.shape[1:], mode="bilinear", align_corners=False)[0].gt_(0.5)
        return match(mask_iou(gt.view(nl, -1), self.pred_masks.view(npr, -1)), labels[:, 0], det[:, 5], iouv)

    def records(self, predn: torch.Tensor, image_id: int | str, shapes) -> list[dict]:
        """Box records with the image's masks as COCO RLE in the original image's pixels (needs pycocotools)."""
        from utils.segment.general import scale_image
        encode = _rle_encoder()
        records = super().records(predn, image_id, shapes)
        full = scale_image(self.shape, self.pred_masks.permute(1, 2, 0).contiguous().numpy(), shapes[0], shapes[1])
        for i, record in enumerate(records):
            rle = encode(np.asfortranarray(full[:, :, i, None] > 0.5, dtype=np.uint8))[0]
            rle["counts"] = rle["counts"].decode("utf-8")
            record["segmentation"] = rle
        return records


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


def _rle_encoder():
    try:
        from pycocotools.mask import encode
    except ImportError as e:
        raise QATError("--save-json for segmentation writes COCO RLE masks and needs pycocotools; "
                       "pip install pycocotools, or drop --save-json.") from e
    return encode
