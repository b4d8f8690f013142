"""TensorRT 10/11 engine building and the engine runner (a backend for the shared evaluator).

Written from the TensorRT 10 and 11 Python API documentation and type-checked against
``tensorrt-stubs``; ``tensorrt`` is imported lazily so that this module imports without it.

- :func:`build_engine`: plugins (TensorRT's own, ``init_libnvinfer_plugins``, and any ``plugins``
  libraries) -> ONNX parser -> builder config -> optimization profile -> serialized engine, written
  atomically, plus a JSON sidecar ``X.engine.json`` (TensorRT version, stride, names, imgsz, end2end,
  task, onnx, plugins) so nothing downstream hard-codes a stride; with ``layer_info`` also the layer
  JSON ``X.engine.layer.json`` (``ProfilingVerbosity.DETAILED`` + ``IEngineInspector``).
  TensorRT 10: an explicit-quantization (Q/DQ) ONNX is built weakly typed with the FP16 and INT8
  builder flags, or strongly typed when asked. TensorRT 11: strongly typed only; the FP16/INT8
  builder flags no longer exist, FP16 for non-quantized parts comes from a ``--half`` export.
- :class:`TRTBackend`: loads the plugins, then runs an engine through the named I/O tensor API
  (``set_input_shape``, ``set_tensor_address``, ``execute_async_v3``) with torch CUDA tensors as
  device buffers.

Every TensorRT call here is listed, with the TensorRT 10.x / 11.x documentation or source that says
how it behaves, in docs/TENSORRT.md ("TensorRT API, flags and plugins used").
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, Union

from utils.qat.core.artifact import ArtifactMeta, check_fixed_input, is_end2end, read_props, task_from_outputs
from utils.qat.core.atomic import atomic_path, write_text
from utils.qat.core.errors import QATError
from utils.qat.trt.trt_common import (INSTALL_TENSORRT, check_batches, check_plugin_files, profile_shapes, release,
                                  require_onnx, require_tensorrt, version_tuple)
from utils.qat.core.yolov9 import Output, artifact_stride, exported_outputs

if TYPE_CHECKING:  # torch is imported where it is used, so that the metadata helpers load fast (trtexec path)
    import tensorrt as trt
    import torch


METADATA_SUFFIX = ".json"  # the sidecar of X.engine is X.engine.json
LAYER_INFO_SUFFIX = ".layer.json"  # X.engine.layer.json, as trtexec --exportLayerInfo names it here
#: Plugins that TensorRT's own plugin library (libnvinfer_plugin) does not provide.
THIRD_PARTY_PLUGINS = {"EfficientNMSX_TRT": "third-party plugin builds (such as those DeepStream YOLO setups "
                                            "compile), not NVIDIA's plugin library"}
#: ONNX ops that TensorRT's ONNX parser imports as a plugin of its own (name, version): RoiAlign is ROIAlign_TRT
#: version 2 (IPluginV3) since TensorRT 10.1 (onnx-tensorrt onnxOpImporters.cpp, DEFINE_BUILTIN_OP_IMPORTER(RoiAlign)).
PARSER_PLUGINS = {"RoiAlign": ("ROIAlign_TRT", "2")}

PathLike = Union[str, "os.PathLike[str]"]


# ----------------------------------------------------------------------------- version, imports
def _require_cuda() -> None:
    import torch
    if not torch.cuda.is_available():
        raise QATError("no CUDA GPU is visible (torch.cuda.is_available() is False): TensorRT engines are "
                       "built and run on an NVIDIA GPU; run this on a machine with one (check nvidia-smi and "
                       "CUDA_VISIBLE_DEVICES).")


def _cuda_device(device: str | torch.device) -> torch.device:
    import torch
    _require_cuda()
    dev = torch.device(device)
    if dev.type != "cuda":
        raise QATError(f"TensorRT engines run on a CUDA device, not {dev}; pass --device cuda:0 (or another GPU).")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.index >= torch.cuda.device_count():
        raise QATError(f"{dev} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s); "
                       f"pass --device cuda:0 .. cuda:{torch.cuda.device_count() - 1}.")
    return dev


def _dims(d: Any) -> tuple[int, ...]:
    """A ``tensorrt.Dims`` (or any sequence) as a tuple of ints."""
    return tuple(int(d[i]) for i in range(len(d)))


# ----------------------------------------------------------------------------- logger, plugins
def _make_logger(verbose: bool = False) -> trt.ILogger:
    """A ``tensorrt.ILogger`` that prints like ``trt.Logger`` and keeps the errors (``.errors``), so that a
    failure can be named in one sentence (a missing plugin, a parser error)."""
    import tensorrt as trt

    severity = trt.ILogger.Severity
    threshold = severity.VERBOSE if verbose else severity.WARNING
    errors = (severity.ERROR, severity.INTERNAL_ERROR)

    class CapturingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, sev: trt.ILogger.Severity, msg: str) -> None:
            if sev in errors:
                self.errors.append(str(msg))
            if int(sev) <= int(threshold):
                print(f"[TensorRT] {getattr(sev, 'name', sev)}: {msg}", file=sys.stderr)

    return CapturingLogger()


def load_plugins(logger: trt.ILogger, plugins: Sequence[PathLike] = ()) -> None:
    """Register TensorRT's own plugins (``init_libnvinfer_plugins``: EfficientNMS_TRT, ROIAlign_TRT, ...), then
    load each plugin library in ``plugins``; their creators register themselves when the library loads, as with
    ``trtexec --staticPlugins`` and Polygraphy's ``--plugins`` (``ctypes.CDLL``). Needed before parsing an ONNX
    with plugin nodes and before deserializing an engine that holds plugins: trtexec does both itself, a Python
    process does not (NVIDIA/TensorRT issue #2675)."""
    import tensorrt as trt
    if not trt.init_libnvinfer_plugins(logger, ""):
        raise QATError("TensorRT could not register its plugin library (init_libnvinfer_plugins failed); check "
                       f"that libnvinfer_plugin comes with the installed TensorRT ({INSTALL_TENSORRT}).")
    check_plugin_files(plugins)
    for p in plugins:
        path = Path(p)
        try:
            ctypes.CDLL(str(path.resolve()), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise QATError(f"could not load plugin library {path} ({e}); build it against the installed TensorRT "
                           f"and CUDA and pass it again.") from e


def plugin_hint(name: str) -> str:
    """Where a plugin comes from, for the error sentences."""
    if name in THIRD_PARTY_PLUGINS:
        return f"{name} is not part of TensorRT (it comes from {THIRD_PARTY_PLUGINS[name]}): pass that library"
    return f"{name} should come with TensorRT's plugin library (libnvinfer_plugin); if it is your own, pass its library"


def missing_plugins(required: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    """The plugins of ``required`` (``{"name", "version", "namespace"}``) with no creator in the registry."""
    import tensorrt as trt
    registry = trt.get_plugin_registry()
    return [p for p in required
            if registry.get_creator(p["name"], p["version"], p.get("namespace", "")) is None]


def _require_plugins(required: Sequence[dict[str, str]], what: str) -> None:
    missing = missing_plugins(required)
    if missing:
        p = missing[0]
        raise QATError(f"{what} needs the plugin {p['name']} (version {p['version']}), which is not registered: "
                       f"{plugin_hint(p['name'])} with --plugins PATH.so.")


def _plugin_from_log(errors: Sequence[str]) -> str | None:
    """The plugin a deserialization error names ("getPluginCreator could not find plugin: X version: 1")."""
    for line in errors:
        m = re.search(r"could not find plugin:?\s*([A-Za-z0-9_]+)", line, re.IGNORECASE)
        if m:
            return m.group(1)
    return None


# ----------------------------------------------------------------------------- metadata sidecar
def metadata_path(engine_path: PathLike) -> Path:
    p = Path(engine_path)
    return p.with_name(p.name + METADATA_SUFFIX)


def onnx_metadata(onnx_path: PathLike) -> dict[str, Any]:
    """Stride, names, task and End2End-ness of an exported ONNX (its ``metadata_props``, read by
    ``utils.qat.core.artifact``: this toolkit's export or upstream YOLOv9's), its image input and the plugins it
    needs. Missing pieces are None; needs the ``onnx`` package."""
    meta: dict[str, Any] = {"stride": None, "names": None, "end2end": False, "task": "detect", "imgsz": None,
                            "input_name": None, "plugins": []}
    try:
        import onnx
    except ImportError:
        return meta
    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # not an ONNX file: the TensorRT parser says so with its own error
        return meta
    art = ArtifactMeta.read(read_props(model))
    meta["stride"], meta["names"] = art.stride, art.names
    outputs = [o.name for o in model.graph.output]
    meta["end2end"] = is_end2end(outputs)
    meta["task"] = art.task or task_from_outputs(outputs, [len(o.type.tensor_type.shape.dim) for o in model.graph.output])
    meta["plugins"] = onnx_plugins(model)
    from utils.qat.onnx.onnx_graph import graph_inputs, input_dims
    inputs = graph_inputs(model)
    if inputs:
        meta["input_name"] = inputs[0].name
        dims = input_dims(inputs[0])
        if len(dims) == 4 and dims[2] and dims[3]:
            meta["imgsz"] = [int(dims[2]), int(dims[3])]
    return meta


def onnx_plugins(model: Any) -> list[dict[str, str]]:
    """The TensorRT plugins an ONNX graph needs: its custom-domain nodes (the parser's fallback importer looks
    them up by op type, ``plugin_version`` (default "1") and ``plugin_namespace``) and the ONNX ops the parser
    itself imports as a plugin (``PARSER_PLUGINS``)."""
    from onnx import helper
    found: dict[tuple[str, str, str], None] = {}
    for n in model.graph.node:
        if n.domain not in ("", "ai.onnx", "ai.onnx.ml"):
            attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
            version, namespace = attrs.get("plugin_version", b"1"), attrs.get("plugin_namespace", b"")
            found[(n.op_type, version.decode() if isinstance(version, bytes) else str(version),
                   namespace.decode() if isinstance(namespace, bytes) else str(namespace))] = None
        elif n.op_type in PARSER_PLUGINS:
            name, version = PARSER_PLUGINS[n.op_type]
            found[(name, version, "")] = None
    return [{"name": a, "version": b, "namespace": c} for a, b, c in found]


def write_engine_metadata(engine_path: PathLike, onnx_path: PathLike | None, *, tensorrt_version: str | None,
                          builder: str, imgsz: Sequence[int] | None = None, batch: dict[str, int] | None = None,
                          strongly_typed: bool | None = None, precision_flags: Sequence[str] = (),
                          extra: dict[str, Any] | None = None) -> Path:
    """Write ``X.engine.json`` beside the engine (atomically)."""
    meta = onnx_metadata(onnx_path) if onnx_path is not None and Path(onnx_path).is_file() else {}
    art = ArtifactMeta(stride=meta.get("stride"), names=meta.get("names"), task=meta.get("task", "detect"),
                       imgsz=list(imgsz) if imgsz is not None else meta.get("imgsz")).sidecar()
    doc: dict[str, Any] = {
        "format": 1,
        "tensorrt": tensorrt_version,
        "builder": builder,
        "onnx": str(onnx_path) if onnx_path is not None else None,
        "stride": art["stride"],
        "names": art["names"],
        "imgsz": art["imgsz"],
        "end2end": bool(meta.get("end2end", False)),
        "task": art["task"],
        "input_name": meta.get("input_name"),
        "batch": batch,
        "strongly_typed": strongly_typed,
        "precision_flags": list(precision_flags),
        "plugins": meta.get("plugins", []),
    }
    doc.update(extra or {})
    return write_text(metadata_path(engine_path), json.dumps(doc, indent=2) + "\n")


def read_engine_metadata(engine_path: PathLike) -> dict[str, Any]:
    """The sidecar of ``engine_path`` ({} when absent or unreadable); ``stride``, ``names`` (int keys), ``task`` and
    ``imgsz`` read by ``utils.qat.core.artifact`` (None where unknown)."""
    p = metadata_path(engine_path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(doc, dict):
        return {}
    art = ArtifactMeta.read(doc)
    return {**doc, "stride": art.stride, "names": art.names, "task": art.task, "imgsz": art.imgsz}


# ----------------------------------------------------------------------------- building
def _workspace_bytes(workspace_gib: float | None) -> int:
    if workspace_gib is not None:
        if workspace_gib <= 0:
            raise QATError(f"workspace must be positive, got {workspace_gib} GiB; pass e.g. --workspace 4.")
        return int(workspace_gib * (1 << 30))
    import torch
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def build_engine(onnx_path: PathLike, engine_path: PathLike, *, min_batch: int = 1, opt_batch: int | None = None,
                 max_batch: int = 16, imgsz: int | Sequence[int] | None = None, strongly_typed: bool | None = None,
                 fp16: bool = True, int8: bool = True, workspace_gib: float | None = None,
                 timing_cache: PathLike | None = None, plugins: Sequence[PathLike] = (), layer_info: bool = False,
                 verbose: bool = False) -> Path:
    """Build a TensorRT engine from an exported ONNX and save it (and ``X.engine.json``) atomically.

    ``strongly_typed=None`` means: weakly typed with FP16/INT8 builder flags on TensorRT 10, strongly
    typed on TensorRT 11 (its only mode). ``workspace_gib=None`` uses the free GPU memory. ``plugins``:
    plugin libraries (.so) for graphs with plugins TensorRT does not ship (e.g. EfficientNMSX_TRT).
    ``layer_info``: build with ``ProfilingVerbosity.DETAILED`` and write the engine's layer information
    (``IEngineInspector``, the schema of ``trtexec --exportLayerInfo``) to ``X.engine.layer.json``.
    """
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    require_onnx(onnx_path)
    opt_batch = max_batch if opt_batch is None else opt_batch
    check_batches(min_batch, opt_batch, max_batch)
    require_tensorrt()
    import tensorrt as trt
    version = str(trt.__version__)
    major, minor = version_tuple(version)
    if major < 10:
        raise QATError(f"TensorRT {version} is too old: this toolkit needs TensorRT 10 or 11 (named I/O tensor "
                       f"API); upgrade with {INSTALL_TENSORRT}.")
    if major >= 11 and strongly_typed is False:
        raise QATError(f"TensorRT {version} builds strongly typed networks only (its FP16/INT8 builder flags are "
                       f"gone), so strongly_typed=False cannot work: build strongly typed, and export the ONNX "
                       f"with --half to run the non-quantized parts in FP16.")
    strong = major >= 11 or bool(strongly_typed)
    _require_cuda()

    meta = onnx_metadata(onnx_path)
    logger = _make_logger(verbose)
    load_plugins(logger, plugins)  # before parsing: the parser looks plugin nodes up in the registry
    _require_plugins(meta["plugins"], str(onnx_path))
    if (major, minor) >= (10, 12) and any(p["name"] == "EfficientNMS_TRT" for p in meta["plugins"]):
        print(f"note: EfficientNMS_TRT is deprecated since TensorRT 10.12 (TensorRT {version} is installed); "
              f"export with --nms onnx for TensorRT's native NMS layer.", file=sys.stderr)
    builder = trt.Builder(logger)
    flags = 0
    if strong and major == 10:
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    # TensorRT 11: every network is strongly typed; the STRONGLY_TYPED flag is deprecated and ignored.
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)) or "no details"
        raise QATError(f"TensorRT {version} could not parse {onnx_path} ({errors}); re-export it with "
                       f"export_qat.py (opset >= 13 with Q/DQ nodes).")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, _workspace_bytes(workspace_gib))
    if layer_info:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    precision_flags: list[str] = []
    if not strong and (major, minor) >= (10, 12):
        print("note: weak typing (the FP16/INT8 builder flags) is deprecated since TensorRT 10.12 and gone in 11; "
              "build strongly typed (--strongly-typed) from an ONNX exported with --half.", file=sys.stderr)
    if not strong:  # TensorRT 10, weakly typed: let the builder pick FP16/INT8 kernels around the Q/DQ nodes
        if fp16:
            config.set_flag(trt.BuilderFlag.FP16)
            precision_flags.append("FP16")
        if int8:
            config.set_flag(trt.BuilderFlag.INT8)
            precision_flags.append("INT8")

    profile = builder.create_optimization_profile()
    dynamic = False
    built_hw: tuple[int, int] | None = None
    batch_info = {"min": min_batch, "opt": opt_batch, "max": max_batch}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        shape = _dims(tensor.shape)
        shapes = profile_shapes(shape, min_batch=min_batch, opt_batch=opt_batch, max_batch=max_batch, imgsz=imgsz,
                                name=tensor.name)
        if len(shape) == 4:
            built_hw = (shapes[0][2], shapes[0][3]) if shapes else (shape[2], shape[3])
            if shapes:
                batch_info = {"min": shapes[0][0], "opt": shapes[1][0], "max": shapes[2][0]}
            else:
                batch_info = {"min": shape[0], "opt": shape[0], "max": shape[0]}
        if shapes:
            dynamic = True
            mn, op, mx = (trt.Dims(list(s)) for s in shapes)
            profile.set_shape(tensor.name, mn, op, mx)
    if dynamic:
        config.add_optimization_profile(profile)

    cache_path = Path(timing_cache) if timing_cache is not None else None
    if cache_path is not None:
        _attach_timing_cache(config, cache_path)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        why = f" ({logger.errors[-1]})" if getattr(logger, "errors", None) else ""
        raise QATError(f"TensorRT {version} failed to build an engine from {onnx_path}{why}; rerun with --verbose "
                       f"to see the builder log (a common cause is too little GPU memory: close other GPU jobs).")
    with atomic_path(engine_path) as tmp:
        tmp.write_bytes(serialized)
    if cache_path is not None:
        cache = config.get_timing_cache()
        if cache is None:  # e.g. set_timing_cache refused the file and nothing was attached
            print(f"note: TensorRT kept no timing cache; {cache_path} was not written.", file=sys.stderr)
        else:
            with atomic_path(cache_path) as tmp:
                tmp.write_bytes(cache.serialize())
    write_engine_metadata(engine_path, onnx_path, tensorrt_version=version, builder="python", imgsz=built_hw,
                          batch=batch_info, strongly_typed=strong, precision_flags=precision_flags)
    if layer_info:
        write_layer_info(engine_path, serialized, logger)
    return engine_path


def _attach_timing_cache(config: trt.IBuilderConfig, cache_path: Path) -> None:
    """Attach the timing cache file (an empty cache when there is none); a file TensorRT refuses (another GPU or
    TensorRT version, or not a cache) is replaced by a fresh cache after the build, and said so."""
    blob = cache_path.read_bytes() if cache_path.is_file() else b""
    cache = config.create_timing_cache(blob)
    if cache is not None and config.set_timing_cache(cache, False):
        return
    print(f"note: TensorRT refused the timing cache {cache_path} (written for another GPU or TensorRT version, "
          f"or not a timing cache); building with an empty one, which replaces it.", file=sys.stderr)
    fresh = config.create_timing_cache(b"")
    if fresh is not None:
        config.set_timing_cache(fresh, False)


def layer_info_path(engine_path: PathLike) -> Path:
    p = Path(engine_path)
    return p.with_name(p.name + LAYER_INFO_SUFFIX)


def write_layer_info(engine_path: PathLike, serialized: Any, logger: trt.ILogger) -> Path:
    """``X.engine.layer.json``: the engine's layer information as ``IEngineInspector`` reports it in JSON (the
    detail depends on the ``profiling_verbosity`` the engine was built with; DETAILED gives types and formats)."""
    import tensorrt as trt
    engine = trt.Runtime(logger).deserialize_cuda_engine(serialized)
    if engine is None:
        raise QATError(f"TensorRT could not load the engine it just built ({engine_path}) to read its layer "
                       f"information; rebuild without --graph.")
    inspector = engine.create_engine_inspector()
    text = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    return write_text(layer_info_path(engine_path), str(text))


# ----------------------------------------------------------------------------- running
class _IO:
    """One engine I/O tensor: name, torch dtype, engine shape (-1 = dynamic), profile shapes."""

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                 profile: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None) -> None:
        self.name, self.dtype, self.shape, self.profile = name, dtype, shape, profile


