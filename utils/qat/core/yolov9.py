"""What the toolkit knows about YOLOv9 models, in one place: the head and its family, what a forward returns,
the stride, and building a model from a yaml (with random weights that keep activations O(1): :func:`reinit`).

A head's family comes from its class name (a checkpoint pickled by another upstream commit brings its own
classes, so names, not ``isinstance``):

- ``detect``: Detect, DDetect; eval mode returns ``(pred, levels)``;
- ``dual detect``: DualDetect, DualDDetect, TripleDetect (``([pred_aux..., pred_main], levels)``) and
  TripleDDetect (``(pred_main, levels)``);
- ``segment``: Segment, DSegment, Panoptic; ``(pred, (levels, coefficients, protos[, semantic]))``;
- ``dual segment``: DualDSegment; ``(pred_main, (levels, coefficients, protos))`` of its main branch.

``pred`` is ``(B, 4 + nc, A)`` (xywh boxes in input pixels, class scores), for segmentation followed by the
mask coefficients; in export mode the heads return ``pred`` alone (dual heads the list of branches) and
segmentation heads ``(pred, protos)``. :func:`outputs` reduces any of these to the main branch's
``(pred,)`` or ``(pred, protos)``; :func:`exported_outputs` does the same for a plain export run by a runtime.
A "dual" head is a training head with auxiliary branches (``reparameterization.py`` removes them).

No torch import at module level: the TensorRT side imports this module on its light paths.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Union

from utils.qat.core.errors import QATError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["FAMILIES", "DEFAULT_STRIDE", "head", "head_name", "family", "is_dual", "task_of_model", "num_classes",
           "Output", "outputs", "exported_outputs", "model_stride", "artifact_stride", "isolated_build", "build",
           "code_in_cfg", "reinit"]

#: Head class name -> family.
FAMILIES: dict[str, str] = {
    "Detect": "detect", "DDetect": "detect",
    "DualDetect": "dual detect", "DualDDetect": "dual detect", "TripleDetect": "dual detect",
    "TripleDDetect": "dual detect",
    "Segment": "segment", "DSegment": "segment", "Panoptic": "segment",
    "DualDSegment": "dual segment",
}
#: Model class name -> task (upstream models/yolo.py).
MODEL_TASKS = {"DetectionModel": "detect", "SegmentationModel": "segment", "ClassificationModel": "classify"}
#: The largest stride of every released YOLOv9 model: assumed (with a warning) for an artifact that does not say.
DEFAULT_STRIDE = 32
#: What a model returns in any runtime (a backend's call): the predictions, ``(pred, protos)`` for segmentation,
#: or End2End's outputs by name.
Output = Union["torch.Tensor", "tuple[torch.Tensor, ...]", "dict[str, torch.Tensor]"]


# ---------------------------------------------------------------------------------------------- the head
def head(model: nn.Module) -> nn.Module | None:
    """The last layer of a YOLOv9 model (its head), None for anything else."""
    from torch import nn
    layers = getattr(model, "model", None)
    return layers[-1] if isinstance(layers, nn.Sequential) and len(layers) else None


def head_name(model: nn.Module) -> str:
    """The class name of the head ('' when the model has none)."""
    h = head(model)
    return type(h).__name__ if h is not None else ""


def family(model: nn.Module) -> str | None:
    """'detect', 'dual detect', 'segment' or 'dual segment' (:data:`FAMILIES`); None for another head."""
    return FAMILIES.get(head_name(model))


def is_dual(model: nn.Module) -> bool:
    """A training head with auxiliary branches (DualDDetect, DualDSegment, Triple...)."""
    return (family(model) or "").startswith("dual")


def task_of_model(model: nn.Module) -> str:
    """'detect', 'segment' or 'classify' from the model's class, else from its head's family; 'unknown' when
    neither says (a model with a stride counts as detection, as upstream's loaders treat it)."""
    task = MODEL_TASKS.get(type(model).__name__)
    if task is None and family(model) is not None:
        task = str(family(model)).removeprefix("dual ")
    return task or ("detect" if hasattr(model, "stride") else "unknown")


def num_classes(model: nn.Module) -> int:
    return int(getattr(head(model), "nc", getattr(model, "nc", 0)))


# ---------------------------------------------------------------------------------------------- outputs
def outputs(raw: Any, task: str) -> tuple[torch.Tensor, ...]:
    """The main branch of what a YOLOv9 model returns (eval or export mode, any family): ``(pred,)``, or
    ``(pred, protos)`` for ``task == "segment"``."""
    import torch
    if torch.is_tensor(raw):
        return (raw,)
    if task == "segment":
        pred, protos = raw[0], raw[1]
        while isinstance(pred, (list, tuple)):  # a list of branches: the main one is the last
            pred = pred[-1]
        if isinstance(protos, (list, tuple)):  # eval mode: (levels, coefficients, protos[, semantic])
            protos = protos[2]
        return pred, protos
    pred = raw
    while isinstance(pred, (list, tuple)):
        # branch predictions (dual, export mode; each B x no x A): the last; else (pred, levels) or a segmentation
        # head's (pred, protos): the first
        branches = len(pred) > 1 and all(torch.is_tensor(p) and p.ndim == 3 for p in pred)
        pred = pred[-1] if branches else pred[0]
    return (pred,)


def exported_outputs(tensors: Sequence[torch.Tensor], task: str) -> tuple[torch.Tensor, ...]:
    """``(pred,)`` or ``(pred, protos)`` from the outputs of a plain export (``output0`` the predictions, rank 3;
    ``output1`` the prototypes, rank 4), in whatever order a runtime lists them."""
    pred = next((t for t in tensors if t.ndim == 3), tensors[0])
    if task == "segment":
        return pred, next((t for t in tensors if t.ndim == 4), tensors[-1])
    return (pred,)


# ---------------------------------------------------------------------------------------------- stride
def model_stride(model: nn.Module) -> int:
    """The largest stride of a YOLOv9 model (a QATError for a model without one)."""
    stride = getattr(model, "stride", None)
    if stride is None:
        raise QATError(f"the model ({type(model).__name__}) has no stride: it is not a YOLOv9 model built by "
                       f"models/yolo.py; pass a YOLOv9 checkpoint.")
    return int(max(stride.tolist()) if hasattr(stride, "tolist") else stride)


def artifact_stride(stride: int | None, source: str | Path, where: str) -> int:
    """The stride an exported graph or engine records, or :data:`DEFAULT_STRIDE` with a warning naming
    ``where`` it should have been (its metadata or sidecar)."""
    if stride is None:
        warnings.warn(f"{where} is missing or has no usable stride (a power of two up to 128); assuming {DEFAULT_STRIDE} for {Path(source).name} "
                      f"(export with export_qat.py and build with scripts/generate_trt_engine.sh to record it).",
                      stacklevel=3)
        return DEFAULT_STRIDE
    return int(stride)


# ---------------------------------------------------------------------------------------------- building
@contextlib.contextmanager
def isolated_build() -> Iterator[None]:
    """Build upstream models from yamls without side effects: upstream's ``parse_model`` sets
    ``Conv.default_act`` (a class attribute) from a yaml's ``activation:`` and leaves it for every model
    built afterwards; this restores every class default afterwards, and quiets the model table."""
    import logging

    import models.common
    from utils.general import LOGGER
    saved = {cls: cls.default_act for cls in vars(models.common).values()
             if isinstance(cls, type) and "default_act" in vars(cls)}
    level = LOGGER.level
    LOGGER.setLevel(logging.WARNING)
    try:
        yield
    finally:
        LOGGER.setLevel(level)
        for cls, act in saved.items():
            cls.default_act = act


def build(cfg: str | Path | dict, nc: int | None = None, task: str = "detect") -> nn.Module:
    """An upstream model (``SegmentationModel`` for ``task == "segment"``, else ``DetectionModel``) from a yaml
    path or dict (``nc`` None: the yaml's), in FP32 with fresh weights, built by :func:`isolated_build`."""
    from models.yolo import DetectionModel, SegmentationModel
    cls = SegmentationModel if task == "segment" else DetectionModel
    with isolated_build():
        return cls(cfg=dict(cfg) if isinstance(cfg, dict) else str(cfg), ch=3, nc=nc)


def _module_class(name: str) -> bool:
    """Whether ``name`` (``Conv``, ``nn.Upsample``) is, as ``parse_model`` looks it up in models.yolo (or in
    models.common / models.experimental, where a tree resolves names so), an ``nn.Module`` class: a dotted name
    with no private parts, resolved by attribute lookups alone."""
    import sys

    import torch.nn as nn

    import models.yolo  # noqa: F401  (and the modules it imports)
    parts = name.split(".")
    if not all(p.isidentifier() and not p.startswith("_") for p in parts):
        return False
    for module in ("models.yolo", "models.common", "models.experimental"):
        obj: Any = sys.modules.get(module)
        for p in parts:
            obj = getattr(obj, p, None)
        if isinstance(obj, type) and issubclass(obj, nn.Module):
            return True
    return False


def _activation(text: str) -> bool:
    """``nn.SiLU()``, ``nn.LeakyReLU(0.1)``: a module class called with constants only."""
    import ast
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError:
        return False
    if not isinstance(call, ast.Call) or not all(isinstance(a, ast.Constant) for a in
                                                 [*call.args, *(k.value for k in call.keywords)]):
        return False
    return _module_class(ast.unparse(call.func)) and all(k.arg for k in call.keywords)


def code_in_cfg(cfg: Any) -> str | None:
    """The first string of a model yaml (a dict) that upstream's ``parse_model`` would run as Python rather than
    look up as a name, described for a sentence (``activation '...'``, ``module '...' of head layer 3``); None
    when there is none. ``parse_model`` evaluates the ``activation`` (``nn.SiLU()``), every module name (``Conv``,
    ``nn.Upsample``) and every string argument (``nc``, ``'nearest'``) with ``eval``, so a yaml that comes from a
    file (a quantized checkpoint's) is checked before :func:`build`: module names must be ``nn.Module`` classes,
    arguments plain names, the activation such a class called with constants."""
    if not isinstance(cfg, dict):
        return None
    act = cfg.get("activation")
    if isinstance(act, str) and act and not _activation(act):
        return f"activation {act!r}"
    for section in ("backbone", "head"):
        layers = cfg.get(section)
        for i, layer in enumerate(layers if isinstance(layers, list) else []):
            if not isinstance(layer, (list, tuple)) or len(layer) != 4:
                continue  # parse_model fails on it before evaluating anything of it
            _, _, module, args = layer
            if isinstance(module, str) and not _module_class(module):
                return f"module {module!r} of {section} layer {i}"
            for a in args if isinstance(args, (list, tuple)) else []:
                if isinstance(a, str) and not (a.isidentifier() and not a.startswith("__")):
                    return f"argument {a!r} of {section} layer {i}"
    return None


def reinit(model: nn.Module, seed: int = 0) -> nn.Module:
    """Re-initialise convs (Kaiming) and BatchNorm (non-trivial statistics) so activations stay O(1); returns
    ``model`` in eval mode. Random weights serve tests and time/memory benchmarks: a default-initialised YOLOv9
    model has activations around 1e-9 deep in the network, below the quantizer's amax epsilon, so fake-quant
    would output zeros."""
    import torch
    from torch import nn
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d) and m.weight.requires_grad:
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(1 + 0.1 * torch.rand(m.running_var.shape, generator=g))
    return model.eval()
