"""What QAT fine-tuning minimises: the named objectives behind ``qat.py quantize --qat-loss``.

Student (fake-quantized) and teacher (the FP model) run with the head in training form, so the head
returns its raw per-level maps (box distribution logits and class logits before decoding) instead of
boxes in pixels. The objectives:

``head``      distillation on those raw maps: per anchor, the Bernoulli KL divergence of the student's
              class probabilities from the teacher's, and the KL divergence of its box distributions
              (DFL, ``reg_max`` bins per side) from the teacher's, weighted by the teacher's class
              confidence. Both are normalised by the teacher's foreground mass in the image, so the
              thousands of background anchors neither dominate nor dilute. A segmentation head adds a
              ``masks`` term (``MASK_TERMS``): ``maps`` matches its mask coefficients and prototypes by
              normalised MSE; ``weighted`` weights each anchor's coefficient error by the teacher's class
              confidence, as the box term does; ``assembled`` compares the masks themselves, as the
              evaluation builds them (``sigmoid(coefficients @ prototypes)`` inside the box), for each image's
              most confident anchors of the teacher.
``features``  normalised MSE of the block outputs (every ``supervision_stride``-th block before the head):
              ``mean((s - t)^2) / mean(t^2)`` per block, averaged over blocks.
``task``      upstream's own training loss from the labels (``utils/loss_tal.py`` for DDetect,
              ``loss_tal_dual.py`` for DualDDetect, ``utils/segment/loss_tal*.py`` for segmentation),
              per image.

Every term is a mean over the images of the batch, so in a multi-GPU run the mean of the ranks' losses
is the loss of the whole batch (``task`` excepted: upstream normalises its box terms over the batch).
``mse``       the first recipe of this project, kept for comparison: plain MSE of every supervised block
              output and of the decoded head output (boxes in pixels).

Objectives join with ``+`` (``head+features``, ``task+head``); each term is reported on its own.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

OBJECTIVES = ("head", "features", "head+features", "task", "task+head", "mse")
DEFAULT_OBJECTIVE = "head"
TERMS = ("head", "features", "task", "mse")
MASK_TERMS = ("maps", "weighted", "assembled")
MASK_ANCHORS = 64  # ``assembled``: masks compared per image (the teacher's most confident anchors)


def parse(objective: str) -> list[str]:
    """``"task+head"`` -> ``["task", "head"]``, checked against the known terms."""
    from utils.qat.errors import QATError
    terms = [t.strip() for t in objective.split("+")]
    if objective not in OBJECTIVES or any(t not in TERMS for t in terms):
        raise QATError(f"--qat-loss {objective} is not a QAT objective; choose one of {', '.join(OBJECTIVES)}.")
    return terms


def needs_labels(objective: str) -> bool:
    return "task" in parse(objective)


def head_of(model: nn.Module) -> nn.Module:
    return model.model[-1]


# ---- head distillation ----------------------------------------------------------------------------

def _levels(out) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a training-form head output into detection level maps (B x no x H x W) and other tensors
    (mask coefficients, prototypes). Works for Detect/DDetect (list of levels), DualDDetect ([d1, d2]),
    Segment/DSegment ((levels, mc, p)) and DualDSegment (([d1, d2], [mc1, mc2], [p1, p2]))."""
    from utils.qat.quantize.rules import _tensors
    tensors = _tensors(out)
    return [t for t in tensors if t.dim() == 4], [t for t in tensors if t.dim() != 4]


