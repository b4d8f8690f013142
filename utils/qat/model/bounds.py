"""What a loaded file states, checked against what it holds before anything is sized by it.

A quantized checkpoint is rebuilt from numbers it states: the model yaml (every layer's width), the recorded
layer shapes (``structure``), and modelopt's state (the shape of every quantizer buffer, made with
``torch.empty`` before the weights are read). Read as given, a few-kilobyte file can make the loader ask for
terabytes. Each number is checked here against the tensors the file actually stores, on shapes alone, before
anything it sizes is made; the tensors themselves were checked as loaded (``safe_load``: no record inflates, no
tensor spans more than its storage). A file that fails is one :class:`QATError` sentence naming it and the place.

    check_yaml_size(ckpt["yaml"], ckpt["nc"], state, source)   # before the yaml's model is built
    check_modelopt_state(ckpt["modelopt_state"], state, source)      # before modelopt restores it
    check_geometry(model, source)                                    # before any image goes through it

A model's weights are bounded by the file, but its geometry (a convolution's padding, a pool's window, an
upsampling factor) sizes every activation of a forward pass: :func:`check_geometry` bounds it by
:data:`MAX_REACH`, far beyond any YOLOv9 layer, for FP checkpoints (pickled modules) and rebuilt quantized ones alike.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch

from utils.qat.core.errors import QATError

#: The yaml's model, before fusing, may hold at most this many times the elements the file stores (plus
#: :data:`YAML_SLACK`): its BatchNorms fold into the stored convolutions, and a model whose layers are narrower
#: than its yaml (Ultralytics' YOLOv9-t, a pruned model) stores fewer than the yaml makes.
YAML_FACTOR = 4
YAML_SLACK = 1 << 20
#: The quantizers this toolkit writes: 8 bits, per tensor or per output channel, no blocks.
QUANTIZER_PROPERTIES = {"_num_bits": (8,), "_axis": (None, 0), "_block_sizes": (None,)}
FIX = "quantize its FP weights again with this version of yolov9-qat"
#: The most pixels a layer may pad, dilate over or stride by, and the largest upsampling factor: YOLOv9's layers
#: pad at most 2, stride 2 and upsample by 2.
MAX_REACH, MAX_UPSAMPLE = 64, 16


def numel(shape: Any) -> int:
    return math.prod(int(s) for s in shape)


def stored_elements(state: Mapping[str, torch.Tensor]) -> int:
    """How many elements the file's state dict holds."""
    return sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))


def yaml_elements(cfg: dict, nc: int) -> int:
    """The parameters and buffers of the model upstream's ``parse_model`` makes of ``cfg`` (with ``nc``
    classes), counted on the meta device: no memory is taken, whatever widths the yaml states."""
    from models.yolo import parse_model

    from utils.qat.core.yolov9 import isolated_build
    cfg = copy.deepcopy(dict(cfg))
    cfg["nc"] = nc
    with isolated_build(), torch.device("meta"):
        layers, _ = parse_model(cfg, ch=[3])
    return sum(t.numel() for t in (*layers.parameters(), *layers.buffers()))


def check_yaml_size(cfg: Any, nc: Any, state: Mapping[str, torch.Tensor], source: str) -> None:
    """The model ``cfg`` builds is of the size of the weights the file stores for it (:data:`YAML_FACTOR`)."""
    if not isinstance(cfg, dict) or not isinstance(nc, int) or isinstance(nc, bool) or nc < 1:
        raise QATError(f"{source} was not loaded: its model yaml or class count (nc: {nc!r}) is not one a quantized "
                       f"checkpoint holds; {FIX}.")
    stored = stored_elements(state)
    try:
        built = yaml_elements(cfg, nc)
    except QATError:
        raise
    except Exception as e:  # a yaml parse_model cannot build: the same sentence as any other misfit
        raise QATError(f"{source} was not loaded: its model yaml cannot be built in this YOLOv9 tree "
                       f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); "
                       f"use the YOLOv9 tree it was quantized in, or {FIX}.") from None
    if built > YAML_FACTOR * stored + YAML_SLACK:
        raise QATError(f"{source} was not loaded: its model yaml builds {built:,} parameters where the file stores "
                       f"{stored:,} weights for it (at most {YAML_FACTOR}x as many are allowed); the file is damaged "
                       f"or was made to exhaust memory, so {FIX}.")


