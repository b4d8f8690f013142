"""utils/qat/trt_engine.py (engine builder, TRTBackend) tested against a FAKE ``tensorrt`` module.

TensorRT cannot be installed in this workplace (its libraries download from a host we cannot reach
and there is no NVIDIA GPU here), so NONE OF THE REAL TensorRT CALLS RUN IN THESE TESTS. Instead a
minimal fake ``tensorrt`` is injected into ``sys.modules`` at the import boundary (trt_engine imports
tensorrt lazily, inside its functions). The fake follows the documented TensorRT 10/11 Python API and
enforces its call order and argument types, so misuse fails the test:

- ``Builder.create_network`` takes an int bit mask; ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``;
  a fake "11.x" has no ``BuilderFlag.FP16``/``INT8`` (removed in 11), a strongly typed network rejects
  precision flags at build time, a dynamic input without an optimization profile fails the build,
  ``IOptimizationProfile.set_shape`` takes ``Dims`` with min <= opt <= max.
- ``IExecutionContext``: output shapes are unknown (-1) until ``set_input_shape``; ``set_tensor_address``
  needs an int pointer for a known I/O tensor; ``execute_async_v3`` needs an int stream handle and
  every input shape and every I/O address set. The fake then reads the input through its pointer and
  writes the outputs through theirs (ctypes), so wrong buffers, dtypes or shapes show up as wrong values.
- ``Runtime.deserialize_cuda_engine`` returns None for an engine "built" by another fake version.

Device buffers go through ``TRTBackend._alloc`` (torch tensors), which the tests run on CPU through a
subclass overriding the CUDA-only hooks; the real CUDA check (no GPU -> QATError) is tested as is.
"""
from __future__ import annotations