def head_distillation(student_out, teacher_out, reg_max: int, nc: int, *, stride: torch.Tensor | None = None,
                      masks: str = "maps") -> dict[str, torch.Tensor]:
    """The ``head`` objective's parts: ``cls`` and ``box`` (per image, normalised by the teacher's foreground
    mass, averaged over the batch) and ``masks`` (segmentation only, per ``masks``, one of ``MASK_TERMS``;
    ``assembled`` needs the head's ``stride``)."""
    s_maps, s_other = _levels(student_out)
    t_maps, t_other = _levels(teacher_out)
    s_det = [s for s in s_maps if s.shape[1] == 4 * reg_max + nc]
    t_det = [t for t in t_maps if t.shape[1] == 4 * reg_max + nc]
    extra = [(s, t) for s, t in zip(s_maps, t_maps) if s.shape[1] != 4 * reg_max + nc] + list(zip(s_other, t_other))
    s_all = torch.cat([x.flatten(2) for x in s_det], 2).float()  # B x no x A
    t_all = torch.cat([x.flatten(2) for x in t_det], 2).float()
    s_box, s_cls = s_all.split((4 * reg_max, nc), 1)
    t_box, t_cls = t_all.split((4 * reg_max, nc), 1)
    t_prob = t_cls.sigmoid()
    weight = t_prob.amax(1)  # B x A: how much the teacher thinks an object is there
    mass = weight.sum(1).clamp(min=1.0)  # per image
    # Bernoulli KL(t || s) per class: BCE(s, t) - H(t); exact zero when the logits agree
    cls = (F.binary_cross_entropy_with_logits(s_cls, t_prob, reduction="none")
           - F.binary_cross_entropy_with_logits(t_cls, t_prob, reduction="none")).sum(1)
    b, _, a = s_box.shape
    s_logp = F.log_softmax(s_box.view(b, 4, reg_max, a), 2)
    t_logp = F.log_softmax(t_box.view(b, 4, reg_max, a), 2)
    box = (t_logp.exp() * (t_logp - s_logp)).sum(2).sum(1)  # B x A
    parts = {"cls": (cls.sum(1) / mass).mean(), "box": ((box * weight).sum(1) / mass).mean()}
    if extra:
        if masks not in MASK_TERMS:
            from utils.qat.errors import QATError
            raise QATError(f"unknown masks term '{masks}'; choose one of {', '.join(MASK_TERMS)}.")
        if masks == "maps":
            parts["masks"] = sum(_relative_mse(s, t) for s, t in extra) / len(extra)
        else:
            branches = list(zip(_segment_branches(student_out), _segment_branches(teacher_out)))
            if masks == "weighted":
                terms = [_weighted_coefficients(s_mc, t_mc, _confidence(t_levels, reg_max, nc)) + _relative_mse(s_p, t_p)
                         for (_, s_mc, s_p), (t_levels, t_mc, t_p) in branches]
                parts["masks"] = sum(terms) / (2 * len(terms))
            else:
                if stride is None:
                    raise ValueError("the assembled masks term needs the head's stride")
                terms = [assembled_masks(s_mc, s_p, t_levels, t_mc, t_p, reg_max, nc, stride)
                         for (_, s_mc, s_p), (t_levels, t_mc, t_p) in branches]
                parts["masks"] = sum(terms) / len(terms)
    return parts


def _segment_branches(out) -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]:
    """``(level maps, mask coefficients B x nm x A, prototypes B x nm x h x w)`` per branch of a segmentation
    head's training output: Segment/DSegment ``(levels, mc, p)``, DualDSegment ``([d1, d2], [mc1, mc2], [p1, p2])``."""
    if not (isinstance(out, (tuple, list)) and len(out) == 3):
        return []
    levels, mc, p = out
    if isinstance(mc, torch.Tensor) and isinstance(p, torch.Tensor) and mc.dim() == 3 and p.dim() == 4:
        return [(list(levels), mc, p)]
    if isinstance(mc, (list, tuple)) and isinstance(p, (list, tuple)):
        return [(list(d), m, q) for d, m, q in zip(levels, mc, p)]
    return []


def _confidence(levels: list[torch.Tensor], reg_max: int, nc: int) -> torch.Tensor:
    """B x A: the highest class probability of each anchor (the weight the cls and box terms use)."""
    maps = torch.cat([x.flatten(2) for x in levels], 2).float()
    return maps[:, 4 * reg_max:4 * reg_max + nc].sigmoid().amax(1)


