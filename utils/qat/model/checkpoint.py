"""Reading FP checkpoints (upstream format) and writing/reading quantized ones.

A quantized model cannot be pickled whole (modelopt's dynamic modules), so its checkpoint carries
what is needed to rebuild it in a fresh process with nothing but the patched tree: the model yaml,
its layers' shapes (``structure``: ``utils.qat.model.structure``, for a model whose modules differ from its yaml),
class names, stride, modelopt state, state dict, the quantization record (``QuantInfo``: the calibration
settings, the layers kept in FP, the shared-scale groups), the arguments of the run that made it, the
toolkit version and ``provenance`` (the sha256 of the weights it was made from, the toolkit's version and commit).
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import torch
import torch.nn as nn

from utils.qat import __version__
from utils.qat.core import provenance, yolov9
from utils.qat.model import bounds, numbers, safe_load, structure
from utils.qat.core.atomic import write_bytes
from utils.qat.core.errors import QATError

FORMAT = "yolov9-qat"


def read(path: str | os.PathLike, trust: bool = False) -> dict:
    """Load a checkpoint file the user named, with a clear error for missing or foreign files. Nothing in it runs
    (``utils.qat.model.safe_load``) unless ``trust`` (``--trust-weights``): then it is read with the full pickle."""
    path = Path(path)
    if not path.is_file():
        raise QATError(f"weights file not found: {path}; pass the path of a .pt checkpoint.")
    ckpt = safe_load.load(path, trust=trust)
    if not isinstance(ckpt, dict) or not (ckpt.get("format") == FORMAT or isinstance(ckpt.get("ema") or ckpt.get("model"), nn.Module)):
        raise QATError(f"{path} is not a YOLOv9 checkpoint (no 'model' inside); pass a YOLOv9 .pt file.")
    return ckpt


def is_quantized(ckpt: dict) -> bool:
    return ckpt.get("format") == FORMAT


def task_of(ckpt: dict) -> str:
    if is_quantized(ckpt):
        return ckpt.get("task", "detect")
    return yolov9.task_of_model(ckpt.get("ema") or ckpt["model"])


def check_task(ckpt: dict, path, task: str) -> None:
    have = task_of(ckpt)
    if have == task:
        return
    hint = {"segment": "use segment/qat_seg.py for segmentation models",
            "detect": "use qat.py for detection models",
            "classify": "classification models are not supported by yolov9-qat"}.get(have, "pass a detection model")
    raise QATError(f"{path} holds a {have} model but this command needs a {task} model; {hint}.")


def load_fp(path: str | os.PathLike, task: str = "detect", ckpt: dict | None = None, trust: bool = False) -> nn.Module:
    """The FP model of an upstream checkpoint (EMA weights when present), float32, eval mode.
    ``ckpt``: the checkpoint if it was already read (saves reading the file twice); ``trust``: as :func:`read`."""
    ckpt = read(path, trust) if ckpt is None else ckpt
    if is_quantized(ckpt):
        record = ckpt.get("provenance")
        made = record.get("weights") if isinstance(record, dict) else None
        original = f" it was made from ({made}, as it records)" if isinstance(made, str) and made else ""
        raise QATError(f"{path} is a quantized (yolov9-qat) checkpoint but this step needs the floating-point "
                       f"model; pass the original weights{original or ' (e.g. yolov9-c-converted.pt)'}.")
    check_task(ckpt, path, task)
    model = (ckpt.get("ema") or ckpt["model"]).float().eval()
    bounds.check_geometry(model, str(path))
    numbers.check_fp(model, str(path))
    if not hasattr(model, "names") or not model.names:
        model.names = ckpt.get("names") or {i: str(i) for i in range(int(model.nc))}
    if isinstance(model.names, (list, tuple)):
        model.names = dict(enumerate(model.names))
    return model


def save_quantized(path: str | os.PathLike, model: nn.Module, info, *, epoch: int | None = None,
                   metrics: dict | None = None, task: str = "detect", arguments: dict | None = None,
                   source: dict | None = None) -> Path:
    """Write a quantized checkpoint atomically. ``info``: its ``QuantInfo``; ``arguments``: what the run that
    made it was given (stored as ``args``); ``source``: ``provenance.record(weights)`` of the weights it was made
    from (stored as ``provenance``; without it, the toolkit's version and commit alone)."""
    import utils.qat.quantize.modelopt_import  # noqa: F401  (modelopt without its unused plugins: first)
    import modelopt.torch.opt as mto
    ckpt = {
        "format": FORMAT,
        "version": __version__,
        "task": task,
        "yaml": model.yaml,
        "structure": structure.record(model),
        "nc": int(model.nc) if hasattr(model, "nc") else int(model.yaml["nc"]),
        "names": dict(model.names),
        "stride": model.stride.tolist(),
        "modelopt_state": mto.modelopt_state(model),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "quant": info.to_dict(),
        "args": arguments or {},
        "epoch": epoch,
        "metrics": metrics or {},
        "provenance": source or provenance.record(),
    }
    buffer = io.BytesIO()  # serialised first: a full disk then fails in a plain write, with its errno
    torch.save(ckpt, buffer)
    return write_bytes(path, buffer.getbuffer())


def stored_state(ckpt: dict, source: str) -> dict[str, torch.Tensor]:
    """The checkpoint's state dict: names to tensors, or a QATError sentence."""
    state = ckpt.get("state_dict")
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise QATError(f"{source} was not loaded: its state_dict is not a table of named tensors; "
                       f"{bounds.FIX}.")
    return state


def rebuild(ckpt: dict, source: str = "the checkpoint") -> nn.Module:
    """A fused FP model built from the checkpoint's yaml, its layers made as ``structure`` records them (a
    checkpoint written before that field existed: as the yaml builds them); ``source`` names it in errors. The
    yaml's size and every recorded layer are checked against the weights the file stores before they are built
    (``utils.qat.model.bounds``)."""
    from utils.qat.quantize.model_quant import fuse
    task = ckpt.get("task", "detect")
    state = stored_state(ckpt, source)
    bounds.check_yaml_size(ckpt.get("yaml"), ckpt.get("nc"), state, source)
    layers = ckpt.get("structure")
    if layers is not None and not isinstance(layers, dict):
        raise QATError(f"{source} was not loaded: its structure record is not a table of layers; {bounds.FIX}.")
    model = fuse(yolov9.build(ckpt["yaml"], ckpt["nc"], task=task).float())
    if layers is not None:
        structure.apply(model, layers, source, state)
    return model


def load_quantized(path: str | os.PathLike, task: str = "detect", ckpt: dict | None = None, trust: bool = False):
    """Rebuild a quantized model in this process. Returns ``(model, QuantInfo, ckpt)``; ``trust``: as :func:`read`,
    and for the model yaml, which is built only when ``yolov9.code_in_cfg`` finds no code in it unless ``trust``."""
    import utils.qat.quantize.modelopt_import  # noqa: F401  (modelopt without its unused plugins: first)
    import modelopt.torch.opt as mto

    from utils.qat.quantize import rules
    from utils.qat.quantize.config import QuantInfo
    from utils.qat.quantize.qdq import use_qdq_rounding
    ckpt = read(path, trust) if ckpt is None else ckpt
    if not is_quantized(ckpt):
        script = numbers.SCRIPTS.get(task, "qat.py")
        raise QATError(f"{path} is a floating-point checkpoint, not a quantized one; quantize it with `{script} "
                       f"quantize` first, or evaluate it as it is with `{script} eval --allow-fp`.")
    check_task(ckpt, path, task)
    code = None if trust else yolov9.code_in_cfg(ckpt.get("yaml"))
    if code:
        raise QATError(f"{path} was not loaded: its model yaml has {code}, which building the model would run as "
                       f"Python code; if you trust the file, pass --trust-weights to build it anyway.")
    # NaN, inf, a scale that is not positive: before anything is built (the stored tensors themselves were checked
    # against their storage as the file was read: safe_load.check_spans)
    numbers.check_quantized({**ckpt, "state_dict": stored_state(ckpt, str(path))}, str(path))
    model = rebuild(ckpt, str(path))
    bounds.check_geometry(model, str(path))  # the yaml's own arguments (a Conv's padding) size activations too
    bounds.check_modelopt_state(ckpt.get("modelopt_state"), ckpt["state_dict"], str(path))
    rules.register_yolov9_modules()
    model = use_qdq_rounding(mto.restore_from_modelopt_state(model, ckpt["modelopt_state"]))
    misfit = structure.misfit(model, ckpt["state_dict"])
    if misfit:
        fix = structure.FIX if "structure" in ckpt else (
            "it predates checkpoints that record their layers' shapes (a model whose modules differ from its yaml, "
            "such as a pruned one, needs them): quantize its FP weights again with this version")
        raise QATError(f"{path} does not fit the model its yaml builds in this YOLOv9 tree ({misfit}); {fix}.")
    model.load_state_dict(ckpt["state_dict"])
    model.names = dict(ckpt["names"])
    model.stride = torch.tensor(ckpt["stride"], dtype=torch.float32)
    info = QuantInfo.from_dict(ckpt["quant"])
    return model.eval(), info, ckpt