def check_modelopt_state(modelopt_state: Any, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Every quantizer modelopt's state describes is one this toolkit writes (:data:`QUANTIZER_PROPERTIES`), and
    every buffer or parameter it would make (``_pytorch_state_metadata``, allocated by shape when restored) has
    the shape and a floating dtype of the tensor the file stores for it."""
    def bad(what: str) -> QATError:
        return QATError(f"{source} was not loaded: its modelopt state {what}; {FIX}.")

    modes = modelopt_state.get("modelopt_state_dict") if isinstance(modelopt_state, dict) else None
    if not isinstance(modes, list):
        raise bad("is not a list of modes")
    for entry in modes:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[1], dict)):
            raise bad("has an entry that is not a (mode, state) pair")
        mode, mode_state = entry
        metadata = mode_state.get("metadata")
        quantizers = metadata.get("quantizer_state", {}) if isinstance(metadata, dict) else None
        if not isinstance(quantizers, dict):
            raise bad(f"has no quantizer table for mode {mode}")
        for name, q in quantizers.items():
            if not isinstance(q, dict):
                raise bad(f"describes {name} in a form modelopt does not write")
            for key, allowed in QUANTIZER_PROPERTIES.items():
                if key in q and q[key] not in allowed:
                    raise bad(f"gives {name} {key.lstrip('_')} {q[key]!r} (this toolkit writes "
                              f"{' or '.join(map(str, allowed))})")
            tensors = q.get("_pytorch_state_metadata", {})
            if not isinstance(tensors, dict):
                raise bad(f"describes the tensors of {name} in a form modelopt does not write")
            for group in ("params", "buffers"):
                for key, described in (tensors.get(group) or {}).items():
                    _check_described(f"{name}.{key}", described, state, bad)


def _check_described(key: str, described: Any, state: Mapping[str, torch.Tensor], bad) -> None:
    stored = state.get(key)
    shape = described.get("shape") if isinstance(described, dict) else None
    dtype = described.get("dtype") if isinstance(described, dict) else None
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise bad(f"gives {key} no shape")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise bad(f"gives {key} the dtype {dtype} (quantizer scales are floating point)")
    if stored is None:
        raise bad(f"gives {key} the shape {tuple(shape)}, and the file stores no such tensor")
    if tuple(shape) != tuple(stored.shape):
        raise bad(f"gives {key} the shape {tuple(shape)} where the file stores {tuple(stored.shape)}")


def _numbers(value: Any) -> list[float]:
    """The numbers of a layer attribute (an int, a float, a tuple of them); a string ('same') or None: none."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for x in value for v in _numbers(x)]
    return []


def _geometry(module: torch.nn.Module) -> tuple[str, Any, float] | None:
    """The first attribute of ``module`` beyond its bound: ``(attribute, value, bound)``, else None."""
    import torch.nn as nn
    limits: dict[str, float] = {}
    if isinstance(module, nn.modules.conv._ConvNd):
        limits = {"padding": MAX_REACH, "dilation": MAX_REACH, "stride": MAX_REACH, "output_padding": MAX_REACH}
    elif isinstance(module, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd)):
        limits = {"kernel_size": MAX_REACH, "padding": MAX_REACH, "stride": MAX_REACH, "dilation": MAX_REACH}
    elif isinstance(module, nn.modules.padding._ConstantPadNd | nn.modules.padding._ReflectionPadNd |
                    nn.modules.padding._ReplicationPadNd):
        limits = {"padding": MAX_REACH}
    elif isinstance(module, nn.Upsample):
        from utils.qat.core.artifact import MAX_SIDE
        limits = {"scale_factor": MAX_UPSAMPLE, "size": MAX_SIDE}
    for name, bound in limits.items():
        value = getattr(module, name, None)
        if any(not math.isfinite(v) or abs(v) > bound for v in _numbers(value)):
            return name, value, bound
    return None


def check_geometry(model: torch.nn.Module, source: str) -> None:
    """No layer of ``model`` pads, dilates, strides, pools or upsamples beyond :data:`MAX_REACH` /
    :data:`MAX_UPSAMPLE`: a layer stating more would size its activations by it."""
    for name, module in model.named_modules():
        found = _geometry(module)
        if found is not None:
            attribute, value, bound = found
            raise QATError(f"{source} was not loaded: its {type(module).__name__} at {name} has {attribute} {value!r} "
                           f"(at most {bound:g} is accepted), which would size every activation through it; the file "
                           f"is damaged or was made to exhaust memory.")
