"""Prediction backends for the shared evaluator: what every backend has (:class:`Backend`), PyTorch (FP or
fake-quant), ONNX Runtime, OpenVINO (the same .onnx on the CPU, INT8 kernels for its Q/DQ; imported only when
asked for), and :func:`open_backend`, which opens a .pt, .onnx or .engine file as one.

A backend is a callable ``backend(images) -> raw output`` where ``images`` is float32 B x 3 x H x W in [0, 1]
on ``backend.device``. It returns the detection head's inference output ``(B, 4 + nc, A)`` (xywh boxes in
input pixels, class scores), for a segmentation model ``(pred, protos)``, or for End2End graphs a dict of
``artifact.END2END_OUTPUTS`` (and ``MASK_OUTPUT``). The TensorRT backend lives in ``utils/qat/trt/trt_engine.py``.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.nn as nn

from utils.qat.core import yolov9
from utils.qat.core.artifact import ArtifactMeta, check_fixed_input, is_end2end, task_from_outputs
from utils.qat.core.device import exact_int8_dot
from utils.qat.core.errors import QATError
from utils.qat.evaluation.openvino_core import shared_core
from utils.qat.evaluation.openvino_probe import openvino_int8_exact

if TYPE_CHECKING:
    from os import PathLike

#: File suffix -> backend kind; the kind -> the runtime's name in reports.
FORMATS = {".pt": "torch", ".onnx": "onnxruntime", ".engine": "tensorrt"}
RUNTIMES = {"torch": "PyTorch", "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO", "tensorrt": "TensorRT"}
#: The runtimes that run an .onnx file (the first is the default).
ONNX_RUNTIMES = ("onnxruntime", "openvino")


class Backend(Protocol):
    """What the evaluator (``utils.qat.evaluation.evaluate``) reads from every backend."""
    runtime: str  # a name for reports: PyTorch, ONNX Runtime, OpenVINO, TensorRT
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
    model is evaluated as INT8 runtimes compute it: a copy whose quantized convolutions sum integer codes exactly
    (``utils.qat.quantize.integer_conv``), so that its score depends neither on the device's kernels nor on the thread
    count, in full float32 elsewhere (``utils.qat.quantize.qdq.full_fp32``: no TF32). ``silu_ulp_seed``: for
    measurement only, its SiLUs one step off on a random half of their outputs (``integer_conv.UlpJitter``)."""

    runtime = "PyTorch"

    def __init__(self, model: nn.Module, device: torch.device, task: str = "detect", *,
                 silu_ulp_seed: int | None = None):
        qnn = sys.modules.get("modelopt.torch.quantization.nn")  # a fake-quant model has imported it
        self.quantized = qnn is not None and any(isinstance(m, qnn.TensorQuantizer) for m in model.modules())
        if self.quantized:
            from utils.qat.quantize.integer_conv import integer_form
            model = integer_form(model, silu_ulp_seed)
        self.model = model.to(device).eval()
        self.device = device
        self.stride = yolov9.model_stride(model)
        self.names = dict(model.names)
        self.batch_size = None
        self.imgsz = None
        self.end2end = False
        self.task = task

    @torch.no_grad()
    def __call__(self, images: torch.Tensor):
        from utils.qat.quantize.qdq import full_fp32
        with full_fp32() if self.quantized else contextlib.nullcontext():
            out = yolov9.outputs(self.model(images), self.task)
        return out if len(out) > 1 else out[0]


class _GraphBackend:
    """What ONNX Runtime and OpenVINO share: the graph's input and outputs as the evaluator needs them. A
    subclass opens the graph, calls :meth:`_describe`, and runs it in :meth:`run`."""

    runtime = ""

    def _describe(self, path: Path, input_shape: Sequence, fp16: bool, output_names: list[str],
                  output_ranks: list[int], metadata: Mapping[str, str]) -> None:
        self.device = torch.device("cpu")  # images are handed over as numpy
        self.fp16 = fp16
        b, _, h, w = input_shape
        self.batch_size = b if isinstance(b, int) else None
        self.imgsz = (h, w) if isinstance(h, int) and isinstance(w, int) else None
        check_fixed_input(self.batch_size, *(self.imgsz or (None, None)), path)
        self.output_names = output_names
        self.end2end = is_end2end(output_names)
        meta = ArtifactMeta.read(metadata)
        self.stride = yolov9.artifact_stride(meta.stride, path, f"the metadata of {path}")
        self.names = meta.names
        self.task = meta.task or task_from_outputs(output_names, output_ranks)

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        """The graph's outputs for the input ``x`` (already of the graph's batch size and dtype), in the order
        of :attr:`output_names`."""
        raise NotImplementedError

    def __call__(self, images: torch.Tensor):
        x = images.detach().cpu().numpy().astype(np.float16 if self.fp16 else np.float32)
        n = x.shape[0]
        if self.batch_size is not None and n != self.batch_size:
            if n > self.batch_size:
                raise QATError(f"the ONNX graph has a fixed batch of {self.batch_size}; use --batch-size "
                               f"{self.batch_size} or export with --dynamic.")
            x = np.concatenate([x, np.zeros((self.batch_size - n, *x.shape[1:]), x.dtype)])
        outs = [torch.from_numpy(np.asarray(o))[:n] for o in self.run(x)]
        outs = [o.float() if o.is_floating_point() else o for o in outs]
        if self.end2end:
            return dict(zip(self.output_names, outs))
        preds = yolov9.exported_outputs(outs, self.task)
        return preds if len(preds) > 1 else preds[0]