import ctypes
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 -m pytest` from the repository root has it already
    sys.path.append(str(REPO))

from utils.qat import trt_engine  # noqa: E402
from utils.qat.errors import QATError  # noqa: E402


# ============================================================================= the fake tensorrt
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


def _enum(name: str, members: dict[str, int]) -> type:
    cls = type(name, (_Enum,), {})
    for k, v in members.items():
        setattr(cls, k, cls(k, v))
    return cls


class FakeHostMemory(bytes):
    """IHostMemory: a buffer."""

    @property
    def nbytes(self) -> int:
        return len(self)


class FakeMisuse(AssertionError):
    """The code under test used the fake TensorRT API in a way the real one forbids."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise FakeMisuse(what)


def _need_int(x: Any, what: str) -> None:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"{what}: incompatible function arguments, expected int, got {type(x).__name__}")


_NP = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64, "INT8": np.int8,
       "BOOL": np.bool_}
_ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 6: "INT32", 7: "INT64", 3: "INT8", 9: "BOOL"}


def make_fake_trt(version: str = "10.3.0", *, fail_build: bool = False) -> types.ModuleType:
    """A fake ``tensorrt`` module of the given version (10.x or 11.x behaviour)."""
    major = int(version.split(".")[0])
    m = types.ModuleType("tensorrt")
    m.__version__ = version
    m.calls = []  # (api, args) in call order, for assertions
    DataType = _enum("DataType", {"FLOAT": 0, "HALF": 1, "INT8": 2, "INT32": 3, "BOOL": 4, "UINT8": 5, "FP8": 6,
                                  "BF16": 7, "INT64": 8})
    TensorIOMode = _enum("TensorIOMode", {"NONE": 0, "INPUT": 1, "OUTPUT": 2})
    MemoryPoolType = _enum("MemoryPoolType", {"WORKSPACE": 0, "DLA_MANAGED_SRAM": 1})
    if major >= 11:  # EXPLICIT_BATCH is gone; STRONGLY_TYPED is deprecated and ignored
        NDCF = _enum("NetworkDefinitionCreationFlag", {"STRONGLY_TYPED": 0, "PREFER_AOT_PYTHON_PLUGINS": 1,
                                                       "PREFER_JIT_PYTHON_PLUGINS": 2})
        BuilderFlag = _enum("BuilderFlag", {"DEBUG": 2, "GPU_FALLBACK": 3, "REFIT": 5})  # no FP16/INT8/...
    else:
        NDCF = _enum("NetworkDefinitionCreationFlag", {"EXPLICIT_BATCH": 0, "STRONGLY_TYPED": 1,
                                                       "PREFER_AOT_PYTHON_PLUGINS": 3, "PREFER_JIT_PYTHON_PLUGINS": 2})
        BuilderFlag = _enum("BuilderFlag", {"FP16": 0, "INT8": 1, "DEBUG": 2, "GPU_FALLBACK": 3, "REFIT": 5,
                                            "BF16": 17})
    Severity = _enum("Severity", {"INTERNAL_ERROR": 0, "ERROR": 1, "WARNING": 2, "INFO": 3, "VERBOSE": 4})

    class Logger:
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = (Severity.INTERNAL_ERROR, Severity.ERROR,  # type: ignore
                                                         Severity.WARNING, Severity.INFO, Severity.VERBOSE)

        def __init__(self, min_severity: Any = Severity.WARNING) -> None:  # type: ignore[attr-defined]
            _need(isinstance(min_severity, Severity), "Logger(min_severity) takes a Logger.Severity")
            self.min_severity = min_severity
            self.messages: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            self.messages.append(msg)

    class Dims(tuple):
        def __new__(cls, shape: Any = ()) -> "Dims":
            vals = tuple(shape)
            for v in vals:
                _need_int(v, "Dims")
            return super().__new__(cls, vals)

    class ITensor:
        def __init__(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
            self.name, self.shape, self.dtype = name, Dims(shape), dtype

    class INetworkDefinition:
        def __init__(self, strongly: bool) -> None:
            self.strongly_typed = strongly
            self._inputs: list[ITensor] = []
            self._outputs: list[ITensor] = []
            self.metadata: dict[str, Any] = {}

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
        def __init__(self, desc: str) -> None:
            self._desc = desc

        def desc(self) -> str:
            return self._desc

        def __str__(self) -> str:
            return f"In node -1 with name:  and operator:  (parseGraph): INVALID_GRAPH: {self._desc}"

    class OnnxParser:
        def __init__(self, network: Any, logger: Any) -> None:
            _need(isinstance(network, INetworkDefinition) and isinstance(logger, Logger),
                  "OnnxParser(network, logger)")
            self.network = network
            self._errors: list[ParserError] = []

        @property
        def num_errors(self) -> int:
            return len(self._errors)

        def get_error(self, index: int) -> ParserError:
            _need_int(index, "get_error")
            return self._errors[index]

        def parse_from_file(self, model: str) -> bool:
            _need(isinstance(model, str), "parse_from_file takes a path string")
            m.calls.append(("parse_from_file", model))
            import onnx
            try:
                proto = onnx.load(model, load_external_data=False)
            except Exception as e:  # noqa: BLE001
                self._errors.append(ParserError(f"Failed to parse ONNX model: {e}"))
                return False

            def tensors(infos: Any) -> list[ITensor]:
                out = []
                for vi in infos:
                    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim)
                    out.append(ITensor(vi.name, dims, getattr(DataType, _ONNX_TO_TRT[vi.type.tensor_type.elem_type])))
                return out

            self.network._inputs = tensors(proto.graph.input)
            self.network._outputs = tensors(proto.graph.output)
            return True

    class IOptimizationProfile:
        def __init__(self) -> None:
            self.shapes: dict[str, tuple[Dims, Dims, Dims]] = {}

        def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:  # noqa: A002
            _need(isinstance(input, str), "set_shape(input: str, ...)")
            for d in (min, opt, max):
                _need(isinstance(d, Dims), f"set_shape takes tensorrt.Dims, got {type(d).__name__}")
            _need(len(min) == len(opt) == len(max), "set_shape: ranks differ")
            _need(all(a <= b <= c for a, b, c in zip(min, opt, max)), "set_shape: need min <= opt <= max")
            self.shapes[input] = (min, opt, max)
            m.calls.append(("set_shape", input, tuple(min), tuple(opt), tuple(max)))

    class ITimingCache:
        def __init__(self, blob: bytes) -> None:
            self.entries = int(blob[len(b"FAKECACHE"):] or 0) if blob else 0

        def serialize(self) -> FakeHostMemory:
            return FakeHostMemory(b"FAKECACHE" + str(self.entries + 1).encode())

    class IBuilderConfig:
        def __init__(self) -> None:
            self.flags: set[Any] = set()
            self.pools: dict[Any, int] = {}
            self.profiles: list[IOptimizationProfile] = []
            self.cache: ITimingCache | None = None

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

        def create_timing_cache(self, serialized_timing_cache: Any) -> ITimingCache:
            blob = bytes(memoryview(serialized_timing_cache))
            _need(not blob or blob.startswith(b"FAKECACHE"), "timing cache blob is not a timing cache")
            m.calls.append(("create_timing_cache", blob))
            return ITimingCache(blob)

        def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
            _need(isinstance(cache, ITimingCache) and isinstance(ignore_mismatch, bool),
                  "set_timing_cache(cache: ITimingCache, ignore_mismatch: bool)")
            self.cache = cache
            return True

        def get_timing_cache(self) -> ITimingCache:
            _need(self.cache is not None, "get_timing_cache before set_timing_cache")
            assert self.cache is not None
            return self.cache

    class Builder:
        def __init__(self, logger: Any) -> None:
            _need(isinstance(logger, Logger), "Builder(logger: ILogger)")
            self.logger = logger

        def create_network(self, flags: int = 0) -> INetworkDefinition:
            _need_int(flags, "create_network(flags)")
            known = sum(1 << int(v) for v in vars(NDCF).values() if isinstance(v, NDCF))
            _need(flags & ~known == 0, f"create_network: unknown flag bits {flags:#x}")
            m.calls.append(("create_network", flags))
            strongly = major >= 11 or bool(flags & (1 << int(NDCF.STRONGLY_TYPED)))
            return INetworkDefinition(strongly)

        def create_builder_config(self) -> IBuilderConfig:
            return IBuilderConfig()

        def create_optimization_profile(self) -> IOptimizationProfile:
            return IOptimizationProfile()

        def build_serialized_network(self, network: Any, config: Any) -> FakeHostMemory | None:
            _need(isinstance(network, INetworkDefinition) and isinstance(config, IBuilderConfig),
                  "build_serialized_network(network, config)")
            m.calls.append(("build_serialized_network",))
            if fail_build:
                self.logger.log(Severity.ERROR, "[fake] out of memory")
                return None
            if not network._inputs:
                self.logger.log(Severity.ERROR, "Network must have at least one input")
                return None
            if network.strongly_typed and config.flags:
                # TensorRT 10: precision flags are not allowed with a strongly typed network.
                self.logger.log(Severity.ERROR, "BuilderFlag::kFP16/kINT8 not allowed for strongly typed networks")
                return None
            profile: dict[str, Any] = {}
            for t in network._inputs:
                if any(d < 0 for d in t.shape):
                    found = [p.shapes[t.name] for p in config.profiles if t.name in p.shapes]
                    if not found:
                        self.logger.log(Severity.ERROR, f"Network has dynamic or shape inputs, but no "
                                                        f"optimization profile has been defined ({t.name})")
                        return None
                    mn, op, mx = (list(x) for x in found[0])
                    for d, a, c in zip(t.shape, mn, mx):
                        if d >= 0 and not a == c == d:
                            self.logger.log(Severity.ERROR, "profile does not match static dims")
                            return None
                    profile[t.name] = [mn, op, mx]
            payload = {"fake_trt": version, "strongly_typed": network.strongly_typed,
                       "flags": sorted(f.name for f in config.flags),
                       "inputs": [[t.name, t.dtype.name, list(t.shape)] for t in network._inputs],
                       "outputs": [[t.name, t.dtype.name, list(t.shape)] for t in network._outputs],
                       "profile": profile}
            return FakeHostMemory(b"FAKEENGINE" + json.dumps(payload).encode())

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
            shape = tuple(shape)
            for s in shape:
                _need_int(s, "set_input_shape shape")
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

    class Runtime:
        def __init__(self, logger: Any) -> None:
            _need(isinstance(logger, Logger), "Runtime(logger: ILogger)")
            self.logger = logger

        def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
            blob = bytes(memoryview(serialized_engine))
            if not blob.startswith(b"FAKEENGINE"):
                self.logger.log(Severity.ERROR, "Serialization assertion failed: magic tag")
                return None
            payload = json.loads(blob[len(b"FAKEENGINE"):])
            if payload["fake_trt"] != version:
                self.logger.log(Severity.ERROR, f"The engine plan file is not compatible with this version of "
                                                f"TensorRT, expecting library version {version} got "
                                                f"{payload['fake_trt']}, please rebuild.")
                return None
            return ICudaEngine(payload)

    for obj in (DataType, TensorIOMode, MemoryPoolType, BuilderFlag, Logger, Dims, ITensor, INetworkDefinition,
                OnnxParser, IOptimizationProfile, ITimingCache, IBuilderConfig, Builder, IExecutionContext,
                ICudaEngine, Runtime):
        setattr(m, obj.__name__, obj)
    m.NetworkDefinitionCreationFlag = NDCF
    m.ILogger = Logger
    return m


# ============================================================================= helpers
def make_onnx(path: Path, *, batch: int | str = "batch", hw: int | str = "height", nc: int = 80,
              kind: str = "detect", input_type: int = 1, stride: int = 32) -> Path:
    """A tiny ONNX with YOLOv9's I/O (no nodes: only its interface and metadata matter to the fake parser)."""
    import onnx
    from onnx import TensorProto, helper

    w = hw if isinstance(hw, int) else "width"
    inputs = [helper.make_tensor_value_info("images", input_type, [batch, 3, hw, w])]
    if kind == "end2end":
        outputs = [helper.make_tensor_value_info("num_dets", TensorProto.INT32, [batch, 1]),
                   helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, [batch, 5, 4]),
                   helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, [batch, 5]),
                   helper.make_tensor_value_info("det_classes", TensorProto.INT32, [batch, 5])]
    elif kind == "segment":
        outputs = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [batch, 4 + nc + 32, "anchors"]),
                   helper.make_tensor_value_info("output1", TensorProto.FLOAT, [batch, 32, "ph", "pw"])]
    else:
        outputs = [helper.make_tensor_value_info("output0", input_type, [batch, 4 + nc, "anchors"])]
    model = helper.make_model(helper.make_graph([], "yolov9", inputs, outputs))
    names = {i: f"class{i}" for i in range(nc)}
    for k, v in (("stride", str(stride)), ("names", str(names))):
        p = model.metadata_props.add()
        p.key, p.value = k, v
    onnx.save(model, str(path))
    return path


@pytest.fixture
def fake_trt(monkeypatch):
    """Install a fake TensorRT of a given version; CUDA reported present with 6 GiB free."""
    def install(version: str = "10.3.0", **kw: Any) -> types.ModuleType:
        mod = make_fake_trt(version, **kw)
        monkeypatch.setitem(sys.modules, "tensorrt", mod)
        return mod
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (6 << 30, 8 << 30))
    return install


class FakeStream:
    def __init__(self) -> None:
        self.cuda_stream = 0x5A5A0001
        self.synced = 0
        self.waited = 0

    def synchronize(self) -> None:
        self.synced += 1


class CPUBackend(trt_engine.TRTBackend):
    """TRTBackend with its CUDA-only hooks on CPU: torch CPU tensors are the 'device' buffers."""

    @staticmethod
    def _resolve_device(device: Any) -> torch.device:
        return torch.device("cpu")

    def _new_stream(self) -> FakeStream:
        return FakeStream()

    def _wait_for_inputs(self) -> None:
        self._stream.waited += 1


def _calls(mod: types.ModuleType, api: str) -> list[tuple]:
    return [c for c in mod.calls if c[0] == api]


def _anchors(h: int, w: int) -> int:
    return sum((h // s) * (w // s) for s in (8, 16, 32))


# ============================================================================= builder
def test_build_trt10_weakly_typed_int8_fp16(tmp_path, fake_trt):
    trt = fake_trt("10.3.0")
    onnx_path = make_onnx(tmp_path / "qat.onnx")
    cache = tmp_path / "qat.timing.cache"
    engine = trt_engine.build_engine(onnx_path, tmp_path / "qat.engine", max_batch=8, imgsz=64, workspace_gib=2,
                                     timing_cache=cache)
    assert engine.read_bytes().startswith(b"FAKEENGINE")
    payload = json.loads(engine.read_bytes()[len(b"FAKEENGINE"):])
    assert payload["flags"] == ["FP16", "INT8"] and payload["strongly_typed"] is False
    assert _calls(trt, "create_network") == [("create_network", 0)]
    assert _calls(trt, "set_shape") == [("set_shape", "images", (1, 3, 64, 64), (8, 3, 64, 64), (8, 3, 64, 64))]
    assert payload["profile"]["images"] == [[1, 3, 64, 64], [8, 3, 64, 64], [8, 3, 64, 64]]
    # timing cache: created empty, saved; the second build loads what the first saved
    assert _calls(trt, "create_timing_cache") == [("create_timing_cache", b"")]
    assert cache.read_bytes() == b"FAKECACHE1"
    trt_engine.build_engine(onnx_path, tmp_path / "qat.engine", max_batch=8, imgsz=64, workspace_gib=2,
                            timing_cache=cache)
    assert _calls(trt, "create_timing_cache")[-1] == ("create_timing_cache", b"FAKECACHE1")
    assert cache.read_bytes() == b"FAKECACHE2"
    meta = trt_engine.read_engine_metadata(engine)
    assert meta["tensorrt"] == "10.3.0" and meta["stride"] == 32 and meta["names"][79] == "class79"
    assert meta["imgsz"] == [64, 64] and meta["task"] == "detect" and meta["end2end"] is False
    assert meta["onnx"] == str(onnx_path) and meta["batch"] == {"min": 1, "opt": 8, "max": 8}
    assert meta["precision_flags"] == ["FP16", "INT8"] and meta["strongly_typed"] is False
    assert not list(tmp_path.glob(".*.part"))  # atomic writes left nothing behind


def test_build_trt10_strongly_typed_sets_network_flag_and_no_precision_flags(tmp_path, fake_trt):
    trt = fake_trt("10.8.0")
    trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64, workspace_gib=1,
                            strongly_typed=True)
    assert _calls(trt, "create_network") == [("create_network", 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))]
    assert _calls(trt, "set_flag") == []
    assert trt_engine.read_engine_metadata(tmp_path / "m.engine")["strongly_typed"] is True


def test_build_trt11_is_strongly_typed_without_builder_flags(tmp_path, fake_trt):
    trt = fake_trt("11.1.0")
    assert not hasattr(trt.BuilderFlag, "FP16") and not hasattr(trt.BuilderFlag, "INT8")
    engine = trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64,
                                     workspace_gib=1)  # fp16/int8 default True: no flags exist to set on 11
    assert _calls(trt, "set_flag") == []
    payload = json.loads(engine.read_bytes()[len(b"FAKEENGINE"):])
    assert payload["strongly_typed"] is True
    assert trt_engine.read_engine_metadata(engine)["tensorrt"] == "11.1.0"


def test_build_trt11_refuses_weak_typing_in_one_sentence(tmp_path, fake_trt):
    fake_trt("11.0.0")
    with pytest.raises(QATError) as e:
        trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64, strongly_typed=False)
    msg = str(e.value)
    assert "strongly typed" in msg and "--half" in msg and msg.count(". ") == 0
    assert not (tmp_path / "m.engine").exists()


def test_build_workspace_defaults_to_free_gpu_memory(tmp_path, fake_trt, monkeypatch):
    trt = fake_trt("10.3.0")
    seen = {}
    orig = trt.IBuilderConfig.set_memory_pool_limit

    def spy(self, pool, size):
        seen["size"] = size
        return orig(self, pool, size)
    monkeypatch.setattr(trt.IBuilderConfig, "set_memory_pool_limit", spy)
    trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64)
    assert seen["size"] == 6 << 30


def test_build_static_onnx_needs_no_profile_and_checks_imgsz(tmp_path, fake_trt):
    trt = fake_trt("10.3.0")
    onnx_path = make_onnx(tmp_path / "s.onnx", batch=4, hw=64)
    engine = trt_engine.build_engine(onnx_path, tmp_path / "s.engine", workspace_gib=1)
    assert _calls(trt, "set_shape") == []
    assert trt_engine.read_engine_metadata(engine)["batch"] == {"min": 4, "opt": 4, "max": 4}
    with pytest.raises(QATError, match="fixed at 64x64"):
        trt_engine.build_engine(onnx_path, tmp_path / "s2.engine", workspace_gib=1, imgsz=640)


@pytest.mark.parametrize("case, match", [
    ("dynamic_hw_without_imgsz", "--imgsz"),
    ("missing_onnx", "not found"),
    ("bad_batches", "min <= opt <= max"),
    ("unparsable", "could not parse"),
    ("build_fails", "failed to build"),
    ("old_trt", "too old"),
])
def test_build_errors_are_clear(tmp_path, fake_trt, case, match):
    fake_trt("8.6.1" if case == "old_trt" else "10.3.0", fail_build=case == "build_fails")
    onnx_path = make_onnx(tmp_path / "m.onnx")
    kw: dict[str, Any] = {"imgsz": 64, "workspace_gib": 1}
    if case == "dynamic_hw_without_imgsz":
        kw.pop("imgsz")
    elif case == "missing_onnx":
        onnx_path = tmp_path / "nope.onnx"
    elif case == "bad_batches":
        kw.update(min_batch=4, max_batch=2)
    elif case == "unparsable":
        onnx_path.write_bytes(b"\x00not an onnx model")
    with pytest.raises(QATError, match=match):
        trt_engine.build_engine(onnx_path, tmp_path / "m.engine", **kw)
    assert not (tmp_path / "m.engine").exists()


def test_parser_errors_are_listed(tmp_path, fake_trt):
    fake_trt("10.3.0")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"garbage")
    with pytest.raises(QATError) as e:
        trt_engine.build_engine(bad, tmp_path / "bad.engine", imgsz=64, workspace_gib=1)
    assert "INVALID_GRAPH: Failed to parse ONNX model" in str(e.value)


def test_no_tensorrt_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(QATError, match=r"install_dependencies\.sh --tensorrt"):
        trt_engine.trt_version()
    with pytest.raises(QATError, match=r"install_dependencies\.sh --tensorrt"):
        trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64)


def test_stub_only_tensorrt_is_not_tensorrt(monkeypatch):
    """pip install tensorrt-stubs alone leaves a tensorrt/ folder of .pyi files that imports as an empty package."""
    empty = types.ModuleType("tensorrt")
    empty.__path__ = ["/site-packages/tensorrt"]
    monkeypatch.setitem(sys.modules, "tensorrt", empty)
    with pytest.raises(QATError, match=r"empty package at /site-packages/tensorrt.*install_dependencies\.sh --tensorrt"):
        trt_engine.trt_version()


def test_builder_needs_a_gpu(tmp_path, fake_trt, monkeypatch):
    fake_trt("10.3.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QATError, match="no CUDA GPU"):
        trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64)


def test_trt_version(fake_trt):
    fake_trt("10.13.0.35")
    assert trt_engine.trt_version() == (10, 13)


# ============================================================================= runner
def _engine(tmp_path: Path, fake_trt: Any, *, version: str = "10.3.0", name: str = "m", **onnx_kw: Any) -> Path:
    fake_trt(version)
    build_kw = {k: onnx_kw.pop(k) for k in ("max_batch", "min_batch", "opt_batch") if k in onnx_kw}
    return trt_engine.build_engine(make_onnx(tmp_path / f"{name}.onnx", **onnx_kw), tmp_path / f"{name}.engine",
                                   imgsz=onnx_kw.get("hw") if isinstance(onnx_kw.get("hw"), int) else 64,
                                   workspace_gib=1, **build_kw)


def test_backend_dynamic_batch_detect(tmp_path, fake_trt):
    engine = _engine(tmp_path, fake_trt, max_batch=4)
    trt = sys.modules["tensorrt"]
    be = CPUBackend(engine)
    assert (be.batch_size, be.imgsz, be.stride, be.end2end, be.task, be.fp16) == (None, (64, 64), 32, False,
                                                                                   "detect", False)
    assert be.names is not None and be.names[0] == "class0" and be.max_batch == 4
    trt.calls.clear()
    images = torch.rand(3, 3, 64, 64)
    out = be(images)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 84, _anchors(64, 64)) and out.dtype == torch.float32
    means = images.reshape(3, -1).mean(1)
    torch.testing.assert_close(out[:, 0, 0], means)
    torch.testing.assert_close(out[:, 5, 7], means + 5)
    # documented order: input shape first, then the addresses of every I/O tensor, then enqueue
    order = [c[0] for c in trt.calls]
    assert order == ["set_input_shape", "set_tensor_address", "set_tensor_address", "execute_async_v3"]
    assert _calls(trt, "set_input_shape") == [("set_input_shape", "images", (3, 3, 64, 64))]
    assert {c[1] for c in _calls(trt, "set_tensor_address")} == {"images", "output0"}
    assert _calls(trt, "execute_async_v3") == [("execute_async_v3", FakeStream().cuda_stream)]
    assert be._stream.synced == 1 and be._stream.waited == 1


def test_backend_splits_batches_larger_than_the_profile(tmp_path, fake_trt):
    be = CPUBackend(_engine(tmp_path, fake_trt, max_batch=4))
    trt = sys.modules["tensorrt"]
    trt.calls.clear()
    images = torch.rand(6, 3, 64, 64)
    out = be(images)
    assert out.shape[0] == 6
    torch.testing.assert_close(out[:, 1, 0], images.reshape(6, -1).mean(1) + 1)
    assert [c[2][0] for c in _calls(trt, "set_input_shape")] == [4, 2]


def test_backend_fixed_batch_pads_the_short_last_batch(tmp_path, fake_trt):
    be = CPUBackend(_engine(tmp_path, fake_trt, batch=4, hw=64))
    trt = sys.modules["tensorrt"]
    assert be.batch_size == 4 and be.imgsz == (64, 64)
    trt.calls.clear()
    images = torch.rand(3, 3, 64, 64)
    out = be(images)
    assert out.shape == (3, 84, _anchors(64, 64))
    assert _calls(trt, "set_input_shape") == [("set_input_shape", "images", (4, 3, 64, 64))]
    torch.testing.assert_close(out[:, 0, 0], images.reshape(3, -1).mean(1))


def test_backend_end2end_returns_the_documented_dict(tmp_path, fake_trt):
    be = CPUBackend(_engine(tmp_path, fake_trt, kind="end2end", max_batch=2))
    assert be.end2end
    images = torch.rand(2, 3, 64, 64)
    out = be(images)
    assert set(out) == {"num_dets", "det_boxes", "det_scores", "det_classes"}
    assert out["num_dets"].shape == (2, 1) and out["num_dets"].dtype == torch.int32
    assert out["num_dets"].flatten().tolist() == [1, 2]
    assert out["det_boxes"].shape == (2, 5, 4) and out["det_boxes"].dtype == torch.float32
    assert out["det_classes"].dtype == torch.int32 and out["det_classes"][1].tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(out["det_scores"][:, 0], images.reshape(2, -1).mean(1))


def test_backend_segmentation_returns_pred_and_protos(tmp_path, fake_trt):
    be = CPUBackend(_engine(tmp_path, fake_trt, kind="segment", max_batch=2))
    assert be.task == "segment"
    pred, protos = be(torch.rand(2, 3, 64, 64))
    assert pred.shape == (2, 4 + 80 + 32, _anchors(64, 64)) and protos.shape == (2, 32, 16, 16)


def test_backend_fp16_engine_gets_half_inputs(tmp_path, fake_trt):
    from onnx import TensorProto
    be = CPUBackend(_engine(tmp_path, fake_trt, input_type=TensorProto.FLOAT16, max_batch=2))
    assert be.fp16
    images = torch.rand(2, 3, 64, 64)
    out = be(images)
    assert out.dtype == torch.float32  # half outputs come back as float32 for the evaluator
    torch.testing.assert_close(out[:, 0, 0], images.half().float().reshape(2, -1).mean(1), atol=2e-3, rtol=1e-3)


def test_backend_rejects_incompatible_images(tmp_path, fake_trt):
    be = CPUBackend(_engine(tmp_path, fake_trt, max_batch=2))
    with pytest.raises(QATError, match=r"takes images of 64x64 but got 96x96"):
        be(torch.rand(1, 3, 96, 96))
    with pytest.raises(QATError, match="B x 3 x H x W"):
        be(torch.rand(3, 64, 64))


def test_backend_engine_from_another_tensorrt_version(tmp_path, fake_trt):
    engine = _engine(tmp_path, fake_trt, version="10.3.0")
    fake_trt("10.4.0")
    with pytest.raises(QATError, match=r"built by TensorRT 10\.3\.0 but TensorRT 10\.4\.0 is installed.*rebuild"):
        CPUBackend(engine)
    fake_trt("10.3.0.26")  # same release, still refused (e.g. another GPU): no version blame, still clear
    with pytest.raises(QATError, match=r"could not load .*another GPU.*rebuild it"):
        CPUBackend(engine)
    trt_engine.metadata_path(engine).unlink()  # no sidecar: still a clear sentence
    fake_trt("10.4.0")
    with pytest.raises(QATError, match=r"could not load .*rebuild it"):
        CPUBackend(engine)


def test_backend_missing_engine_and_no_gpu(tmp_path, fake_trt, monkeypatch):
    fake_trt("10.3.0")
    with pytest.raises(QATError, match="engine file .* not found"):
        trt_engine.TRTBackend(tmp_path / "none.engine")
    engine = _engine(tmp_path, fake_trt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QATError, match="no CUDA GPU"):
        trt_engine.TRTBackend(engine)  # the real class, real CUDA check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(QATError, match="run on a CUDA device"):
        trt_engine.TRTBackend(engine, device="cpu")


def test_backend_default_alloc_makes_torch_buffers():
    holder = types.SimpleNamespace(device=torch.device("cpu"))
    buf = trt_engine.TRTBackend._alloc(holder, (2, 84, 10), torch.float16)  # type: ignore[arg-type]
    assert buf.shape == (2, 84, 10) and buf.dtype == torch.float16 and buf.is_contiguous()


def test_backend_warns_when_the_sidecar_has_no_stride(tmp_path, fake_trt):
    engine = _engine(tmp_path, fake_trt)
    trt_engine.metadata_path(engine).unlink()
    with pytest.warns(UserWarning, match="assuming 32"):
        be = CPUBackend(engine)
    assert be.stride == 32 and be.names is None


# ============================================================================= the fake enforces the API
def test_fake_rejects_misuse(tmp_path, fake_trt):
    """The fake fails on the mistakes the real API punishes, so the tests above would catch them."""
    engine = _engine(tmp_path, fake_trt)
    trt = sys.modules["tensorrt"]
    eng = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(engine.read_bytes())
    ctx = eng.create_execution_context()
    assert tuple(ctx.get_tensor_shape("output0")) == (-1, 84, -1)  # unknown before set_input_shape
    x = torch.rand(1, 3, 64, 64)
    with pytest.raises(TypeError):
        ctx.set_tensor_address("images", x)  # a tensor, not an int pointer
    with pytest.raises(TypeError):
        ctx.execute_async_v3(FakeStream())  # a stream object, not its int handle
    ctx.set_tensor_address("images", x.data_ptr())
    with pytest.raises(FakeMisuse, match="set_input_shape"):
        ctx.execute_async_v3(1)
    assert ctx.set_input_shape("images", (17, 3, 64, 64)) is False  # outside the profile
    assert ctx.set_input_shape("images", (1, 3, 64, 64)) is True
    with pytest.raises(FakeMisuse, match="address for output0"):
        ctx.execute_async_v3(1)
    prof = trt.Builder(trt.Logger()).create_optimization_profile()
    with pytest.raises(FakeMisuse, match="Dims"):
        prof.set_shape("images", (1, 3, 64, 64), (1, 3, 64, 64), (1, 3, 64, 64))
    with pytest.raises(TypeError):
        trt.Builder(trt.Logger()).create_network(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)  # enum, not bits
