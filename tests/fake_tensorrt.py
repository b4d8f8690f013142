"""A FAKE ``tensorrt`` module, per TensorRT version, for testing the toolkit's TensorRT code without TensorRT.

TensorRT cannot be installed in this workplace (no NVIDIA GPU; its packages cannot be downloaded), so the
TensorRT boundary is the one thing the tests mock: ``make_fake_trt(version)`` returns a module that is put
into ``sys.modules["tensorrt"]``. It follows NVIDIA's TensorRT 10.x / 11.x Python bindings and parsers as the
table in docs/TENSORRT.md ("TensorRT API, flags and plugins used") states them, and every source named
there (NVIDIA/TensorRT headers and python/src bindings at tags v10.0.0-v11.1, onnx-tensorrt's importers and
operators.md, plugin READMEs and sources):

- Version-dependent API (``VERSIONED_API``): what a version does not have is absent (``BuilderFlag.FP16`` on
  11.x raises AttributeError, so code calling an API removed in that version fails the test); what it
  deprecates is present but every use is recorded in ``trt.deprecated_uses``.
- Enum values per version (``NetworkDefinitionCreationFlag``: 10.x EXPLICIT_BATCH=0, STRONGLY_TYPED=1, since
  10.9 PREFER_JIT_PYTHON_PLUGINS=2, PREFER_AOT_PYTHON_PLUGINS=3; 11.x STRONGLY_TYPED=0 (deprecated, ignored),
  PREFER_JIT=1, PREFER_AOT=2).
- A plugin registry, empty of TensorRT's own plugins until ``init_libnvinfer_plugins(logger, "")``
  (``STD_PLUGINS``: EfficientNMS_TRT 1 and ROIAlign_TRT 1 deprecated since 10.12, ROIAlign_TRT 2 since 10.1;
  no EfficientNMSX_TRT). Plugin libraries are "loaded" through ``trt.dlopen`` (the tests put it in place of
  ``ctypes.CDLL``) from ``trt.plugin_libraries``.
- An ONNX parser that reads op types: custom-domain nodes go through onnx-tensorrt's fallback importer (the
  registry, by op type, ``plugin_version``, ``plugin_namespace``), RoiAlign needs ROIAlign_TRT 2,
  EfficientNMS_TRT validates its attributes as efficientNMSPlugin.cpp does (iou_threshold > 0, ...), Q/DQ
  scales must be positive, TopK's K below 3840.
- ``Runtime.deserialize_cuda_engine`` fails ("getPluginCreator could not find plugin: X version: 1") for an
  engine holding a plugin the registry lacks, and for an engine of another (fake) TensorRT version.
- ``IEngineInspector`` layer JSON per version ("Bindings" on 10.x; "I/O Tensors" and separate ``Format`` /
  ``DataType`` on 11.x), detailed only when built with ``ProfilingVerbosity.DETAILED``.
- Call order and argument types are enforced (``FakeMisuse`` / TypeError) as the real bindings do; ``Dims``
  parameters also take tuples and lists (pybind ``implicitly_convertible<std::vector<int64_t>, Dims>``).
"""
from __future__ import annotations

import ctypes
import json
import types
from typing import Any

import numpy as np


def vt(version: str) -> tuple[int, int]:
    parts = version.split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


#: Python API whose presence differs across TensorRT 10.0-11.1: name -> (since, deprecated since, removed in).
#: Must agree with docs/TENSORRT.md (tests/test_trt.py::test_docs_table_and_fake_agree).
VERSIONED_API: dict[str, tuple[str, str | None, str | None]] = {
    "BuilderFlag.FP16": ("10.0", "10.12", "11.0"),
    "BuilderFlag.INT8": ("10.0", "10.12", "11.0"),
    "NetworkDefinitionCreationFlag.EXPLICIT_BATCH": ("10.0", "10.0", "11.0"),
    "NetworkDefinitionCreationFlag.STRONGLY_TYPED": ("10.0", "11.0", None),
    "NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS": ("10.9", None, None),
    "NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS": ("10.9", None, None),
}
#: Plugins of TensorRT's plugin library the toolkit's graphs use: (name, version) -> (since, deprecated since,
#: removed in, interface). EfficientNMSX_TRT is not one of them (third-party).
STD_PLUGINS: dict[tuple[str, str], tuple[str, str | None, str | None, str]] = {
    ("EfficientNMS_TRT", "1"): ("10.0", "10.12", None, "IPluginV2DynamicExt"),
    ("ROIAlign_TRT", "1"): ("10.0", "10.12", None, "IPluginV2DynamicExt"),
    ("ROIAlign_TRT", "2"): ("10.1", None, None, "IPluginV3"),
}
#: NetworkDefinitionCreationFlag values (include/NvInfer.h of each tag).
NDCF_VALUES = {
    "10": {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1, "PREFER_JIT_PYTHON_PLUGINS": 2, "PREFER_AOT_PYTHON_PLUGINS": 3},
    "11": {"STRONGLY_TYPED": 0, "PREFER_JIT_PYTHON_PLUGINS": 1, "PREFER_AOT_PYTHON_PLUGINS": 2},
}
BUILDER_FLAG_VALUES = {"FP16": 0, "INT8": 1, "DEBUG": 2, "GPU_FALLBACK": 3, "REFIT": 5}
TOPK_LIMIT = 3840  # onnx-tensorrt docs/operators.md: "K input must be less than 3840"


