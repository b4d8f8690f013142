"""The toolkit's one ONNX exporter (plain, End2End and DeepStream exports all go through it).

:func:`export_onnx` traces an FP or fake-quantized YOLOv9 model with the TorchScript exporter
(``torch.onnx.export(..., dynamo=False)``), then works on the ONNX graph:

1. merges the redundant Q/DQ the exporter leaves (``onnx_qdq.dedupe_qdq``; outputs unchanged) and stores
   quantized weights as INT8 initializers holding PyTorch's own integers (:func:`fold_weight_qdq`),
2. optionally simplifies it (``onnx_qdq.simplify``: onnxslim, Q/DQ checked to survive; a failure keeps
   the unsimplified graph and says so in the report),
3. optionally converts the floating-point parts to FP16 with NVIDIA ModelOpt AutoCast (:func:`to_fp16`),
4. lints the Q/DQ placement of quantized graphs once, on the graph TensorRT gets (``onnx_lint.lint``; the
   report's Q/DQ counts come from that same lint),
5. optionally appends NMS (``end2end.append_nms``),
6. writes metadata (``utils.qat.core.artifact``: ``stride``, ``names`` as JSON, ``task``, ``imgsz``; and ``quantized``,
   ``version``, ``toolkit_commit`` where known, ...)
   and saves the file atomically: nothing half-written is left on any error.

The detection head is put in export mode on the head *instance* only, and restored afterwards. Dual
heads (DualDDetect, ...) export their main (last) branch only (``utils.qat.core.yolov9.outputs``).
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx
import torch
import torch.nn as nn
from onnx import numpy_helper

from utils.qat import __version__
from utils.qat.core import provenance, yolov9
from utils.qat.onnx import onnx_lint, onnx_qdq
from utils.qat.core.artifact import ArtifactMeta, write_props
from utils.qat.core.atomic import atomic_path
from utils.qat.core.errors import QATError
from utils.qat.onnx.onnx_graph import constant_value

__all__ = ["export_onnx", "format_report", "to_fp16", "fold_weight_qdq", "quantized_weights", "load_for_export",
           "parse_imgsz", "is_quantized_model", "readable", "DeepStreamOutput", "OUTPUT_NAMES"]

OUTPUT_NAMES = {"detect": ["output0"], "segment": ["output0", "output1"], "classify": ["output0"]}
INPUT_NAME = "images"
#: Head families whose upstream export mode is broken (DualDSegment returns a batch slice): exported in eval mode.
_NO_EXPORT_MODE = {"dual segment"}
_HEAD_STATE = ("export", "dynamic", "shape", "anchors", "strides")


# ---------------------------------------------------------------------------------------------
# the model side
# ---------------------------------------------------------------------------------------------

def load_for_export(weights: str | os.PathLike, ckpt: dict | None = None, trust: bool = False):
    """``(model, task, quantized, fp_patterns)`` of a checkpoint, quantized (rebuilt with its Q/DQ) or
    floating point (BatchNorm fused), in eval mode. ``ckpt``: the already read checkpoint, if any; ``trust``: as
    ``utils.qat.model.checkpoint.read``."""
    from utils.qat.model import checkpoint
    ckpt = checkpoint.read(weights, trust) if ckpt is None else ckpt
    task = checkpoint.task_of(ckpt)
    if checkpoint.is_quantized(ckpt):
        model, info, _ = checkpoint.load_quantized(weights, task=task, ckpt=ckpt, trust=trust)
        return model.eval(), task, True, list(info.fp_patterns)
    model = checkpoint.load_fp(weights, task=task, ckpt=ckpt)
    if hasattr(model, "fuse"):
        model = model.fuse()
    return model.eval(), task, False, []


def parse_imgsz(values: Sequence[int], stride: int, flag: str = "--imgsz") -> tuple[int, int]:
    """``N`` or ``H W`` from the command line (``utils.qat.core.validate.image_size``; the values' range is
    ``FLAGS``'), each rounded up to a multiple of the stride (with a notice)."""
    from utils.qat.core.validate import check_imgsz
    from utils.qat.core.validate import image_size
    h, w = image_size(values, flag)
    return check_imgsz(h, stride), check_imgsz(w, stride)


def is_quantized_model(model: nn.Module) -> bool:
    """Has modelopt quantizers (checked by class name so that FP exports never import modelopt)."""
    return any(type(m).__name__ in ("TensorQuantizer", "SequentialQuantizer") for m in model.modules())


@contextlib.contextmanager
def _export_mode(model: nn.Module, *, dynamic_hw: bool):
    """The model's head in export mode on this instance only; every attribute it touches is restored on exit."""
    head = yolov9.head(model)
    if head is None:
        yield
        return
    saved = {k: head.__dict__[k] for k in _HEAD_STATE if k in head.__dict__}
    try:
        if yolov9.family(model) not in _NO_EXPORT_MODE:
            head.export = True
        head.dynamic = bool(dynamic_hw)  # recompute anchors from the traced feature shapes
        if dynamic_hw:
            head.shape = None
        yield
    finally:
        for k in _HEAD_STATE:
            if k in saved:
                setattr(head, k, saved[k])
            else:
                head.__dict__.pop(k, None)


@contextlib.contextmanager
def _without_jit_lint():
    """torch's TorchScript exporter checks the traced graph's invariants (``torch._C._jit_pass_lint``) before and
    after each of its passes, ten times an export; on a fake-quantized YOLOv9 each check takes seconds on a CPU
    (YOLOv9-E at 64 px on 2 cores: an export takes 47 s with them, 31 s without). The checks only read the graph,
    so the ONNX is the same without them (``tests/test_export.py``); they are skipped for the export and put back
    after it."""
    lint = getattr(torch._C, "_jit_pass_lint", None)
    if lint is None:
        yield
        return
    torch._C._jit_pass_lint = lambda graph: None
    try:
        yield
    finally:
        torch._C._jit_pass_lint = lint


class _Exportable(nn.Module):
    """model -> head outputs (main branch) -> optional ``post`` module; remembers the traced shapes."""

    def __init__(self, model: nn.Module, task: str, post: nn.Module | None):
        super().__init__()
        self.model, self.task, self.post = model, task, post
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x):
        outs = yolov9.outputs(self.model(x), self.task)
        if self.post is not None:
            outs = self.post(*outs)
            outs = (outs,) if torch.is_tensor(outs) else tuple(outs)
        self.shapes = [tuple(int(d) for d in o.shape) for o in outs]
        return outs if len(outs) > 1 else outs[0]


