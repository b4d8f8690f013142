"""The numbers a loaded model computes with, checked before it computes: finite, and positive where the math needs it.

The loader already refuses a file whose numbers would size an allocation (``utils.qat.model.bounds``); a file whose
weights or scales are NaN, infinite or of the wrong sign loads as well as a genuine one and then scores mAP 0, or
exports a graph with NaN scales. Every checkpoint a command loads goes through one of two functions, called from the
two loaders every command uses (``checkpoint.load_quantized``, ``checkpoint.load_fp``) and from
``reparam.load_training_model``:

    check_quantized(ckpt, source)   # a quantized checkpoint's stored numbers, before its model is built
    check_fp(model, source)         # an FP checkpoint's model: its parameters, buffers and BatchNorm statistics

What is checked, and why:

- every floating-point tensor (weights, biases, quantizer amax, BatchNorm running mean and variance, any buffer):
  finite. One NaN spreads to every output it reaches.
- a quantizer's amax (``*_quantizer._amax``, the scale is ``amax / 127``): never negative (modelopt refuses negative
  amax, TensorRT a non-positive scale). An activation quantizer's amax is positive: calibration on real images never
  makes 0, and a 0 becomes a scale of 1 (``qdq.qdq_scale``), which rounds every activation to an integer. A weight
  quantizer's per-channel amax may be 0 only where that channel's weights are all 0 (what max calibration makes of
  an all-zero channel: modelopt quantizes it to 0); none of the reference models has such a channel.
- a BatchNorm's running variance: not negative, and its ``eps`` positive (the layer divides by ``sqrt(var + eps)``).
- the numeric properties modelopt restores a quantizer with (its state in ``modelopt_state``): finite; the
  checkpoint's ``stride``: finite and positive (the evaluator and the exporter size anchors with it).

A quantizer that is disabled (a layer kept in FP) computes nothing, and its amax, if stored, is not checked. A file
that fails is one :class:`QATError` sentence naming the file, the tensor and a fix that can succeed: quantizing the FP
weights the checkpoint records again (or the run's PTQ checkpoint, made before fine-tuning), or for damaged FP weights
an earlier checkpoint of their training, since quantizing cannot repair them.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

from utils.qat.core.errors import QATError

SCRIPTS = {"segment": "segment/qat_seg.py"}  # the CLI that quantizes a task's models (qat.py otherwise)


def _role(name: str) -> str:
    """What the tensor ``name`` is, for the sentence."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "_amax":
        return "the scale (amax) of " + ("a weight quantizer" if "weight_quantizer" in name else "an activation quantizer")
    return {"weight": "a layer's weights", "bias": "a layer's bias", "running_mean": "a BatchNorm's running mean",
            "running_var": "a BatchNorm's running variance"}.get(leaf, "a tensor of the model")


def _count(mask: torch.Tensor, what: str) -> str:
    n, total = int(mask.sum()), mask.numel()
    return what if total == 1 else f"{what} in {n} of its {total} values"


def _spans_storage(t: torch.Tensor) -> bool:
    """``t`` holds no more elements than its storage: not a few stored values repeated through zero strides (which
    ``safe_load`` refuses as the file is read, unless ``--trust-weights``), so checking it allocates no more than the
    file holds."""
    return t.numel() <= t.untyped_storage().nbytes() // max(t.element_size(), 1) - t.storage_offset()


def _stored(t: torch.Tensor) -> torch.Tensor:
    """The values ``t`` reads, as its storage holds them where it repeats them (:func:`_spans_storage`)."""
    if _spans_storage(t):
        return t
    held = max(t.untyped_storage().nbytes() // max(t.element_size(), 1) - t.storage_offset(), 0)
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), (held,))


def _non_finite(t: torch.Tensor) -> str | None:
    """How ``t`` is not finite (``'NaN'``, ``'infinite in 2 of its 64 values'``), or None."""
    t = _stored(t)
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return None
    nan = torch.isnan(t)
    return _count(nan, "NaN") if bool(nan.any()) else _count(~finite, "infinite")