def available(entry: tuple, version: str) -> bool:
    since, _dep, removed = entry[:3]
    v = vt(version)
    return vt(since) <= v and (removed is None or v < vt(removed))


def deprecated(entry: tuple, version: str) -> bool:
    dep = entry[1]
    return dep is not None and vt(dep) <= vt(version)


class FakeMisuse(AssertionError):
    """The code under test used the fake TensorRT API in a way the real one forbids."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise FakeMisuse(what)


def _need_int(x: Any, what: str) -> None:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{what}: incompatible function arguments, expected int, got {type(x).__name__}")


class _Enum:
    def __init__(self, name: str, value: int) -> None:
        self.name, self.value = name, value

    def __int__(self) -> int:
        return self.value

    __index__ = __int__

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.value == self.value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))

    def __repr__(self) -> str:
        return f"<{type(self).__name__}.{self.name}: {self.value}>"


class _Deprecated:
    """A deprecated enum member: present, and every access is recorded in the module's ``deprecated_uses``."""

    def __init__(self, member: _Enum, note: str, uses: list) -> None:
        self.member, self.note, self.uses = member, note, uses

    def __get__(self, obj: Any, cls: Any) -> _Enum:
        self.uses.append(self.note)
        return self.member


def _enum(name: str, members: dict[str, int], deprecated_members: dict[str, str] | None = None,
          uses: list | None = None) -> type:
    cls = type(name, (_Enum,), {})
    for k, v in members.items():
        member = cls(k, v)
        if deprecated_members and k in deprecated_members:
            setattr(cls, k, _Deprecated(member, deprecated_members[k], uses if uses is not None else []))
        else:
            setattr(cls, k, member)
    cls.__members__ = dict(members)  # type: ignore[attr-defined]
    return cls


class FakeHostMemory(bytes):
    """IHostMemory: a buffer."""

    @property
    def nbytes(self) -> int:
        return len(self)


_NP = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64, "INT8": np.int8,
       "BOOL": np.bool_}
_ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 6: "INT32", 7: "INT64", 3: "INT8", 9: "BOOL"}
_LAYER_DTYPE = {"FLOAT": "Float", "HALF": "Half", "INT8": "Int8", "INT32": "Int32", "INT64": "Int64", "BOOL": "Bool"}