def _missing_onnx(path: Path) -> QATError:
    return QATError(f"ONNX file not found: {path}; export one with export_qat.py first.")


#: How ORTBackend computes a Q/DQ graph (``arithmetic``).
ORT_ARITHMETICS = {
    "integer": "integer convolutions and a once-rounded SiLU, as qat.py scores the checkpoint "
               "(utils/qat/onnx/integer_graph.py)",
    "float": "the file as ONNX Runtime runs it itself: float32 convolutions of the dequantized values",
    "basic": "the file with ONNX Runtime's basic rewrites only: each operator as ONNX defines it",
}


class ORTBackend(_GraphBackend):
    """Runs an exported ONNX graph (plain or End2End) with ONNX Runtime. ``threads``: its intra-op threads
    (None: ONNX Runtime's default, one per core). ``arithmetic`` (:data:`ORT_ARITHMETICS`): ``integer``, the
    default, scores a Q/DQ graph in the arithmetic ``qat.py`` scores its checkpoint with, so that the two scores are
    one (a graph without Q/DQ convolutions runs as it is); ``float`` runs the file as a plain ONNX Runtime session does
    (what a speed figure measures); ``basic`` keeps ONNX Runtime to its basic rewrites."""

    runtime = "ONNX Runtime"

    def __init__(self, onnx_path: str | Path, device: torch.device | str = "cpu", *, threads: int | None = None,
                 arithmetic: str = "integer"):
        import onnxruntime as ort
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise _missing_onnx(onnx_path)
        if arithmetic not in ORT_ARITHMETICS:
            raise QATError(f"ONNX Runtime arithmetic {arithmetic!r} is not one of {', '.join(ORT_ARITHMETICS)}.")
        device = torch.device(device)
        providers: list = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" not in ort.get_available_providers():
                raise QATError("onnxruntime here has no CUDA provider; use --device cpu or install onnxruntime-gpu.")
            providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if arithmetic == "basic":
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        self.arithmetic = arithmetic
        try:
            source = _integer_graph(onnx_path) if arithmetic == "integer" else str(onnx_path)
            self.session = ort.InferenceSession(source, opts, providers=providers)
        except Exception as e:  # onnxruntime raises its own types for unreadable graphs
            raise QATError(f"ONNX Runtime cannot load {onnx_path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                           f"re-export it with export_qat.py (graphs with TensorRT plugins, e.g. --nms trt, run in "
                           f"TensorRT only: export with --nms onnx to evaluate here).") from e
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        outputs = self.session.get_outputs()
        self._describe(onnx_path, inp.shape, inp.type == "tensor(float16)", [o.name for o in outputs],
                       [len(o.shape) for o in outputs], self.session.get_modelmeta().custom_metadata_map)

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        return self.session.run(None, {self.input_name: x})


def _integer_graph(onnx_path: Path) -> str | bytes:
    """The graph at ``onnx_path`` rewritten into integer arithmetic (serialized), or its path where there is nothing
    to rewrite (an FP graph, or one re-encoded for a CPU runtime, whose quantizers sit where that runtime fuses
    them)."""
    import onnx

    from utils.qat.core.artifact import read_props
    from utils.qat.onnx.avx2 import ENCODING_KEY
    from utils.qat.onnx.integer_graph import integer_arithmetic
    model = onnx.load(str(onnx_path))
    if ENCODING_KEY in read_props(model) or not any(integer_arithmetic(model).values()):
        return str(onnx_path)
    return model.SerializeToString()


#: What ``./install_dependencies.sh --openvino`` installs.
OPENVINO_INSTALL = "./install_dependencies.sh --openvino"


def require_openvino():
    """The ``openvino`` module, or a QATError naming the install command."""
    try:
        import openvino
    except ImportError as e:
        raise QATError(f"OpenVINO is not installed (import openvino: {e}); install it with {OPENVINO_INSTALL} "
                       f"(pip install openvino), or score the graph with --backend onnxruntime.") from e
    return openvino


@functools.lru_cache(maxsize=None)
def _inexact_notice(version: str) -> None:
    """Says once per process why OpenVINO's outputs for an INT8 graph are wrong on this CPU, and what to run instead."""
    from utils.qat.core.device import cpu_description
    from utils.qat.evaluation.openvino_probe import openvino_int8_error
    cpu = cpu_description()[0]
    if exact_int8_dot() is False:
        why = (f"this CPU ({cpu}) has no VNNI or AMX: OpenVINO's INT8 convolutions saturate 16-bit sums here, and its "
               f"outputs for this INT8 graph are wrong (YOLOv9-t and GELAN-C scored mAP50-95 0.000-0.003 on such a CPU)")
    else:
        why = (f"OpenVINO {version} does not compute INT8 graphs as written on this CPU ({cpu}): a quantized "
               f"concatenation feeding a convolution, run as a probe, came out {openvino_int8_error():.1%} off its "
               f"exact result (utils/qat/evaluation/openvino_probe.py), so its outputs for this INT8 graph are wrong")
    print(f"notice: {why}; score the graph with --backend onnxruntime, run the graph export_qat.py --openvino-avx2 "
          f"writes for such CPUs, or the FP32 graph, or deploy INT8 on a CPU where OpenVINO computes it as written.")


class OpenVINOBackend(_GraphBackend):
    """Runs an exported ONNX graph (plain or End2End) with OpenVINO on the CPU. OpenVINO reads each Q/DQ pair
    as a FakeQuantize and runs the quantized convolutions with INT8 kernels; what stays in floating point runs
    in ``precision`` ('f32' by default: CPUs with AMX or AVX512-BF16 would otherwise run it in bf16, OpenVINO's
    default there, and score another model than the graph; None: OpenVINO's default, as users run it, which
    :attr:`precision` then names). It also opens an OpenVINO IR (``.xml``, e.g. NNCF's), for timing.

    ``threads``: inference threads (None: OpenVINO's default, every core); ``shape``: (B, 3, H, W) to fix the
    input shape before compiling (a dynamic graph runs at any shape, a static shape runs faster);
    ``profile``: per-layer times (:meth:`layer_times`), which cost a little speed.

    On x86 CPUs without VNNI or AMX (AVX2, AVX-512 alone) OpenVINO's INT8 convolutions add pairs of 8-bit products
    into 16-bit sums that saturate (OpenVINO's "saturation issue"; ``utils.qat.core.device.exact_int8_dot``): the
    graph then computes something else than it says. On YOLO graphs the outputs are useless there (mAP50-95 near 0
    on an AMD EPYC with AVX2 alone, benchmarks/results/cpu-deploy-2core-avx2.md). On an AMD EPYC with AVX512-VNNI
    a quantized concatenation feeding a convolution comes out wrong too (``openvino_probe.py``), so whether a graph
    runs as written is asked of a probe graph, not of the flags. The graph ``export_qat.py --openvino-avx2`` writes
    (utils/qat/onnx/avx2.py) ran as written on both. :attr:`inexact` is True where the probe misses for any other
    quantized graph, and a notice says so once per process.
    """

    runtime = "OpenVINO"

    def __init__(self, onnx_path: str | Path, device: torch.device | str = "cpu", *, threads: int | None = None,
                 shape: Sequence[int] | None = None, precision: str | None = "f32", profile: bool = False):
        ov = require_openvino()
        onnx_path = Path(onnx_path)
        if not onnx_path.is_file():
            raise _missing_onnx(onnx_path)
        if torch.device(device).type != "cpu":
            raise QATError(f"OpenVINO runs on the CPU here, not on {device}; pass --device cpu.")
        core = shared_core()  # one per process: see openvino_core.py for the crash a Core per graph caused
        try:
            model = core.read_model(str(onnx_path))
            if shape is not None:
                model.reshape({model.inputs[0].get_any_name(): ov.PartialShape([int(d) for d in shape])})
            config = {"PERFORMANCE_HINT": "LATENCY", "PERF_COUNT": bool(profile)}
            if precision is not None:  # None: OpenVINO's own choice for this CPU (bf16 where AMX or AVX512-BF16)
                config["INFERENCE_PRECISION_HINT"] = precision
            if threads:
                config["INFERENCE_NUM_THREADS"] = int(threads)
            self.compiled = core.compile_model(model, "CPU", config)
        except Exception as e:  # OpenVINO raises RuntimeError (and its own types) for graphs it cannot read
            raise QATError(f"OpenVINO cannot load {onnx_path} ({type(e).__name__}: "
                           f"{(str(e).strip().splitlines() or [''])[0][:200]}); re-export it with export_qat.py "
                           f"(graphs with TensorRT plugins, e.g. --nms trt, run in TensorRT only: export with "
                           f"--nms onnx to evaluate here).") from e
        self.request = self.compiled.create_infer_request()
        self.version = ov.get_version()
        #: the precision OpenVINO computes floating point in, as compiled ('f32', 'bf16', 'f16')
        self.precision = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        framework = model.get_rt_info()["framework"] if model.has_rt_info("framework") else {}
        metadata = {k: model.get_rt_info(["framework", k]).astype(str) for k in framework}
        self.quantized = any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())
        # a graph re-encoded for these CPUs (export_qat.py --openvino-avx2) runs on them as written (imported here: onnx
        # takes a second to import, and a run that scores only in PyTorch never needs it)
        from utils.qat.onnx.avx2 import AVX2_ENCODING, ENCODING_KEY
        self.inexact = (self.quantized and metadata.get(ENCODING_KEY) != AVX2_ENCODING
                        and not openvino_int8_exact())
        if self.inexact:
            _inexact_notice(str(self.version))
        inp = self.compiled.inputs[0]
        dims = [d.get_length() if d.is_static else None for d in inp.get_partial_shape()]
        outputs = self.compiled.outputs
        self._describe(onnx_path, dims, inp.get_element_type() == ov.Type.f16, [o.get_any_name() for o in outputs],
                       [o.get_partial_shape().rank.get_length() for o in outputs], metadata)

    def run(self, x: np.ndarray) -> list[np.ndarray]:
        self.request.infer({0: x})
        return [self.request.get_output_tensor(i).data.copy() for i in range(len(self.output_names))]

    def layers(self) -> list[dict]:
        """The compiled model's execution graph, one entry per executed node: ``name``, ``type`` (OpenVINO's
        layer type: Convolution, Eltwise, ...), ``precision`` (the precision it computes in: i8, u8, f32, ...),
        ``primitive`` (the kernel, e.g. brgconv_avx512_I8) and ``fused`` (the ONNX nodes it runs)."""
        out = []
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            field = {k: info[k].astype(str) for k in ("layerType", "runtimePrecision", "primitiveType",
                                                       "originalLayersNames") if k in info}
            if field.get("layerType") in (None, "Const", "Input", "Output"):
                continue
            out.append({"name": op.get_friendly_name(), "type": field.get("layerType"),
                        "precision": field.get("runtimePrecision"), "primitive": field.get("primitiveType"),
                        "fused": field.get("originalLayersNames", "").split(",")})
        return out

    def layer_times(self) -> dict[str, float]:
        """Microseconds per executed node in the last inference (``profile=True``), by node name."""
        return {p.node_name: p.real_time.total_seconds() * 1e6 for p in self.request.get_profiling_info()
                if p.real_time.total_seconds() > 0}