def _torch_dtypes() -> dict[Any, torch.dtype]:
    import tensorrt as trt
    import torch
    table: dict[Any, torch.dtype] = {
        trt.DataType.FLOAT: torch.float32,
        trt.DataType.HALF: torch.float16,
        trt.DataType.INT8: torch.int8,
        trt.DataType.INT32: torch.int32,
        trt.DataType.BOOL: torch.bool,
    }
    for attr, dtype in (("INT64", torch.int64), ("UINT8", torch.uint8), ("BF16", torch.bfloat16)):
        member = getattr(trt.DataType, attr, None)
        if member is not None:
            table[member] = dtype
    return table


class TRTBackend:
    """Evaluator backend that runs a serialized TensorRT 10/11 engine.

    ``backend(images)`` takes float images B x 3 x H x W in [0, 1] and returns the raw head output
    ``(B, 4+nc, A)`` (a tuple ``(pred, protos)`` for segmentation), or for End2End engines a dict with
    ``num_dets``, ``det_boxes``, ``det_scores``, ``det_classes`` (and ``det_masks``).
    Device buffers are torch tensors (``_alloc``); the work runs on a private CUDA stream.
    A ``utils.qat.evaluation.backends.Backend``.
    """

    runtime = "TensorRT"

    def __init__(self, engine_path: PathLike, device: str | torch.device = "cuda:0",
                 plugins: Sequence[PathLike] = ()) -> None:
        self.engine_path = Path(engine_path)
        if not self.engine_path.is_file():
            raise QATError(f"engine file {self.engine_path} not found; build it with "
                           f"scripts/generate_trt_engine.sh ONNX ENGINE (or scripts/build_engine.py ONNX ENGINE).")
        self.device = self._resolve_device(device)
        require_tensorrt()
        import tensorrt as trt
        import torch
        self.meta = read_engine_metadata(self.engine_path)
        installed = str(trt.__version__)
        self._logger = _make_logger()
        load_plugins(self._logger, plugins)  # an engine holding plugins deserializes only once they are registered
        _require_plugins(self.meta.get("plugins") or [], str(self.engine_path))
        self._runtime = trt.Runtime(self._logger)
        engine = self._runtime.deserialize_cuda_engine(self.engine_path.read_bytes())
        if engine is None:
            built = self.meta.get("tensorrt")
            plugin = _plugin_from_log(getattr(self._logger, "errors", []))
            if plugin:
                raise QATError(f"TensorRT {installed} could not load {self.engine_path}: it needs the plugin {plugin}, "
                               f"which is not registered; {plugin_hint(plugin)} with --plugins PATH.so.")
            if built and release(built) != release(installed):
                raise QATError(f"{self.engine_path} was built by TensorRT {built} but TensorRT {installed} is "
                               f"installed, and engines only load in the version that built them: rebuild it here "
                               f"with scripts/generate_trt_engine.sh.")
            raise QATError(f"TensorRT {installed} could not load {self.engine_path} (built by another TensorRT "
                           f"version or for another GPU, or not an engine): rebuild it on this machine with "
                           f"scripts/generate_trt_engine.sh.")
        self._engine = engine
        self._context = engine.create_execution_context()
        dtypes = _torch_dtypes()
        self.inputs: list[_IO] = []
        self.outputs: list[_IO] = []
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            mode = engine.get_tensor_mode(name)
            trt_dtype = engine.get_tensor_dtype(name)
            if trt_dtype not in dtypes:
                raise QATError(f"engine tensor {name!r} has data type {trt_dtype}, which this runner does not "
                               f"support; re-export the ONNX with float or half inputs/outputs.")
            shape = _dims(engine.get_tensor_shape(name))
            if mode == trt.TensorIOMode.INPUT:
                mn, op, mx = (_dims(d) for d in engine.get_tensor_profile_shape(name, 0)) \
                    if any(d < 0 for d in shape) else (shape, shape, shape)
                self.inputs.append(_IO(name, dtypes[trt_dtype], shape, (mn, op, mx)))
            elif mode == trt.TensorIOMode.OUTPUT:
                self.outputs.append(_IO(name, dtypes[trt_dtype], shape, None))
        if len(self.inputs) != 1 or len(self.inputs[0].shape) != 4:
            raise QATError(f"{self.engine_path} has inputs {[(t.name, list(t.shape)) for t in self.inputs]}; "
                           f"expected one image input B x 3 x H x W: rebuild it from export_qat.py's ONNX.")
        if not self.outputs:
            raise QATError(f"{self.engine_path} has no outputs; rebuild it from export_qat.py's ONNX.")
        inp = self.inputs[0]
        assert inp.profile is not None
        mn, _op, mx = inp.profile
        self.min_batch, self.max_batch = mn[0], mx[0]
        self.batch_size: int | None = mn[0] if mn[0] == mx[0] else None
        self.imgsz: tuple[int, int] | None = (mn[2], mn[3]) if (mn[2], mn[3]) == (mx[2], mx[3]) else None
        self._hw_range = ((mn[2], mn[3]), (mx[2], mx[3]))
        check_fixed_input(self.max_batch, mx[2], mx[3], self.engine_path)
        self.fp16 = inp.dtype == torch.float16
        out_names = [o.name for o in self.outputs]
        self.end2end = is_end2end(out_names)
        self.task: str = str(self.meta.get("task") or task_from_outputs(out_names, [len(o.shape) for o in self.outputs]))
        names = self.meta.get("names")
        self.names: dict[int, str] | None = names if isinstance(names, dict) else None
        self.stride = artifact_stride(self.meta.get("stride"), self.engine_path, str(metadata_path(self.engine_path)))
        self._stream = self._new_stream()

    # Hooks: the only CUDA-specific steps, kept small so the runner can be exercised on CPU in tests.
    @staticmethod
    def _resolve_device(device: str | torch.device) -> torch.device:
        import torch
        dev = _cuda_device(device)
        torch.cuda.set_device(dev)  # TensorRT deserializes and runs on the current CUDA device
        return dev

    def _new_stream(self) -> Any:
        import torch
        return torch.cuda.Stream(device=self.device)

    def _alloc(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        import torch
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def _wait_for_inputs(self) -> None:
        import torch
        self._stream.wait_stream(torch.cuda.current_stream(self.device))

    # ---------------------------------------------------------------------------------------
    def check_input(self, batch: int, h: int, w: int) -> None:
        """Raise a QATError when the engine's profile cannot take images of size h x w."""
        (hmin, wmin), (hmax, wmax) = self._hw_range
        if not (hmin <= h <= hmax and wmin <= w <= wmax):
            built = f"{hmin}x{wmin}" if (hmin, wmin) == (hmax, wmax) else f"{hmin}x{wmin} .. {hmax}x{wmax}"
            raise QATError(f"{self.engine_path} takes images of {built} but got {h}x{w}: evaluate with --imgsz "
                           f"{hmax} or rebuild the engine with --imgsz {max(h, w)}.")
        if batch < 1:
            raise QATError("got an empty batch of images; check the dataset path.")

    def __call__(self, images: torch.Tensor) -> Output:
        if images.ndim != 4:
            raise QATError(f"expected images B x 3 x H x W, got shape {list(images.shape)}.")
        b, _c, h, w = (int(s) for s in images.shape)
        self.check_input(b, h, w)
        chunk = self.max_batch
        parts = [self._run(images[i:i + chunk]) for i in range(0, b, chunk)]
        return self._concat(parts) if len(parts) > 1 else parts[0]

    def _run(self, images: torch.Tensor) -> Output:
        import torch
        inp = self.inputs[0]
        n = int(images.shape[0])
        x = images.to(device=self.device, dtype=inp.dtype)
        if n < self.min_batch:  # fixed-batch engine: pad the short last batch
            pad = torch.zeros((self.min_batch - n, *x.shape[1:]), dtype=x.dtype, device=x.device)
            x = torch.cat([x, pad])
        x = x.contiguous()
        ctx = self._context
        if not ctx.set_input_shape(inp.name, tuple(int(s) for s in x.shape)):
            raise QATError(f"{self.engine_path} rejected input shape {list(x.shape)} (its profile is "
                           f"{list(inp.profile[0]) if inp.profile else '?'} .. "
                           f"{list(inp.profile[2]) if inp.profile else '?'}); rebuild it for this batch/imgsz.")
        ctx.set_tensor_address(inp.name, int(x.data_ptr()))
        out: dict[str, torch.Tensor] = {}
        for o in self.outputs:
            shape = _dims(ctx.get_tensor_shape(o.name))
            if any(s < 0 for s in shape):
                raise QATError(f"TensorRT left output {o.name!r} with unknown shape {list(shape)} (data-dependent "
                               f"outputs are not supported); re-export without them.")
            buf = self._alloc(shape, o.dtype)
            out[o.name] = buf
            ctx.set_tensor_address(o.name, int(buf.data_ptr()))
        self._wait_for_inputs()
        if not ctx.execute_async_v3(int(self._stream.cuda_stream)):
            raise RuntimeError(f"TensorRT execute_async_v3 failed for {self.engine_path} (see the TensorRT log above)")
        self._stream.synchronize()
        res = {k: (v[:n].float() if v.is_floating_point() else v[:n]) for k, v in out.items()}
        if self.end2end:
            return res
        preds = exported_outputs([res[o.name] for o in self.outputs], self.task)
        return preds if len(preds) > 1 else preds[0]

    @staticmethod
    def _concat(parts: list[Output]) -> Output:
        import torch
        first = parts[0]
        if isinstance(first, dict):
            return {k: torch.cat([p[k] for p in parts if isinstance(p, dict)]) for k in first}
        if isinstance(first, tuple):
            return tuple(torch.cat([p[i] for p in parts if isinstance(p, tuple)]) for i in range(len(first)))
        return torch.cat([p for p in parts if isinstance(p, torch.Tensor)])

    def __repr__(self) -> str:
        return (f"TRTBackend({str(self.engine_path)!r}, batch={self.batch_size or f'1..{self.max_batch}'}, "
                f"imgsz={self.imgsz}, fp16={self.fp16}, end2end={self.end2end}, task={self.task!r})")