def _weighted_coefficients(s_mc: torch.Tensor, t_mc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each anchor's squared coefficient error weighted by the teacher's confidence there, per image normalised
    by the foreground mass and the teacher's coefficient energy, averaged over the batch."""
    s_mc, t_mc = s_mc.float(), t_mc.float()
    error = (s_mc - t_mc).pow(2).mean(1)  # B x A
    energy = t_mc.pow(2).mean((1, 2)).clamp(min=1e-8)
    mass = weight.sum(1).clamp(min=1.0)
    return ((error * weight).sum(1) / mass / energy).mean()


def _anchor_boxes(levels: list[torch.Tensor], reg_max: int, stride: torch.Tensor) -> torch.Tensor:
    """The boxes the levels' DFL distributions decode to, x1 y1 x2 y2 in input pixels: B x 4 x A."""
    points, strides = [], []
    for x, s in zip(levels, stride.tolist()):
        h, w = x.shape[2:]
        ys, xs = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
        points.append(torch.stack((xs.flatten(), ys.flatten())).float().add(0.5) * s)
        strides.append(torch.full((h * w,), float(s), device=x.device))
    point, step = torch.cat(points, 1), torch.cat(strides)  # 2 x A, A
    maps = torch.cat([x.flatten(2) for x in levels], 2).float()
    b, a = maps.shape[0], maps.shape[2]
    bins = torch.arange(reg_max, device=maps.device, dtype=torch.float32)
    dist = (maps[:, :4 * reg_max].view(b, 4, reg_max, a).softmax(2) * bins.view(1, 1, -1, 1)).sum(2) * step  # l t r b
    return torch.cat((point - dist[:, :2], point + dist[:, 2:]), 1)


def assembled_masks(s_mc: torch.Tensor, s_p: torch.Tensor, t_levels: list[torch.Tensor], t_mc: torch.Tensor,
                    t_p: torch.Tensor, reg_max: int, nc: int, stride: torch.Tensor,
                    anchors: int = MASK_ANCHORS) -> torch.Tensor:
    """The masks as the evaluation forms them, student against teacher: for each image's ``anchors`` most
    confident anchors of the teacher, ``coefficients @ prototypes`` at prototype resolution, compared by the
    per-pixel Bernoulli KL inside the teacher's box (the evaluation crops there), averaged over the box;
    anchors weighted by the teacher's confidence."""
    weight = _confidence(t_levels, reg_max, nc)  # B x A
    w, idx = weight.topk(min(anchors, weight.shape[1]), 1)  # B x K
    boxes = _anchor_boxes(t_levels, reg_max, stride).gather(2, idx.unsqueeze(1).expand(-1, 4, -1))  # B x 4 x K
    scale = t_levels[0].shape[2] * float(stride[0]) / t_p.shape[2]  # input pixels per prototype pixel
    boxes = boxes / scale
    pick = lambda mc: mc.float().gather(2, idx.unsqueeze(1).expand(-1, mc.shape[1], -1))  # noqa: E731
    s_m = torch.einsum("bnk,bnhw->bkhw", pick(s_mc), s_p.float())
    t_m = torch.einsum("bnk,bnhw->bkhw", pick(t_mc), t_p.float())
    h, w_ = t_p.shape[2:]
    cols = torch.arange(w_, device=t_p.device, dtype=torch.float32).view(1, 1, 1, -1)
    rows = torch.arange(h, device=t_p.device, dtype=torch.float32).view(1, 1, -1, 1)
    x1, y1, x2, y2 = (boxes[:, i].unsqueeze(-1).unsqueeze(-1) for i in range(4))
    inside = ((cols >= x1) & (cols < x2) & (rows >= y1) & (rows < y2)).float()  # B x K x h x w
    t_prob = t_m.sigmoid()
    kl = (F.binary_cross_entropy_with_logits(s_m, t_prob, reduction="none")
          - F.binary_cross_entropy_with_logits(t_m, t_prob, reduction="none"))
    per_mask = (kl * inside).sum((2, 3)) / inside.sum((2, 3)).clamp(min=1.0)  # B x K
    return ((per_mask * w).sum(1) / w.sum(1).clamp(min=1e-6)).mean()


def _relative_mse(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Squared error relative to the teacher's energy, per image, averaged over the batch (so that the
    mean over equal shares of a batch, as DistributedDataParallel takes it, is the whole batch's value)."""
    s, t = s.float().flatten(1), t.float().flatten(1)
    return ((s - t).pow(2).mean(1) / t.pow(2).mean(1).clamp(min=1e-8)).mean()


def feature_distillation(student: dict[int, list[torch.Tensor]], teacher: dict[int, list[torch.Tensor]],
                         layers: Sequence[int]) -> torch.Tensor:
    pairs = [(s, t) for i in layers for s, t in zip(student[i], teacher[i])]
    return sum(_relative_mse(s, t) for s, t in pairs) / max(len(pairs), 1)


def legacy_mse(student: dict[int, list[torch.Tensor]], teacher: dict[int, list[torch.Tensor]],
               layers: Sequence[int]) -> torch.Tensor:
    return sum(F.mse_loss(s.float(), t.float()) for i in layers for s, t in zip(student[i], teacher[i]))


# ---- upstream's training loss ---------------------------------------------------------------------

DEFAULT_HYP = {"box": 7.5, "cls": 0.5, "dfl": 1.5, "cls_pw": 1.0, "obj_pw": 1.0, "fl_gamma": 0.0,
               "label_smoothing": 0.0}


def task_loss_fn(model: nn.Module, hyp: dict | None):
    """Upstream's loss for the model's head, as its train.py builds it. Returns ``f(out, targets, masks)``
    giving the loss averaged per image."""
    from utils.qat.errors import QATError
    head = type(head_of(model)).__name__
    model.hyp = {**DEFAULT_HYP, **(hyp or {})}
    if head in ("Segment", "DSegment", "DualDSegment"):
        if head == "DualDSegment":
            from utils.segment.loss_tal_dual import ComputeLoss as SegLoss
        else:
            from utils.segment.loss_tal import ComputeLoss as SegLoss
        seg = SegLoss(model, overlap=False)
        return lambda out, targets, masks: seg(out, targets, masks.float())[0] / out_batch(out)
    if head in ("DualDDetect", "DualDetect"):
        from utils.loss_tal_dual import ComputeLoss
    elif head in ("DDetect", "Detect"):
        from utils.loss_tal import ComputeLoss
    else:
        raise QATError(f"--qat-loss task has no upstream loss for a {head} head; use --qat-loss head.")
    det = ComputeLoss(model)
    return lambda out, targets, masks: det(out, targets)[0] / out_batch(out)


def out_batch(out) -> int:
    from utils.qat.quantize.rules import _tensors
    return int(_tensors(out)[0].shape[0])