def make_fake_trt(version: str = "10.3.0", *, fail_build: bool = False, device: str = "GPU-0") -> types.ModuleType:
    """A fake ``tensorrt`` module of the given version; ``device`` names the GPU timing caches are made for."""
    major = vt(version)[0]
    m = types.ModuleType("tensorrt")
    m.__version__ = version
    m.calls = []  # (api, args) in call order, for assertions
    m.deprecated_uses = []  # every use of an API or plugin deprecated in this version
    m.plugin_libraries = {}  # path -> [(name, version)] the "library" registers when loaded (trt.dlopen)
    uses: list = m.deprecated_uses

    def versioned_members(enum_name: str, values: dict[str, int]) -> tuple[dict[str, int], dict[str, str]]:
        members, dep = {}, {}
        for k, v in values.items():
            entry = VERSIONED_API.get(f"{enum_name}.{k}")
            if entry is not None and not available(entry, version):
                continue
            members[k] = v
            if entry is not None and deprecated(entry, version):
                dep[k] = f"{enum_name}.{k} (deprecated since {entry[1]})"
        return members, dep

    DataType = _enum("DataType", {"FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "UINT8": 5, "FP8": 6,
                                  "BF16": 7, "INT64": 8})
    TensorIOMode = _enum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
    MemoryPoolType = _enum("MemoryPoolType", {"WORKSPACE": 0, "DLA_MANAGED_SRAM": 1})
    ProfilingVerbosity = _enum("ProfilingVerbosity", {"LAYER_NAMES_ONLY": 0, "NONE": 1, "DETAILED": 2})
    LayerInformationFormat = _enum("LayerInformationFormat", {"ONELINE": 0, "JSON": 1})
    NDCF = _enum("NetworkDefinitionCreationFlag",
                 *versioned_members("NetworkDefinitionCreationFlag", NDCF_VALUES["11" if major >= 11 else "10"]),
                 uses=uses)
    BuilderFlag = _enum("BuilderFlag", *versioned_members("BuilderFlag", BUILDER_FLAG_VALUES), uses=uses)
    Severity = _enum("Severity", {"INTERNAL_ERROR": 0, "ERROR": 1, "WARNING": 2, "INFO": 3, "VERBOSE": 4})

    class ILogger:
        """Subclassable like the real one: ``__init__`` takes no arguments, ``log(severity, msg)`` is overridden."""

        def __init__(self) -> None:
            pass

        def log(self, severity: Any, msg: str) -> None:
            raise FakeMisuse("ILogger.log is pure virtual: subclass it or use trt.Logger")

    class Logger(ILogger):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = (Severity.INTERNAL_ERROR, Severity.ERROR,  # type: ignore
                                                         Severity.WARNING, Severity.INFO, Severity.VERBOSE)

        def __init__(self, min_severity: Any = Severity.WARNING) -> None:  # type: ignore[attr-defined]
            _need(isinstance(min_severity, Severity), "Logger(min_severity) takes a Logger.Severity")
            super().__init__()
            self.min_severity = min_severity
            self.messages: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            self.messages.append(msg)

    ILogger.Severity = Severity  # type: ignore[attr-defined]

    def _log(logger: Any, severity: Any, msg: str) -> None:
        logger.log(severity, msg)

    # ---------------------------------------------------------------- plugin registry
    class PluginCreator:
        def __init__(self, name: str, plugin_version: str, interface: str, namespace: str = "") -> None:
            self.name, self.plugin_version, self.interface, self.plugin_namespace = (
                name, plugin_version, interface, namespace)

        def create(self, attrs: dict[str, Any]) -> str | None:
            """None when the plugin accepts the attributes, else the validation that failed."""
            if self.name.startswith("EfficientNMS"):  # efficientNMSPlugin.cpp EfficientNMSPluginCreator::createPlugin
                required = ("score_threshold", "iou_threshold", "max_output_boxes", "background_class",
                            "score_activation", "box_coding")
                missing = [k for k in required if k not in attrs]
                if missing:
                    return f"Required attribute(s) missing: {missing}"
                if not float(attrs["iou_threshold"]) > 0.0:
                    return "PLUGIN_VALIDATE failed: iouThreshold > 0.0F"
                if not float(attrs["score_threshold"]) >= 0.0:
                    return "PLUGIN_VALIDATE failed: scoreThreshold >= 0.0F"
                if not int(attrs["max_output_boxes"]) > 0:
                    return "PLUGIN_VALIDATE failed: numOutputBoxes > 0"
            return None

    class IPluginRegistry:
        def __init__(self) -> None:
            self.creators: dict[tuple[str, str, str], PluginCreator] = {}

        def register(self, creator: PluginCreator) -> None:
            self.creators[(creator.name, creator.plugin_version, creator.plugin_namespace)] = creator

        @property
        def all_creators(self) -> list[PluginCreator]:
            return list(self.creators.values())

        def get_creator(self, type: str, version: str, plugin_namespace: str = "") -> PluginCreator | None:  # noqa: A002
            _need(isinstance(type, str) and isinstance(version, str) and isinstance(plugin_namespace, str),
                  "get_creator(type: str, version: str, plugin_namespace: str = '')")
            m.calls.append(("get_creator", type, version, plugin_namespace))
            return self.creators.get((type, version, plugin_namespace))

    registry = IPluginRegistry()

    def get_plugin_registry() -> IPluginRegistry:
        return registry

    def init_libnvinfer_plugins(logger: Any, namespace: str) -> bool:
        _need(isinstance(logger, ILogger) and isinstance(namespace, str),
              "init_libnvinfer_plugins(logger: ILogger, namespace: str)")
        m.calls.append(("init_libnvinfer_plugins", namespace))
        for (name, pv), entry in STD_PLUGINS.items():
            if available(entry, version):
                registry.register(PluginCreator(name, pv, entry[3], namespace))
        return True

    def dlopen(path: str, mode: int = 0) -> object:
        """Stands in for ``ctypes.CDLL``: a plugin library registers its creators when loaded."""
        _need(isinstance(path, str), "CDLL(path: str)")
        if path not in m.plugin_libraries:
            raise OSError(f"{path}: cannot open shared object file: No such file or directory")
        m.calls.append(("dlopen", path, mode == ctypes.RTLD_GLOBAL))
        for name, pv in m.plugin_libraries[path]:
            registry.register(PluginCreator(name, pv, "IPluginV2DynamicExt"))
        return object()

    # ---------------------------------------------------------------- network, parser
    class Dims(tuple):
        def __new__(cls, shape: Any = ()) -> "Dims":
            vals = tuple(shape)
            for v in vals:
                _need_int(v, "Dims")
            return super().__new__(cls, vals)

    def as_dims(x: Any, what: str) -> Dims:
        """Dims, or a tuple / list of ints (the bindings convert them implicitly)."""
        _need(isinstance(x, (Dims, tuple, list)), f"{what} takes tensorrt.Dims (or a tuple/list), got {type(x).__name__}")
        return x if isinstance(x, Dims) else Dims(x)

    class ITensor:
        def __init__(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
            self.name, self.shape, self.dtype = name, Dims(shape), dtype

    class INetworkDefinition:
        def __init__(self, strongly: bool) -> None:
            self.strongly_typed = strongly
            self._inputs: list[ITensor] = []
            self._outputs: list[ITensor] = []
            self.layers: list[dict[str, Any]] = []
            self.plugins: list[list[str]] = []

        @property
        def num_inputs(self) -> int:
            return len(self._inputs)

        @property
        def num_outputs(self) -> int:
            return len(self._outputs)

        def get_input(self, index: int) -> ITensor:
            _need_int(index, "get_input")
            return self._inputs[index]

        def get_output(self, index: int) -> ITensor:
            _need_int(index, "get_output")
            return self._outputs[index]

    class ParserError:
        def __init__(self, desc: str, node: int = -1, name: str = "", op: str = "") -> None:
            self._desc, self.node, self.name, self.op = desc, node, name, op

        def desc(self) -> str:
            return self._desc

        def __str__(self) -> str:
            kind = "UNSUPPORTED_NODE" if self.node >= 0 else "INVALID_GRAPH"
            return f"In node {self.node} with name: {self.name} and operator: {self.op} (parseGraph): {kind}: {self._desc}"

    class OnnxParser:
        def __init__(self, network: Any, logger: Any) -> None:
            _need(isinstance(network, INetworkDefinition) and isinstance(logger, ILogger),
                  "OnnxParser(network, logger)")
            self.network = network
            self.logger = logger
            self._errors: list[ParserError] = []

        @property
        def num_errors(self) -> int:
            return len(self._errors)

        def get_error(self, index: int) -> ParserError:
            _need_int(index, "get_error")
            return self._errors[index]

        def _import(self, node: Any, consts: dict[str, np.ndarray]) -> str | None:
            """onnx-tensorrt's view of one node: None when imported, else its error."""
            from onnx import helper
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.domain not in ("", "ai.onnx"):  # FallbackPluginImporter
                pv = attrs.get("plugin_version", b"1")
                ns = attrs.get("plugin_namespace", b"")
                pv = pv.decode() if isinstance(pv, bytes) else str(pv)
                ns = ns.decode() if isinstance(ns, bytes) else str(ns)
                creator = registry.get_creator(node.op_type, pv, ns)
                if creator is None:
                    return "Plugin not found, are the plugin name, version, and namespace correct?"
                self._use_plugin(node.op_type, pv)
                return creator.create(attrs)
            if node.op_type == "RoiAlign":
                if registry.get_creator("ROIAlign_TRT", "2", "") is None:
                    return "ROIAlign plugin was not found in the plugin registry!"
                self._use_plugin("ROIAlign_TRT", "2")
            elif node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                scale = consts.get(node.input[1])
                if scale is not None and not np.all(scale.astype(np.float64) > 0):
                    return "Scale coefficients must all be positive"
                if len(node.input) > 2 and node.input[2] in consts and np.any(consts[node.input[2]] != 0):
                    return "Non-zero zero point is not supported"
            elif node.op_type == "TopK":
                k = consts.get(node.input[1])
                if k is not None and int(np.max(k)) >= TOPK_LIMIT:
                    return f"TopK K must be less than {TOPK_LIMIT}"
            return None

        def _use_plugin(self, name: str, pv: str) -> None:
            entry = STD_PLUGINS.get((name, pv))
            if entry is not None and deprecated(entry, version):
                uses.append(f"plugin {name} version {pv} (deprecated since {entry[1]})")
            self.network.plugins.append([name, pv])

        def parse_from_file(self, model: str) -> bool:
            _need(isinstance(model, str), "parse_from_file takes a path string")
            m.calls.append(("parse_from_file", model))
            import onnx
            from onnx import numpy_helper
            try:
                proto = onnx.load(model, load_external_data=False)
            except Exception as e:  # noqa: BLE001
                self._errors.append(ParserError(f"Failed to parse ONNX model: {e}"))
                return False
            consts = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
            for n in proto.graph.node:
                if n.op_type == "Constant":
                    consts[n.output[0]] = next(numpy_helper.to_array(a.t) for a in n.attribute if a.name == "value")
            producer = {o: n for n in proto.graph.node for o in n.output}
            for i, n in enumerate(proto.graph.node):
                err = self._import(n, consts)
                if err is not None:
                    self._errors.append(ParserError(err, i, n.name, n.op_type))
                    return False
                src = producer.get(n.input[0]) if n.input else None
                dtype = "Int8" if n.op_type == "Conv" and src is not None and src.op_type == "DequantizeLinear" \
                    else "Float"
                self.network.layers.append({"Name": n.name or f"{n.op_type}_{i}", "LayerType": n.op_type,
                                            "Outputs": [{"Name": o, "Dimensions": [], "DataType": dtype}
                                                        for o in n.output]})

            def tensors(infos: Any) -> list[ITensor]:
                out = []
                for vi in infos:
                    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim)
                    out.append(ITensor(vi.name, dims, getattr(DataType, _ONNX_TO_TRT[vi.type.tensor_type.elem_type])))
                return out

            inits = set(consts)
            self.network._inputs = tensors(i for i in proto.graph.input if i.name not in inits)
            self.network._outputs = tensors(proto.graph.output)
            return True

    # ---------------------------------------------------------------- builder
    class IOptimizationProfile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[Dims, Dims, Dims]] = {}

        def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002
            _need(isinstance(input, str), "set_shape(input: str, ...)")
            mn, op, mx = (as_dims(d, "set_shape") for d in (min, opt, max))
            _need(len(mn) == len(op) == len(mx), "set_shape: ranks differ")
            _need(all(a <= b <= c for a, b, c in zip(mn, op, mx)), "set_shape: need min <= opt <= max")
            self.shapes[input] = (mn, op, mx)
            m.calls.append(("set_shape", input, tuple(mn), tuple(op), tuple(mx)))

    class ITimingCache:
        """Serialized as b"FAKECACHE" + json {"device", "entries"}."""

        def __init__(self, dev: str, entries: int) -> None:
            self.device, self.entries = dev, entries

        def serialize(self) -> FakeHostMemory:
            return FakeHostMemory(b"FAKECACHE" + json.dumps({"device": self.device, "entries": self.entries}).encode())

    class IBuilderConfig:
        def __init__(self, logger: Any) -> None:
            self.logger = logger
            self.flags: set[Any] = set()
            self.pools: dict[Any, int] = {}
            self.profiles: list[IOptimizationProfile] = []
            self.cache: ITimingCache | None = None
            self._verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY

        @property
        def profiling_verbosity(self) -> Any:
            return self._verbosity

        @profiling_verbosity.setter
        def profiling_verbosity(self, value: Any) -> None:
            _need(isinstance(value, ProfilingVerbosity), "profiling_verbosity takes a ProfilingVerbosity")
            m.calls.append(("profiling_verbosity", value.name))
            self._verbosity = value

        def set_flag(self, flag: Any) -> None:
            _need(isinstance(flag, BuilderFlag), "set_flag takes a BuilderFlag")
            self.flags.add(flag)
            m.calls.append(("set_flag", flag.name))

        def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
            _need(isinstance(pool, MemoryPoolType), "set_memory_pool_limit(pool: MemoryPoolType, ...)")
            _need_int(pool_size, "set_memory_pool_limit pool_size")
            _need(pool_size > 0, "pool size must be > 0")
            self.pools[pool] = pool_size

        def add_optimization_profile(self, profile: Any) -> int:
            _need(isinstance(profile, IOptimizationProfile), "add_optimization_profile(IOptimizationProfile)")
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def create_timing_cache(self, serialized_timing_cache: Any) -> ITimingCache | None:
            blob = bytes(memoryview(serialized_timing_cache))
            m.calls.append(("create_timing_cache", blob))
            if not blob:
                return ITimingCache(device, 0)
            if not blob.startswith(b"FAKECACHE"):
                _log(self.logger, Severity.ERROR, "Timing cache: invalid magic")
                return None
            doc = json.loads(blob[len(b"FAKECACHE"):])
            return ITimingCache(doc["device"], doc["entries"])

        def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
            _need(isinstance(cache, ITimingCache) and isinstance(ignore_mismatch, bool),
                  "set_timing_cache(cache: ITimingCache, ignore_mismatch: bool)")
            m.calls.append(("set_timing_cache", cache.device, ignore_mismatch))
            if cache.device != device and not ignore_mismatch:
                _log(self.logger, Severity.ERROR, "The timing cache was generated on a different device")
                return False
            self.cache = cache
            return True

        def get_timing_cache(self) -> ITimingCache | None:
            return self.cache  # None when no cache was attached (the C++ API returns nullptr)

    class Builder:
        def __init__(self, logger: Any) -> None:
            _need(isinstance(logger, ILogger), "Builder(logger: ILogger)")
            self.logger = logger

        def create_network(self, flags: int = 0) -> INetworkDefinition:
            _need_int(flags, "create_network(flags)")
            known = sum(1 << v for v in NDCF.__members__.values())  # type: ignore[attr-defined]
            _need(flags & ~known == 0, f"create_network: unknown flag bits {flags:#x}")
            m.calls.append(("create_network", flags))
            strong_bit = NDCF.__members__.get("STRONGLY_TYPED")  # type: ignore[attr-defined]
            strongly = major >= 11 or bool(strong_bit is not None and flags & (1 << strong_bit))
            return INetworkDefinition(strongly)

        def create_builder_config(self) -> IBuilderConfig:
            return IBuilderConfig(self.logger)

        def create_optimization_profile(self) -> IOptimizationProfile:
            return IOptimizationProfile()

        def build_serialized_network(self, network: Any, config: Any) -> FakeHostMemory | None:
            _need(isinstance(network, INetworkDefinition) and isinstance(config, IBuilderConfig),
                  "build_serialized_network(network, config)")
            m.calls.append(("build_serialized_network",))
            if fail_build:
                _log(self.logger, Severity.ERROR, "[fake] out of memory")
                return None
            if not network._inputs:
                _log(self.logger, Severity.ERROR, "Network must have at least one input")
                return None
            if network.strongly_typed and config.flags:
                _log(self.logger, Severity.ERROR, "BuilderFlag::kFP16/kINT8 not allowed for strongly typed networks")
                return None
            profile: dict[str, Any] = {}
            for t in network._inputs:
                if any(d < 0 for d in t.shape):
                    found = [p.shapes[t.name] for p in config.profiles if t.name in p.shapes]
                    if not found:
                        _log(self.logger, Severity.ERROR, f"Network has dynamic or shape inputs, but no "
                                                          f"optimization profile has been defined ({t.name})")
                        return None
                    mn, op, mx = (list(x) for x in found[0])
                    for d, a, c in zip(t.shape, mn, mx):
                        if d >= 0 and not a == c == d:
                            _log(self.logger, Severity.ERROR, "profile does not match static dims")
                            return None
                    profile[t.name] = [mn, op, mx]
            if config.cache is not None:
                config.cache.entries += 1
            payload = {"fake_trt": version, "strongly_typed": network.strongly_typed,
                       "flags": sorted(f.name for f in config.flags),
                       "inputs": [[t.name, t.dtype.name, list(t.shape)] for t in network._inputs],
                       "outputs": [[t.name, t.dtype.name, list(t.shape)] for t in network._outputs],
                       "profile": profile, "plugins": network.plugins, "layers": network.layers,
                       "verbosity": config.profiling_verbosity.name}
            return FakeHostMemory(b"FAKEENGINE" + json.dumps(payload).encode())

    # ---------------------------------------------------------------- runtime
    class IExecutionContext:
        def __init__(self, engine: "ICudaEngine") -> None:
            self.engine = engine
            self.input_shapes: dict[str, tuple[int, ...]] = {}
            self.addresses: dict[str, int] = {}

        def _output_shape(self, name: str, static: list[int]) -> tuple[int, ...]:
            inp = next(iter(self.input_shapes.values()), None)
            if inp is None:
                return tuple(static)  # unknown (-1) until the input shape is set
            b, _c, h, w = inp
            anchors = sum((h // s) * (w // s) for s in (8, 16, 32))
            dims = list(static)
            for i, d in enumerate(dims):
                if d < 0:
                    if i == 0:
                        dims[i] = b
                    elif name == "output0":
                        dims[i] = anchors
                    elif name == "output1":
                        dims[i] = h // 4 if i == 2 else w // 4
                    else:
                        raise FakeMisuse(f"fake cannot resolve dim {i} of {name}")
            return tuple(dims)

        def set_input_shape(self, name: str, shape: Any) -> bool:
            _need(isinstance(name, str), "set_input_shape(name: str, shape)")
            shape = tuple(as_dims(shape, "set_input_shape"))
            m.calls.append(("set_input_shape", name, shape))
            spec = self.engine.io[name]
            _need(spec["mode"] == "INPUT", f"set_input_shape on non-input {name}")
            mn, _op, mx = self.engine.profile.get(name, [spec["shape"]] * 3)
            if len(shape) != len(mn) or not all(a <= s <= c for a, s, c in zip(mn, shape, mx)):
                return False  # TensorRT logs an error and returns False
            self.input_shapes[name] = shape
            return True

        def get_tensor_shape(self, name: str) -> Dims:
            _need(isinstance(name, str), "get_tensor_shape(name: str)")
            spec = self.engine.io[name]
            if spec["mode"] == "INPUT":
                return Dims(self.input_shapes.get(name, spec["shape"]))
            return Dims(self._output_shape(name, spec["shape"]))

        def set_tensor_address(self, name: str, memory: int) -> bool:
            _need(isinstance(name, str), "set_tensor_address(name: str, memory: int)")
            _need_int(memory, "set_tensor_address memory")
            _need(name in self.engine.io, f"set_tensor_address: {name} is not an I/O tensor")
            _need(memory != 0, "set_tensor_address: null pointer")
            m.calls.append(("set_tensor_address", name, memory))
            self.addresses[name] = memory
            return True

        def execute_async_v3(self, stream_handle: int) -> bool:
            _need_int(stream_handle, "execute_async_v3(stream_handle)")
            m.calls.append(("execute_async_v3", stream_handle))
            for name, spec in self.engine.io.items():
                if spec["mode"] == "INPUT":
                    _need(name in self.input_shapes, f"execute before set_input_shape({name})")
                _need(name in self.addresses, f"execute without an address for {name}")
            (iname, ishape), = self.input_shapes.items()
            x = self._view(iname, ishape).astype(np.float32)
            mean = x.reshape(ishape[0], -1).mean(axis=1)
            for name, spec in self.engine.io.items():
                if spec["mode"] != "OUTPUT":
                    continue
                shape = self._output_shape(name, spec["shape"])
                out = self._view(name, shape)
                b_index = np.arange(shape[0]).reshape((-1,) + (1,) * (len(shape) - 1))
                per_b = mean.reshape((-1,) + (1,) * (len(shape) - 1))
                if name == "output0":  # raw head: mean of the image + channel index
                    val = per_b + np.arange(shape[1]).reshape((1, -1, 1))
                elif name == "num_dets":
                    val = b_index + 1
                elif name == "det_classes":
                    val = np.broadcast_to(np.arange(shape[1]).reshape(1, -1), shape)
                else:
                    val = per_b
                out[...] = np.broadcast_to(val, shape).astype(out.dtype)
            return True

        def _view(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
            dtype = _NP[self.engine.io[name]["dtype"]]
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            raw = (ctypes.c_byte * n).from_address(self.addresses[name])
            return np.ctypeslib.as_array(raw).view(dtype).reshape(shape)

    class EngineInspector:
        def __init__(self, engine: "ICudaEngine") -> None:
            self.engine = engine

        def get_engine_information(self, format: Any) -> str:  # noqa: A002
            _need(isinstance(format, LayerInformationFormat), "get_engine_information(format: LayerInformationFormat)")
            p = self.engine.payload
            if p["verbosity"] != "DETAILED":
                layers: list[Any] = [lay["Name"] for lay in p["layers"]]
            elif major >= 11:  # Format and DataType as separate fields (the split the 11.0 migration guide announces)
                layers = [{**lay, "Outputs": [{"Name": t["Name"], "Dimensions": t["Dimensions"],
                                                "Format": f"Row major linear {t['DataType']} format",
                                                "DataType": t["DataType"]} for t in lay["Outputs"]]}
                          for lay in p["layers"]]
            else:
                layers = [{**lay, "Outputs": [{"Name": t["Name"], "Dimensions": t["Dimensions"],
                                                "Format/Datatype": f"Row major linear {t['DataType']} format"}
                                               for t in lay["Outputs"]]} for lay in p["layers"]]
            io = [[n, "Input", d, s] for n, d, s in p["inputs"]] + [[n, "Output", d, s] for n, d, s in p["outputs"]]
            if major >= 11:
                doc: dict[str, Any] = {"Layers": layers, "I/O Tensors": [
                    {"Name": n, "IOMode": mode, "DataType": _LAYER_DTYPE[d], "Dimensions": s, "Location": "Device",
                     "IsShapeInferenceIO": False} for n, mode, d, s in io]}
            else:
                doc = {"Layers": layers, "Bindings": [n for n, *_ in io]}
            return json.dumps(doc)

    class ICudaEngine:
        def __init__(self, payload: dict[str, Any]) -> None:
            self.payload = payload
            self.io: dict[str, dict[str, Any]] = {}
            for mode, key in (("INPUT", "inputs"), ("OUTPUT", "outputs")):
                for name, dtype, shape in payload[key]:
                    self.io[name] = {"mode": mode, "dtype": dtype, "shape": shape}
            self.profile = payload["profile"]
            self.names = list(self.io)

        @property
        def num_io_tensors(self) -> int:
            return len(self.names)

        def get_tensor_name(self, index: int) -> str:
            _need_int(index, "get_tensor_name(index: int)")
            return self.names[index]

        def get_tensor_mode(self, name: str) -> Any:
            _need(isinstance(name, str), "get_tensor_mode(name: str)")
            return getattr(TensorIOMode, self.io[name]["mode"])

        def get_tensor_dtype(self, name: str) -> Any:
            _need(isinstance(name, str), "get_tensor_dtype(name: str)")
            return getattr(DataType, self.io[name]["dtype"])

        def get_tensor_shape(self, name: str) -> Dims:
            _need(isinstance(name, str), "get_tensor_shape(name: str)")
            return Dims(self.io[name]["shape"])

        def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
            _need(isinstance(name, str), "get_tensor_profile_shape(name: str, profile_index: int)")
            _need_int(profile_index, "get_tensor_profile_shape profile_index")
            _need(self.io[name]["mode"] == "INPUT" and profile_index == 0 and name in self.profile,
                  f"get_tensor_profile_shape({name}, {profile_index}): no such profile")
            return [Dims(s) for s in self.profile[name]]

        def create_execution_context(self) -> IExecutionContext:
            return IExecutionContext(self)

        def create_engine_inspector(self) -> EngineInspector:
            return EngineInspector(self)

    class Runtime:
        def __init__(self, logger: Any) -> None:
            _need(isinstance(logger, ILogger), "Runtime(logger: ILogger)")
            self.logger = logger

        def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
            blob = bytes(memoryview(serialized_engine))
            m.calls.append(("deserialize_cuda_engine",))
            if not blob.startswith(b"FAKEENGINE"):
                _log(self.logger, Severity.ERROR, "Serialization assertion failed: magic tag")
                return None
            payload = json.loads(blob[len(b"FAKEENGINE"):])
            if payload["fake_trt"] != version:
                _log(self.logger, Severity.ERROR, f"The engine plan file is not compatible with this version of "
                                                  f"TensorRT, expecting library version {version} got "
                                                  f"{payload['fake_trt']}, please rebuild.")
                return None
            for name, pv in payload.get("plugins", []):
                if registry.creators.get((name, pv, "")) is None:
                    _log(self.logger, Severity.ERROR, f"getPluginCreator could not find plugin: {name} version: {pv}")
                    return None
            return ICudaEngine(payload)

    for obj in (DataType, TensorIOMode, MemoryPoolType, ProfilingVerbosity, LayerInformationFormat, BuilderFlag,
                ILogger, Logger, Dims, ITensor, INetworkDefinition, OnnxParser, IOptimizationProfile, ITimingCache,
                IBuilderConfig, Builder, IExecutionContext, ICudaEngine, Runtime, IPluginRegistry, EngineInspector):
        setattr(m, obj.__name__, obj)
    m.NetworkDefinitionCreationFlag = NDCF
    m.IEngineInspector = EngineInspector
    m.init_libnvinfer_plugins = init_libnvinfer_plugins
    m.get_plugin_registry = get_plugin_registry
    m.dlopen = dlopen
    return m