def _not_positive(amax: torch.Tensor, zero_ok: torch.Tensor | None = None) -> str | None:
    """How the quantizer amax ``amax`` does not give a positive float32 scale ``amax / 127`` (``'negative (-0.5)'``,
    ``'0 in 1 of its 32 values'``), or None; ``zero_ok``: where 0 is accepted."""
    negative = amax < 0
    if bool(negative.any()):
        return _count(negative, f"negative ({float(amax[negative].min()):g})")
    zero = amax.float() / 127 == 0  # 0, or so small that the scale is 0 in float32
    if zero_ok is not None:
        zero &= ~zero_ok
    if not bool(zero.any()):
        return None
    tiny = zero & (amax != 0)
    return _count(tiny, f"{float(amax[tiny].max()):g}, which makes a scale of 0") if bool(tiny.any()) else _count(zero, "0")


def _zero_channels(weight: torch.Tensor | None, amax: torch.Tensor) -> torch.Tensor | None:
    """Where a weight quantizer's amax may be 0: the output channels of ``weight`` that are all 0 (None: nowhere)."""
    if weight is None or weight.dim() < 1 or amax.numel() not in (1, weight.shape[0]) or not _spans_storage(weight):
        return None
    if amax.numel() == 1:
        return (weight == 0).all().reshape(amax.shape)
    return (weight.reshape(weight.shape[0], -1) == 0).all(dim=1).reshape(amax.shape)


def quantized_fix(ckpt: Mapping[str, Any]) -> str:
    """What to do about a damaged quantized checkpoint: quantize the FP weights it records again, or use its run's
    PTQ checkpoint where the file is a fine-tuned one (``epoch`` > 0)."""
    script = SCRIPTS.get(str(ckpt.get("task")), "qat.py")
    record = ckpt.get("provenance")
    weights = record.get("weights") if isinstance(record, dict) else None
    fp = f"its FP weights ({weights}, as the file records)" if isinstance(weights, str) and weights else "its FP weights"
    epoch = ckpt.get("epoch")
    if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0:  # a fine-tuned epoch (qat_ep_*, qat_best)
        return (f"the file is damaged (a fine-tuning that diverged, a crash while writing, a corrupted copy): use the "
                f"ptq_* checkpoint its run saved before fine-tuning, or quantize {fp} again with `{script} quantize` "
                f"(a lower --lr if its fine-tuning diverged)")
    return (f"the file is damaged (a crash while writing, a corrupted copy): quantize {fp} again with "
            f"`{script} quantize`")


FP_FIX = ("the file is damaged (a training run that diverged, a corrupted copy), and quantizing it cannot repair it: "
          "use an earlier checkpoint of its training, or copy or download the file again")


def _refuse(source: str, name: str, defect: str, fix: str) -> QATError:
    return QATError(f"{source} was not loaded: its {name} ({_role(name)}) is {defect}; {fix}.")


def _first_defect(name: str, t: torch.Tensor, state: Mapping[str, torch.Tensor]) -> str | None:
    """What is wrong with the stored tensor ``name`` (``state``: the tensors beside it, for a weight quantizer's
    weights), or None."""
    if not t.is_floating_point():
        return None
    defect = _non_finite(t)
    if defect is not None:
        return defect
    t = _stored(t)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "_amax" and name.endswith("_quantizer._amax"):
        zero_ok = None
        if "weight_quantizer" in name and _spans_storage(state[name]):
            zero_ok = _zero_channels(state.get(name.removesuffix("weight_quantizer._amax") + "weight"), t)
        return _not_positive(t, zero_ok)
    if leaf == "running_var":
        negative = t < 0
        return _count(negative, f"negative ({float(t[negative].min()):g})") if bool(negative.any()) else None
    return None


