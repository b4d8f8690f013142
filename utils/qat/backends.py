"""Prediction backends for the shared evaluator: PyTorch (FP or fake-quant) and ONNX Runtime.

A backend is a callable ``backend(images) -> raw head output`` where ``images`` is float32 B x 3 x H x W
in [0, 1] on ``backend.device``. It returns the detection head's inference output ``(B, 4 + nc, A)``
(xywh boxes in input pixels, class scores), for segmentation ``(pred, protos)``, or for End2End graphs
a dict with ``num_dets``, ``det_boxes``, ``det_scores``, ``det_classes`` (and ``det_masks``).
The TensorRT backend lives in ``utils/qat/trt_engine.py``.
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from utils.qat.artifact import ArtifactMeta, is_end2end
from utils.qat.errors import QATError


class TorchBackend:
    """A PyTorch model (FP or fake-quant). ``task="segment"`` returns ``(pred, protos)``. A fake-quant
    model runs in full float32 (``models.quantize_qdq.full_fp32``: no TF32), as the runtimes compute it."""

    def __init__(self, model: nn.Module, device: torch.device, task: str = "detect"):
        self.model = model.to(device).eval()
        self.device = device
        self.stride = int(model.stride.max())
        self.names = dict(model.names)
        self.batch_size = None
        self.imgsz = None
        self.end2end = False
        self.task = task
        qnn = sys.modules.get("modelopt.torch.quantization.nn")  # a fake-quant model has imported it
        self.quantized = qnn is not None and any(isinstance(m, qnn.TensorQuantizer) for m in model.modules())

    @torch.no_grad()
    def __call__(self, images: torch.Tensor):
        from models.quantize_qdq import full_fp32
        with full_fp32() if self.quantized else contextlib.nullcontext():
            out = self.model(images)
        return seg_outputs(out) if self.task == "segment" else main_output(out)


def main_output(out):
    """The inference tensor of a YOLOv9 detection head in eval mode (the main branch of dual heads)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    if isinstance(out, (tuple, list)):  # DualDDetect: [aux, main]
        out = out[-1]
    return out


def seg_outputs(out):
    """``(pred, protos)`` of a segmentation head in eval mode: Segment / DSegment return
    ``(pred, (raw, coefficients, protos))``, DualDSegment the same for its main branch."""
    return out[0], out[1][-1]


class ORTBackend:
    """Runs an exported ONNX graph (plain or End2End) with ONNX Runtime."""

    def __init__(self, onnx_path: str | Path, device: torch.device | str = "cpu"):
        import onnxruntime as ort
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise QATError(f"ONNX file not found: {onnx_path}; export one with export_qat.py first.")
        device = torch.device(device)
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise QATError("onnxruntime here has no CUDA provider; use --device cpu or install onnxruntime-gpu.")
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
        self.device = torch.device("cpu")  # images are handed over as numpy
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        self.fp16 = inp.type == "tensor(float16)"
        b, _, h, w = inp.shape
        self.batch_size = b if isinstance(b, int) else None
        self.imgsz = (h, w) if isinstance(h, int) and isinstance(w, int) else None
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.end2end = is_end2end(self.output_names)
        meta = ArtifactMeta.read(self.session.get_modelmeta().custom_metadata_map)
        self.stride = meta.stride or 32
        self.names = meta.names
        self.task = meta.task or ("segment" if "output1" in self.output_names or "det_masks" in self.output_names
                                  else "detect")

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
        named = dict(zip(self.output_names, outs))
        if self.end2end:
            return named
        if self.task == "segment":
            return named.get("output0", outs[0]), named.get("output1", outs[-1])
        return named.get("output0", outs[0])