def open_backend(path: str | PathLike, device: str = "", *, kind: str | None = None,
                 plugins: Sequence[str | PathLike] = (), trust: bool = False,
                 ort_arithmetic: str = "integer") -> Backend:
    """The backend for a model file: ``kind`` 'torch' (a .pt checkpoint, quantized or FP), 'onnxruntime' or
    'openvino' (.onnx) or 'tensorrt' (.engine, with its ``plugins`` libraries); by default from the suffix
    (:data:`FORMATS`). ``device``: as ``--device`` takes it; '' is the first GPU (TensorRT, PyTorch) or the CPU
    (ONNX Runtime, OpenVINO).
    ``trust``: read a .pt with the full pickle (``utils.qat.model.checkpoint.read``). ``ort_arithmetic``: how ONNX
    Runtime computes a Q/DQ graph (:data:`ORT_ARITHMETICS`)."""
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
        return ORTBackend(path, select_device(device) if device else torch.device("cpu"), arithmetic=ort_arithmetic)
    if kind == "openvino":
        return OpenVINOBackend(path, select_device(device) if device else torch.device("cpu"))
    from utils.qat.model import checkpoint
    ckpt = checkpoint.read(path, trust)
    task = checkpoint.task_of(ckpt)
    if checkpoint.is_quantized(ckpt):
        model = checkpoint.load_quantized(path, task=task, ckpt=ckpt, trust=trust)[0]
    else:
        model = checkpoint.load_fp(path, task=task, ckpt=ckpt)
    return TorchBackend(model, select_device(device), task=task)