def _disabled(modelopt_state: Any) -> set[str]:
    """The quantizers the checkpoint's modelopt state disables (its last mode's record); none where it is not in the
    form modelopt writes (``bounds.check_modelopt_state`` says so)."""
    modes = modelopt_state.get("modelopt_state_dict") if isinstance(modelopt_state, dict) else None
    if not isinstance(modes, list) or not modes:
        return set()
    last = modes[-1]
    metadata = last[1].get("metadata") if isinstance(last, (tuple, list)) and len(last) == 2 and isinstance(
        last[1], dict) else None
    quantizers = metadata.get("quantizer_state") if isinstance(metadata, dict) else None
    if not isinstance(quantizers, dict):
        return set()
    return {n for n, q in quantizers.items() if isinstance(q, dict) and q.get("_disabled") is True}


def _numbers_of(value: Any) -> Iterable[float]:
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, torch.Tensor) and value.is_floating_point():
        yield from (float(v) for v in value.flatten()[:1024])
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _numbers_of(v)


def _quantizer_properties(modelopt_state: Any) -> Iterable[tuple[str, Any]]:
    """``(quantizer.property, value)`` for the numeric properties of every quantizer modelopt would restore."""
    modes = modelopt_state.get("modelopt_state_dict") if isinstance(modelopt_state, dict) else None
    for entry in modes if isinstance(modes, list) else ():
        metadata = entry[1].get("metadata") if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(
            entry[1], dict) else None
        quantizers = metadata.get("quantizer_state") if isinstance(metadata, dict) else None
        for name, q in (quantizers.items() if isinstance(quantizers, dict) else ()):
            for key, value in (q.items() if isinstance(q, dict) else ()):
                if not key.startswith("_pytorch"):
                    yield f"{name}.{key.lstrip('_')}", value


def check_quantized(ckpt: Mapping[str, Any], source: str) -> None:
    """Every number of a quantized checkpoint that its model computes with (``state_dict``, the quantizers' restored
    properties, ``stride``) is finite, and positive where the math needs it (module docstring); ``source`` names the
    file. ``ckpt["state_dict"]`` is a table of named tensors (``checkpoint.stored_state``)."""
    fix = quantized_fix(ckpt)
    state = ckpt["state_dict"]
    disabled = _disabled(ckpt.get("modelopt_state"))
    for name, t in state.items():
        if name.endswith("_quantizer._amax") and name.removesuffix("._amax") in disabled:
            continue
        defect = _first_defect(name, t, state)
        if defect is not None:
            raise _refuse(source, name, defect, fix)
    for name, value in _quantizer_properties(ckpt.get("modelopt_state")):
        if any(not math.isfinite(v) for v in _numbers_of(value)):
            raise QATError(f"{source} was not loaded: its quantizer property {name} is {value!r}, not a finite "
                           f"number; {fix}.")
    stride = ckpt.get("stride")
    values = list(_numbers_of(stride))
    if not values or any(not math.isfinite(v) or v <= 0 for v in values):
        raise QATError(f"{source} was not loaded: its stride {stride!r} is not a list of positive numbers (the "
                       f"model's anchors are placed by it); {fix}.")


def check_fp(model: nn.Module, source: str, fix: str = FP_FIX) -> None:
    """Every parameter and buffer of the FP ``model`` is finite, no BatchNorm's running variance is negative and
    every BatchNorm's ``eps`` is positive; ``source`` names the file in the sentence, ``fix`` ends it."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for name, t in state.items():
        defect = _first_defect(name, t.detach(), state)
        if defect is not None:
            raise _refuse(source, name, defect, fix)
    for name, module in model.named_modules():
        eps = getattr(module, "eps", None) if isinstance(module, nn.modules.batchnorm._NormBase) else None
        if eps is not None and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise QATError(f"{source} was not loaded: its BatchNorm at {name} has eps {eps!r} (it divides by "
                           f"sqrt(running variance + eps), so eps must be a positive number); {fix}.")
