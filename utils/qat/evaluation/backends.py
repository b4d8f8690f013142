"""Prediction backends for the shared evaluator: what every backend has (:class:`Backend`), PyTorch (FP or
fake-quant), ONNX Runtime, and :func:`open_backend`, which opens a .pt, .onnx or .engine file as one.

A backend is a callable ``backend(images) -> raw output`` where ``images`` is float32 B x 3 x H x W in [0, 1]
on ``backend.device``. It returns the detection head's inference output ``(B, 4 + nc, A)`` (xywh boxes in
input pixels, class scores), for a segmentation model ``(pred, protos)``, or for End2End graphs a dict of
``artifact.END2END_OUTPUTS`` (and ``MASK_OUTPUT``). The TensorRT backend lives in ``utils/qat/trt/trt_engine.py``.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence

import numpy as np
import torch
import torch.nn as nn

from utils.qat.core import yolov9
from utils.qat.core.artifact import ArtifactMeta, is_end2end, task_from_outputs
from utils.qat.core.errors import QATError

if TYPE_CHECKING:
    from os import PathLike

#: File suffix -> backend kind; the kind -> the runtime's name in reports.
FORMATS = {".pt": "torch", ".onnx": "onnxruntime", ".engine": "tensorrt"}
RUNTIMES = {"torch": "PyTorch", "onnxruntime": "ONNX Runtime", "tensorrt": "TensorRT"}


class Backend(Protocol):
    """What the evaluator (``utils.qat.evaluation.evaluate``) reads from every backend."""
    runtime: str  # a name for reports: PyTorch, ONNX Runtime, TensorRT
    device: torch.device  # where the images go
    stride: int  # the largest stride (input sizes are multiples of it)
    names: dict[int, str] | None  # class names (None: take the dataset's)
    batch_size: int | None  # a fixed batch size, or None
    imgsz: tuple[int, int] | None  # a fixed input size (H, W), or None
    end2end: bool  # NMS is in the model: the output is a dict of END2END_OUTPUTS
    task: str  # 'detect' or 'segment': what the model predicts

    def __call__(self, images: torch.Tensor) -> yolov9.Output: ...


class TorchBackend:
    """A PyTorch model (FP or fake-quant). ``task="segment"`` returns ``(pred, protos)``. A fake-quant
    model runs in full float32 (``utils.qat.quantize.qdq.full_fp32``: no TF32), as the runtimes compute it."""

    runtime = "PyTorch"

    def __init__(self, model: nn.Module, device: torch.device, task: str = "detect"):
        self.model = model.to(device).eval()
        self.device = device
        self.stride = yolov9.model_stride(model)
        self.names = dict(model.names)
        self.batch_size = None
        self.imgsz = None
        self.end2end = False
        self.task = task
        qnn = sys.modules.get("modelopt.torch.quantization.nn")  # a fake-quant model has imported it
        self.quantized = qnn is not None and any(isinstance(m, qnn.TensorQuantizer) for m in model.modules())

    @torch.no_grad()
    def __call__(self, images: torch.Tensor):
        from utils.qat.quantize.qdq import full_fp32
        with full_fp32() if self.quantized else contextlib.nullcontext():
            out = yolov9.outputs(self.model(images), self.task)
        return out if len(out) > 1 else out[0]


class ORTBackend:
    """Runs an exported ONNX graph (plain or End2End) with ONNX Runtime."""

    runtime = "ONNX Runtime"

    def __init__(self, onnx_path: str | Path, device: torch.device | str = "cpu"):
        import onnxruntime as ort
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise QATError(f"ONNX file not found: {onnx_path}; export one with export_qat.py first.")
        device = torch.device(device)
        providers: list = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise QATError("onnxruntime here has no CUDA provider; use --device cpu or install onnxruntime-gpu.")
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own types for unreadable graphs
            raise QATError(f"ONNX Runtime cannot load {onnx_path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                           f"re-export it with export_qat.py (graphs with TensorRT plugins, e.g. --nms trt, run in "
                           f"TensorRT only: export with --nms onnx to evaluate here).") from e
        self.device = torch.device("cpu")  # images are handed over as numpy
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.fp16 = inp.type == "tensor(float16)"
        b, _, h, w = inp.shape
        self.batch_size = b if isinstance(b, int) else None
        self.imgsz = (h, w) if isinstance(h, int) and isinstance(w, int) else None
        outputs = self.session.get_outputs()
        self.output_names = [o.name for o in outputs]
        self.end2end = is_end2end(self.output_names)
        meta = ArtifactMeta.read(self.session.get_modelmeta().custom_metadata_map)
        self.stride = yolov9.artifact_stride(meta.stride, onnx_path, f"the metadata of {onnx_path}")
        self.names = meta.names
        self.task = meta.task or task_from_outputs(self.output_names, [len(o.shape) for o in outputs])

    def __call__(self, images: torch.Tensor):
        x = images.detach().cpu().numpy().astype(np.float16 if self.fp16 else np.float32)
        n = x.shape[0]
        if self.batch_size is not None and n != self.batch_size:
            if n > self.batch_size:
                raise QATError(f"the ONNX graph has a fixed batch of {self.batch_size}; use --batch-size "
                               f"{self.batch_size} or export with --dynamic.")
            x = np.concatenate([x, np.zeros((self.batch_size - n, *x.shape[1:]), x.dtype)])
        outs = [torch.from_numpy(np.asarray(o))[:n] for o in self.session.run(None, {self.input_name: x})]
        outs = [o.float() if o.is_floating_point() else o for o in outs]
        if self.end2end:
            return dict(zip(self.output_names, outs))
        preds = yolov9.exported_outputs(outs, self.task)
        return preds if len(preds) > 1 else preds[0]


def open_backend(path: str | PathLike, device: str = "", *, kind: str | None = None,
                 plugins: Sequence[str | PathLike] = (), trust: bool = False) -> Backend:
    """The backend for a model file: ``kind`` 'torch' (a .pt checkpoint, quantized or FP), 'onnxruntime' (.onnx)
    or 'tensorrt' (.engine, with its ``plugins`` libraries); by default from the suffix (:data:`FORMATS`).
    ``device``: as ``--device`` takes it; '' is the first GPU (TensorRT, PyTorch) or the CPU (ONNX Runtime).
    ``trust``: read a .pt with the full pickle (``utils.qat.model.checkpoint.read``)."""
    path = Path(path)
    kind = kind or FORMATS.get(path.suffix.lower())
    if kind not in RUNTIMES:
        raise QATError(f"{path} is not a model file this toolkit runs; pass a "
                       f"{', '.join(f'{s} ({RUNTIMES[k]})' for s, k in FORMATS.items())} file.")
    if kind == "tensorrt":
        from utils.qat.trt.trt_common import require_tensorrt
        from utils.qat.trt.trt_engine import TRTBackend
        if not path.is_file():
            raise QATError(f"engine file {path} not found; build it with scripts/generate_trt_engine.sh ONNX ENGINE.")
        require_tensorrt()  # a QATError naming the install command when TensorRT is missing
        spec = (device or "cuda:0").strip()
        return TRTBackend(path, f"cuda:{spec}" if spec.isdigit() else spec, plugins=plugins)
    from utils.qat.core.device import select_device
    if kind == "onnxruntime":
        return ORTBackend(path, select_device(device) if device else torch.device("cpu"))
    from utils.qat.model import checkpoint
    ckpt = checkpoint.read(path, trust)
    task = checkpoint.task_of(ckpt)
    if checkpoint.is_quantized(ckpt):
        model = checkpoint.load_quantized(path, task=task, ckpt=ckpt, trust=trust)[0]
    else:
        model = checkpoint.load_fp(path, task=task, ckpt=ckpt)
    return TorchBackend(model, select_device(device), task=task)
