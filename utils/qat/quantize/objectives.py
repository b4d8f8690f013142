"""What QAT fine-tuning minimises: the named objectives behind ``qat.py quantize --qat-loss``.

Student (fake-quantized) and teacher (the FP model) run with the head in training form, so the head
returns its raw per-level maps (box distribution logits and class logits before decoding) instead of
boxes in pixels. The objectives:

``head``      distillation on those raw maps: per anchor, the Bernoulli KL divergence of the student's
              class probabilities from the teacher's, and the KL divergence of its box distributions
              (DFL, ``reg_max`` bins per side) from the teacher's, weighted by the teacher's class
              confidence. Both are normalised by the teacher's foreground mass in the image, so the
              thousands of background anchors neither dominate nor dilute. Mask coefficients and
              prototypes of a segmentation head are matched by normalised MSE.
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


def parse(objective: str) -> list[str]:
    """``"task+head"`` -> ``["task", "head"]``, checked against the known terms."""
    from utils.qat.core.errors import QATError
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
    from utils.qat.quantize.rules import flat_tensors
    tensors = flat_tensors(out)
    return [t for t in tensors if t.dim() == 4], [t for t in tensors if t.dim() != 4]


def head_distillation(student_out, teacher_out, reg_max: int, nc: int) -> dict[str, torch.Tensor]:
    """The ``head`` objective's parts: ``cls`` and ``box`` (per image, normalised by the teacher's foreground
    mass, averaged over the batch) and ``masks`` (mask coefficients and prototypes, segmentation only)."""
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
        parts["masks"] = sum(_relative_mse(s, t) for s, t in extra) / len(extra)
    return parts


class HeadDistillation:
    """:func:`head_distillation` against one fixed teacher output, called for many students (the amax search's
    candidates, each of which moves one branch of the head):

        loss = HeadDistillation(teacher_out, reg_max, nc)
        parts = loss(student_out)          # the same values, in every bit, as head_distillation(student_out, ...)

    The teacher's terms (class probabilities and their entropy, box log-distributions, the anchor weights and the
    foreground mass) are computed once. Each level's per-anchor box and class terms are kept from the last call and
    computed again only where that part of the level's map changed (compared element for element): a candidate
    that moves one branch recomputes one part of one level. The per-anchor terms are the same elementwise and
    per-anchor reductions as in :func:`head_distillation`, and the sums over the anchors run over the same
    concatenation, so the value is the same in every bit (tests/test_quantize_head.py)."""

    def __init__(self, teacher_out, reg_max: int, nc: int):
        self.reg_max, self.nc = reg_max, nc
        t_maps, t_other = _levels(teacher_out)
        det = 4 * reg_max + nc
        self.t_extra = [t for t in t_maps if t.shape[1] != det] + t_other
        self.levels = []
        for t in (t for t in t_maps if t.shape[1] == det):
            t_box, t_cls = t.flatten(2).float().split((4 * reg_max, nc), 1)
            b, _, a = t_box.shape
            prob = t_cls.sigmoid()
            logp = F.log_softmax(t_box.view(b, 4, reg_max, a), 2)
            entropy = F.binary_cross_entropy_with_logits(t_cls, prob, reduction="none")
            self.levels.append({"prob": prob, "entropy": entropy, "logp": logp, "p": logp.exp()})
        self.weight = torch.cat([level["prob"].amax(1) for level in self.levels], 1)  # B x A, as head_distillation's
        self.mass = self.weight.sum(1).clamp(min=1.0)
        self.kept: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.levels]

    def _term(self, i: int, part: str, student: torch.Tensor) -> torch.Tensor:
        """Level ``i``'s per-anchor ``part`` term (B x A_i) for the student's map of that part (B x C x H x W)."""
        kept = self.kept[i].get(part)
        if kept is not None and kept[0].shape == student.shape and torch.equal(kept[0], student):
            return kept[1]
        t = self.levels[i]
        s = student.flatten(2).float()
        if part == "cls":
            term = (F.binary_cross_entropy_with_logits(s, t["prob"], reduction="none") - t["entropy"]).sum(1)
        else:
            b, _, a = s.shape
            term = (t["p"] * (t["logp"] - F.log_softmax(s.view(b, 4, self.reg_max, a), 2))).sum(2).sum(1)
        self.kept[i][part] = (student, term)
        return term

    def __call__(self, student_out) -> dict[str, torch.Tensor]:
        s_maps, s_other = _levels(student_out)
        det = 4 * self.reg_max + self.nc
        s_det = [s for s in s_maps if s.shape[1] == det]
        cls = torch.cat([self._term(i, "cls", s[:, 4 * self.reg_max:]) for i, s in enumerate(s_det)], 1)
        box = torch.cat([self._term(i, "box", s[:, :4 * self.reg_max]) for i, s in enumerate(s_det)], 1)
        parts = {"cls": (cls.sum(1) / self.mass).mean(), "box": ((box * self.weight).sum(1) / self.mass).mean()}
        extra = [s for s in s_maps if s.shape[1] != det] + s_other
        if extra:
            parts["masks"] = sum(_relative_mse(s, t) for s, t in zip(extra, self.t_extra)) / len(extra)
        return parts


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
    from utils.qat.core.errors import QATError
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
    from utils.qat.quantize.rules import flat_tensors
    return int(flat_tensors(out)[0].shape[0])