class DeepStreamOutput(nn.Module):
    """DeepStream-Yolo's output layout: ``(B, A, 6)`` = x1, y1, x2, y2 (input pixels), best class score,
    class index (as float) per anchor, from a head output ``(B, 4 + nc, A)`` with xywh boxes."""

    def forward(self, pred: torch.Tensor) -> torch.Tensor:
        x = pred.transpose(1, 2)
        xy, wh = x[..., 0:2], x[..., 2:4]
        score, cls = x[..., 4:].max(dim=-1, keepdim=True)
        return torch.cat([xy - wh / 2, xy + wh / 2, score, cls.to(x.dtype)], dim=-1)


# ---------------------------------------------------------------------------------------------
# FP16 (NVIDIA ModelOpt AutoCast)
# ---------------------------------------------------------------------------------------------

#: What AutoCast needs beyond nvidia-modelopt itself (its ``[onnx]`` extra pins onnx and onnxruntime-gpu).
AUTOCAST_PACKAGES = "onnx-graphsurgeon onnxscript lief polygraphy"


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """Only errors from these loggers (AutoCast logs every step at INFO, its converter warns on the root logger)."""
    import logging
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def to_fp16(model: onnx.ModelProto, imgsz: tuple[int, int], batch_size: int = 1, seed: int = 0) -> onnx.ModelProto:
    """The floating-point parts of ``model`` in FP16, converted by NVIDIA ModelOpt AutoCast
    (``modelopt.onnx.autocast.convert_to_mixed_precision``, the tool TensorRT 11's migration guide names for
    strongly typed FP16), graph inputs and outputs kept FP32 (``keep_io_types``).

    AutoCast keeps in FP32 the nodes whose values exceed FP16's comfortable range (``data_max`` 512, e.g. box
    coordinates in pixels at 640 px), measured on one input of the export's size (uniform noise in [0, 1],
    ``seed``): a dynamic graph has no size of its own for AutoCast's random inputs. On a Q/DQ graph it moves to
    opset 19, where Q/DQ scales are FP16 and DequantizeLinear feeds each Conv directly (no Cast in between).
    """
    try:
        from modelopt.onnx.autocast import convert_to_mixed_precision
    except ImportError as e:
        raise QATError(f"--half needs NVIDIA ModelOpt's ONNX tools (import modelopt.onnx.autocast: {e}); install "
                       f"them with ./install_dependencies.sh (pip install {AUTOCAST_PACKAGES}).") from e
    import tempfile
    inits = {t.name for t in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if len(inputs) != 1:
        raise QATError(f"FP16 conversion expects one image input, the graph has {len(inputs)}; export without --half.")
    h, w = imgsz
    x = np.random.default_rng(seed).random((batch_size, 3, h, w), dtype=np.float32)
    with tempfile.TemporaryDirectory(prefix="yolov9-qat-autocast-") as d:
        src, data = Path(d) / "fp32.onnx", Path(d) / "inputs.npz"
        onnx.save(model, str(src))
        np.savez(data, **{inputs[0].name: x})
        with _quiet_loggers("modelopt", "modelopt.onnx", "modelopt.onnx.autocast", ""):
            try:
                out = convert_to_mixed_precision(str(src), low_precision_type="fp16", keep_io_types=True,
                                                 calibration_data=str(data), providers=["cpu"])
            except QATError:
                raise
            except Exception as e:  # AutoCast raises many types (shape inference, ORT reference run, opset conversion)
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                raise QATError(f"ModelOpt AutoCast could not convert the graph to FP16 ({type(e).__name__}: {why}); "
                               f"export without --half.") from e
    return out


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------

def module_to_onnx_pattern(pattern: str) -> str:
    """A module-name pattern ('model.22.*', 'model.22.') as a pattern on exported node names
    ('/model.22/cv2.0/...'): dots may be dots or scope slashes."""
    return "*" + pattern.rstrip(".").replace(".", "[./]") + "[./]*"


def quantized_weights(module: nn.Module) -> dict[str, np.ndarray]:
    """The fake-quantized weights of every enabled weight quantizer, by parameter name (float32).

    These are exactly the values PyTorch computes with; :func:`fold_weight_qdq` stores them in the ONNX as
    integers so that every runtime starts from the same INT8 weights as PyTorch.
    """
    out = {}
    with torch.no_grad():
        for name, m in module.named_modules():
            wq = getattr(m, "weight_quantizer", None)
            w = getattr(m, "weight", None)
            if wq is None or not isinstance(w, torch.Tensor) or not getattr(wq, "is_enabled", False):
                continue
            out[f"{name}.weight" if name else "weight"] = wq(w).detach().float().cpu().numpy()
    return out


def fold_weight_qdq(model: onnx.ModelProto, fake: dict[str, np.ndarray]) -> int:
    """Replace ``Q(float weight) -> DQ`` by ``DQ(int8 weight)`` in place, the integers taken from PyTorch's
    fake-quantized weights ``fake`` (by initializer name). Returns how many weights were folded.

    PyTorch rounds ``w * (127 / amax)`` while ONNX Runtime and TensorRT round ``w / (amax / 127)``; for weights
    that sit exactly on a rounding tie (common: the reference checkpoints are stored in FP16) the two can land
    one level apart. Storing the integers removes that difference (and makes the file ~4x smaller).
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    drop, folded = [], 0
    for q in list(g.node):
        if q.op_type != "QuantizeLinear" or q.input[0] not in inits or q.input[0] not in fake:
            continue
        dqs = readers.get(q.output[0], [])
        if not dqs or any(d.op_type != "DequantizeLinear" for d in dqs) or len(q.input) < 3:
            continue
        scale = constant_value(g, q.input[1], inits)
        zp = constant_value(g, q.input[2], inits)
        if scale is None or zp is None or zp.dtype != np.int8 or np.any(zp != 0):
            continue
        w = fake[q.input[0]]
        axis = next((a.i for a in q.attribute if a.name == "axis"), 1)
        shape = [1] * w.ndim
        if scale.size > 1:
            shape[axis] = scale.size
        k = np.rint(w / scale.reshape(shape).astype(np.float32))
        if np.abs(k * scale.reshape(shape) - w).max() > 1e-5 * max(float(np.abs(w).max()), 1e-12) + 1e-12:
            continue  # not on this quantizer's grid: leave the Q/DQ as exported
        name = f"{q.input[0]}_int8"
        g.initializer.append(numpy_helper.from_array(np.clip(k, -128, 127).astype(np.int8), name))
        for d in dqs:
            d.input[0] = name
        drop.append(q)
        folded += 1
    for q in drop:
        g.node.remove(q)
    used = {x for n in g.node for x in n.input}
    keep = [t for t in g.initializer if t.name in used or t.name not in fake]
    del g.initializer[:]
    g.initializer.extend(keep)
    return folded


def readable(path: Path) -> None:
    """Give the file the permissions a plain ``open()`` would (the temporary file was created 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _fix_output_shapes(model: onnx.ModelProto, shapes: list[tuple[int, ...]], dynamic_axes: dict) -> None:
    """Fill in the output dims the exporter left symbolic, from the traced shapes."""
    for vi, shape in zip(model.graph.output, shapes):
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            continue
        named = dynamic_axes.get(vi.name, {})
        for i, (d, size) in enumerate(zip(dims, shape)):
            if i in named:
                d.dim_param = named[i]
            else:
                d.dim_value = int(size)


def export_onnx(model: nn.Module, path: str | os.PathLike, *, imgsz: int | Sequence[int] = (640, 640),
                batch_size: int = 1, dynamic: bool = False, dynamic_hw: bool = True, opset: int = 17,
                simplify: bool = False, half: bool = False, end2end: dict | None = None, task: str = "detect",
                metadata: dict | None = None, device: str | torch.device = "cpu", post: nn.Module | None = None, input_names: Sequence[str] | None = None,
                output_names: Sequence[str] | None = None, allow_fp: Sequence[str] = ()) -> dict:
    """Export ``model`` (FP or fake-quantized YOLOv9, eval mode) to ``path``; return a report dict.

    - ``dynamic``: batch is dynamic, and height/width too unless ``dynamic_hw=False``.
    - ``end2end``: ``end2end.NMSOptions`` fields as a dict (``backend`` 'trt' or 'onnx', ``topk_all``, ...):
      NMS is appended and the outputs become ``num_dets``, ``det_boxes``, ``det_scores``, ``det_classes``.
    - ``post``: a module applied to the head outputs before export (e.g. :class:`DeepStreamOutput`).
    - ``allow_fp``: module-name patterns of layers kept in FP on purpose (the checkpoint's
      ``fp_patterns``), not reported by the Q/DQ lint.
    - ``metadata``: extra ONNX metadata; ``stride``, ``names`` (JSON ``{index: name}``), ``task``,
      ``imgsz``, ``batch``, ``dynamic``, ``quantized``, ``half``, ``end2end`` and ``version`` are always set,
      ``toolkit_commit`` where the installed toolkit records one (``utils.qat.core.provenance``).

    The report: ``path``, ``size``, ``inputs``/``outputs`` (name, shape, dtype), ``opset``, ``quantized``,
    ``qdq_pairs`` (activation Q -> DQ), ``int8_weights`` (weights stored as INT8 -> DQ),
    ``quantized_conv``/``conv``, ``deduped``, ``lint`` (quantized models; None otherwise),
    ``simplify`` ('off', 'done' or 'failed: why; kept the unsimplified graph'), ``half``, ``end2end``,
    ``metadata``, ``seconds``.
    """
    from utils.qat.onnx import end2end as e2e
    start = time.time()
    path = Path(path)
    h, w = (int(imgsz), int(imgsz)) if isinstance(imgsz, int) else (int(imgsz[0]), int(imgsz[-1]))
    if batch_size < 1:
        raise QATError(f"--batch-size must be at least 1, got {batch_size}.")
    if opset < 13:
        raise QATError(f"opset {opset} is too old for per-channel Q/DQ; pass --opset 13 or newer (default 17).")
    nms = e2e.NMSOptions(**end2end).check() if end2end is not None else None
    if nms is not None and task not in ("detect", "segment"):
        raise QATError(f"End2End export (NMS in the graph) needs a detection or segmentation model, but this is a "
                       f"{task} model; export it with --include onnx.")
    if nms is not None and post is not None:
        raise QATError("End2End export cannot be combined with a custom output layout.")
    quantized = is_quantized_model(model)
    device = torch.device(device)
    model = model.to(device).eval()
    stride = yolov9.model_stride(model)
    names = dict(getattr(model, "names", {}) or {})
    nc = yolov9.num_classes(model) or len(names)
    input_names = list(input_names or [INPUT_NAME])
    output_names = list(output_names or OUTPUT_NAMES.get(task, ["output0"]))
    dynamic_axes: dict[str, dict[int, str]] = {}
    if dynamic:
        dynamic_axes[input_names[0]] = {0: "batch", **({2: "height", 3: "width"} if dynamic_hw else {})}
        for name in output_names:
            dynamic_axes[name] = {0: "batch"}
        if dynamic_hw and task in ("detect", "segment"):
            dynamic_axes[output_names[0]][1 if post is not None else 2] = "anchors"
            if task == "segment" and len(output_names) > 1:
                dynamic_axes[output_names[1]].update({2: "proto_height", 3: "proto_width"})
    wrapper = _Exportable(model, task, post).eval()
    example = torch.zeros(batch_size, 3, h, w, device=device)

    try:
        with atomic_path(path) as tmp, _export_mode(model, dynamic_hw=dynamic and dynamic_hw), \
                torch.no_grad(), warnings.catch_warnings(), _without_jit_lint():
            warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)
            warnings.filterwarnings("ignore", category=UserWarning)
            warnings.filterwarnings("ignore", category=DeprecationWarning)
            warnings.filterwarnings("ignore", category=FutureWarning)
            try:
                torch.onnx.export(wrapper, (example,), str(tmp), dynamo=False, opset_version=opset,
                                  input_names=input_names, output_names=output_names,
                                  dynamic_axes=dynamic_axes or None, do_constant_folding=True)
            except OSError:
                raise
            except Exception as e:  # the exporter raises many types (unsupported opset / op, tracing errors)
                why = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                other = "try --opset 17" if opset != 17 else "another opset (--opset 18-20) may write it"
                raise QATError(f"torch.onnx.export failed at opset {opset} ({type(e).__name__}: {why}); the "
                               f"TorchScript exporter supports opsets 13-20 here: {other}.") from e
            onnx_model = onnx.load(str(tmp))
            if len(wrapper.shapes) != len(output_names):
                raise QATError(f"the model produced {len(wrapper.shapes)} outputs but {len(output_names)} names were "
                               f"given ({', '.join(output_names)}); is --task right for this model?")
            _fix_output_shapes(onnx_model, wrapper.shapes, dynamic_axes)
            onnx_model, deduped = onnx_qdq.dedupe_qdq(onnx_model)
            folded = fold_weight_qdq(onnx_model, quantized_weights(wrapper)) if quantized else 0
            simplify_status = "off"
            if simplify:
                try:
                    onnx_model = onnx_qdq.simplify(onnx_model)
                    simplify_status = "done"
                except RuntimeError as e:
                    simplify_status = f"failed: {e}; kept the unsimplified graph"
            if half:
                onnx_model = to_fp16(onnx_model, (h, w), batch_size)
            lint = None
            if quantized:  # the graph TensorRT gets (after FP16 conversion: AutoCast rewrites the Q/DQ scales)
                patterns = tuple(onnx_lint.DEFAULT_ALLOW_FP) + tuple(module_to_onnx_pattern(p) for p in allow_fp)
                lint = onnx_lint.lint(onnx_model, allow_fp=patterns)
            summary = onnx_lint.qdq_summary(onnx_model, lint)  # the lint's counts: no second lint
            if nms is not None:
                onnx_model = e2e.append_nms(onnx_model, nc=nc, task=task, options=nms,
                                            pred=output_names[0], protos=output_names[-1])
            meta = {
                **ArtifactMeta(stride=stride, names={int(k): str(v) for k, v in names.items()}, task=task,
                               imgsz=[h, w]).props(),
                "batch": "dynamic" if dynamic else str(batch_size),
                "dynamic": json.dumps({"batch": bool(dynamic), "hw": bool(dynamic and dynamic_hw)}),
                "quantized": "true" if quantized else "false",
                "half": "true" if half else "false",
                "end2end": json.dumps(nms.to_dict()) if nms is not None else "null",
                "version": __version__,
                "producer": "yolov9-qat export_onnx",
            }
            if provenance.toolkit_commit():
                meta["toolkit_commit"] = provenance.toolkit_commit()
            meta.update({k: v for k, v in (metadata or {}).items() if v is not None})
            write_props(onnx_model, meta)
            onnx_model.producer_name = "yolov9-qat"
            onnx_model.producer_version = __version__
            onnx.checker.check_model(onnx_model)
            onnx.save(onnx_model, str(tmp))
            readable(tmp)
    except OSError as e:
        raise QATError(f"cannot write {path} ({e.strerror or e}); choose a writable folder or free some disk "
                       f"space.") from e
    except onnx.checker.ValidationError as e:
        raise QATError(f"the exported graph failed the ONNX checker ({str(e).splitlines()[0]}); try another "
                       f"--opset (13-20) or export without --half.") from e

    final = onnx_qdq.graph_io(onnx_model) if nms is not None else summary
    return {
        "path": str(path),
        "size": path.stat().st_size,
        "inputs": final["inputs"],
        "outputs": final["outputs"],
        "opset": final["opset"],
        "quantized": quantized,
        "qdq_pairs": summary["qdq_pairs"],
        "quantized_conv": summary["quantized_conv"],
        "conv": summary["conv"],
        "deduped": deduped,
        "int8_weights": folded,
        "lint": lint,
        "simplify": simplify_status,
        "half": bool(half),
        "end2end": nms.to_dict() if nms is not None else None,
        "metadata": meta,
        "seconds": round(time.time() - start, 1),
    }


def _shape(io: dict) -> str:
    shape = io.get("shape")
    dims = "?" if shape is None else "x".join("?" if d is None else str(d) for d in shape)
    return f"{io['name']} {dims} {io.get('dtype') or ''}".rstrip()


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def format_report(report: dict) -> str:
    """What an export wrote, for the CLIs to print."""
    lines = [f"wrote {report['path']} ({_size(report['size'])}, {report['seconds']} s)",
             f"  inputs:  {', '.join(_shape(i) for i in report['inputs'])}",
             f"  outputs: {', '.join(_shape(o) for o in report['outputs'])}",
             f"  opset {report['opset']}, {'INT8 Q/DQ' if report['quantized'] else 'floating point'}"
             + (", FP16 by ModelOpt AutoCast (inputs/outputs FP32)" if report["half"] else "")
             + f", simplify: {report['simplify']}"]
    if report["quantized"]:
        lines.append(f"  Q/DQ pairs {report['qdq_pairs']} (merged {report['deduped']} redundant nodes), "
                     f"quantized convs {report['quantized_conv']}/{report['conv']}, "
                     f"{report['int8_weights']} weights stored as INT8")
    if report["end2end"]:
        e = report["end2end"]
        seg = report.get("metadata", {}).get("task") == "segment"
        plugin = (("EfficientNMSX_TRT plugin (third-party, not in TensorRT)" if seg else "EfficientNMS_TRT plugin")
                  if e["backend"] == "trt" else "ONNX NonMaxSuppression (TensorRT's native NMS layer)")
        lines.append(f"  End2End: {plugin}, topk {e['topk_all']}, iou {e['iou_thres']}, conf {e['conf_thres']}"
                     + (", class-agnostic" if e["class_agnostic"] else ""))
    if report["lint"] is not None:
        text = onnx_lint.format_lint(report["lint"])
        lines.extend("  " + line for line in text.splitlines())
    return "\n".join(lines)
