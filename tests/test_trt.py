"""utils/qat/trt/trt_engine.py (engine builder, TRTBackend) tested against a FAKE ``tensorrt`` module.

TensorRT cannot be installed in this workplace (its libraries download from a host we cannot reach
and there is no NVIDIA GPU here), so NONE OF THE REAL TensorRT CALLS RUN IN THESE TESTS: the TensorRT
boundary is mocked, and only it. tests/fake_tensorrt.py builds a fake ``tensorrt`` per version, injected
into ``sys.modules`` (trt_engine imports tensorrt lazily, inside its functions); it models the table of
docs/TENSORRT.md ("TensorRT API, flags and plugins used", checked here to agree with it): APIs removed in
a version are absent (a call fails the test), deprecated ones are present and their use is recorded, the
plugin registry is empty until ``init_libnvinfer_plugins``, the parser reads op types, engines holding
plugins deserialize only when their creators are registered. It enforces call order and argument types:

- ``IExecutionContext``: output shapes are unknown (-1) until ``set_input_shape``; ``set_tensor_address``
  needs an int pointer for a known I/O tensor; ``execute_async_v3`` needs an int stream handle and
  every input shape and every I/O address set. The fake then reads the input through its pointer and
  writes the outputs through theirs (ctypes), so wrong buffers, dtypes or shapes show up as wrong values.
- ``Runtime.deserialize_cuda_engine`` returns None for an engine "built" by another fake version.

Device buffers go through ``TRTBackend._alloc`` (torch tensors), which the tests run on CPU through a
subclass overriding the CUDA-only hooks; the real CUDA check (no GPU -> QATError) is tested as is.
Plugin libraries cannot exist here either: ``ctypes.CDLL`` is replaced by the fake's ``dlopen`` in the
plugin tests, which registers the creators a test says the library provides.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 -m pytest` from the repository root has it already
    sys.path.append(str(REPO))

from fake_tensorrt import (STD_PLUGINS, VERSIONED_API, FakeMisuse, available, make_fake_trt, vt)  # noqa: E402
from utils.qat.trt import engine_graph, trt_common, trt_engine  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402


# ============================================================================= helpers
def make_onnx(path: Path, *, batch: int | str = "batch", hw: int | str = "height", nc: int = 80,
              kind: str = "detect", input_type: int = 1, stride: int = 32) -> Path:
    """A tiny ONNX with YOLOv9's I/O (no nodes: only its interface and metadata matter to the fake parser)."""
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


def _cache_doc(path: Path) -> dict:
    blob = path.read_bytes()
    assert blob.startswith(b"FAKECACHE")
    return json.loads(blob[len(b"FAKECACHE"):])


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
    first = cache.read_bytes()
    assert _cache_doc(cache) == {"device": "GPU-0", "entries": 1}
    trt_engine.build_engine(onnx_path, tmp_path / "qat.engine", max_batch=8, imgsz=64, workspace_gib=2,
                            timing_cache=cache)
    assert _calls(trt, "create_timing_cache")[-1] == ("create_timing_cache", first)
    assert _cache_doc(cache) == {"device": "GPU-0", "entries": 2}
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
        trt_common.trt_version()
    with pytest.raises(QATError, match=r"install_dependencies\.sh --tensorrt"):
        trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64)


def test_stub_only_tensorrt_is_not_tensorrt(monkeypatch):
    """pip install tensorrt-stubs alone leaves a tensorrt/ folder of .pyi files that imports as an empty package."""
    empty = types.ModuleType("tensorrt")
    empty.__path__ = ["/site-packages/tensorrt"]
    monkeypatch.setitem(sys.modules, "tensorrt", empty)
    with pytest.raises(QATError, match=r"empty package at /site-packages/tensorrt.*install_dependencies\.sh --tensorrt"):
        trt_common.trt_version()


def test_builder_needs_a_gpu(tmp_path, fake_trt, monkeypatch):
    fake_trt("10.3.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QATError, match="no CUDA GPU"):
        trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64)


def test_trt_version(fake_trt):
    fake_trt("10.13.0.35")
    assert trt_common.trt_version() == (10, 13)


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


def test_open_backend_opens_an_engine_as_a_backend(tmp_path, fake_trt, monkeypatch):
    """utils.qat.evaluation.backends.open_backend picks TensorRT for .engine (or kind='tensorrt'), and what it returns has
    every attribute of the Backend protocol that the evaluator reads."""
    from typing import get_type_hints

    from utils.qat.evaluation.backends import Backend, open_backend
    engine = _engine(tmp_path, fake_trt, kind="segment")
    monkeypatch.setattr(trt_engine, "TRTBackend", CPUBackend)  # open_backend imports it when called
    be = open_backend(engine)
    assert isinstance(be, CPUBackend) and be.runtime == "TensorRT" and be.task == "segment"
    assert [k for k in get_type_hints(Backend) if not hasattr(be, k)] == []
    plan = engine.with_suffix(".plan")
    for src, dest in ((engine, plan), (trt_engine.metadata_path(engine), trt_engine.metadata_path(plan))):
        src.rename(dest)
    assert isinstance(open_backend(plan, kind="tensorrt"), CPUBackend)
    with pytest.raises(QATError, match=r"not a model file.*\.engine \(TensorRT\)"):
        open_backend(plan)
    with pytest.raises(QATError, match="engine file .* not found"):
        open_backend(tmp_path / "none.engine")


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
    prof.set_shape("images", (1, 3, 64, 64), [1, 3, 64, 64], trt.Dims((1, 3, 64, 64)))  # tuples/lists convert
    with pytest.raises(FakeMisuse, match="Dims"):
        prof.set_shape("images", "1x3x64x64", (1, 3, 64, 64), (1, 3, 64, 64))
    with pytest.raises(FakeMisuse, match="min <= opt <= max"):
        prof.set_shape("images", (2, 3, 64, 64), (1, 3, 64, 64), (1, 3, 64, 64))
    with pytest.raises(TypeError):
        trt.Builder(trt.Logger()).create_network(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)  # enum, not bits


# ============================================================================= the table, per version
DOC = REPO / "docs" / "TENSORRT.md"
VERSIONS = ("10.0.0", "10.3.0", "10.9.0", "10.13.3", "11.0.0", "11.1.0")


def _doc_rows() -> list[list[str]]:
    text = DOC.read_text()
    section = text.split("### TensorRT API, flags and plugins used", 1)[1].split("\n### ", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| ---")]


def _row(rows: list[list[str]], needle: str) -> list[str]:
    found = [r for r in rows if needle in r[0]]
    assert found, f"docs/TENSORRT.md has no row for {needle}"
    return found[0]


def test_docs_table_and_fake_agree():
    """The fake's version model (fake_tensorrt.VERSIONED_API, STD_PLUGINS) is the table's: columns
    item | used by | TensorRT 10.x | TensorRT 11.x | source, one row per item, a source in every row."""
    rows = _doc_rows()
    assert len(rows) > 40 and all(len(r) == 5 and r[4] for r in rows[1:]), "every row needs five cells and a source"
    for name, (since, dep, removed) in VERSIONED_API.items():
        _item, _used, v10, v11, _src = _row(rows, f"`{name}`")
        assert ("removed" in v11.lower()) == (removed == "11.0"), name
        if dep is not None and vt(dep) < (11, 0):
            assert "deprecated" in v10.lower() and dep in v10, name
        if dep is not None:
            assert "deprecated" in v11.lower() or "removed" in v11.lower(), name
        if vt(since) > (10, 0):
            assert f"since {since}" in v10, name
    for (name, pv), (since, dep, removed, iface) in STD_PLUGINS.items():
        _item, _used, v10, v11, _src = _row(rows, f"`{name}` version {pv}")
        assert iface in _item or iface in v10, name
        assert ("deprecated" in v10.lower()) == (dep is not None) and ("removed" in v11.lower()) == (removed is not None)
        if vt(since) > (10, 0):
            assert f"since {since}" in v10, name
    _item, _used, v10, v11, _src = _row(rows, "`EfficientNMSX_TRT`")
    assert "not in" in v10.lower() and "not in" in v11.lower()


@pytest.mark.parametrize("version", VERSIONS)
def test_fake_follows_the_table(version):
    trt = make_fake_trt(version)
    for name, entry in VERSIONED_API.items():
        enum, member = name.split(".")
        assert hasattr(getattr(trt, enum), member) == available(entry, version), (version, name)
    ndcf = trt.NetworkDefinitionCreationFlag
    if vt(version) >= (11, 0):  # include/NvInfer.h v11.0/v11.1: kSTRONGLY_TYPED = 0, kPREFER_JIT = 1, kPREFER_AOT = 2
        assert [int(ndcf.STRONGLY_TYPED), int(ndcf.PREFER_JIT_PYTHON_PLUGINS), int(ndcf.PREFER_AOT_PYTHON_PLUGINS)] == [
            0, 1, 2]
    elif vt(version) >= (10, 9):  # v10.9-v10.13: kEXPLICIT_BATCH = 0, kSTRONGLY_TYPED = 1, kPREFER_JIT = 2, AOT = 3
        assert [int(ndcf.EXPLICIT_BATCH), int(ndcf.STRONGLY_TYPED), int(ndcf.PREFER_JIT_PYTHON_PLUGINS),
                int(ndcf.PREFER_AOT_PYTHON_PLUGINS)] == [0, 1, 2, 3]
    registry = trt.get_plugin_registry()
    assert registry.get_creator("EfficientNMS_TRT", "1", "") is None  # nothing before init_libnvinfer_plugins
    assert trt.init_libnvinfer_plugins(trt.Logger(), "") is True
    for (name, pv), entry in STD_PLUGINS.items():
        assert (registry.get_creator(name, pv, "") is not None) == available(entry, version), (version, name, pv)
    assert registry.get_creator("EfficientNMSX_TRT", "1", "") is None  # not NVIDIA's


@pytest.mark.parametrize("version, strongly, expected", [
    ("10.3.0", None, set()),
    ("10.13.3", True, set()),
    ("10.13.3", None, {"BuilderFlag.FP16 (deprecated since 10.12)", "BuilderFlag.INT8 (deprecated since 10.12)"}),
    ("11.0.0", None, set()),
    ("11.1.0", None, set()),
])
def test_toolkit_calls_no_removed_api_and_only_the_deprecated_ones_asked_for(tmp_path, fake_trt, capsys, version,
                                                                              strongly, expected):
    """Build and run on each version: an API the table marks removed there is absent from the fake (AttributeError),
    a deprecated one is recorded. Weak typing on 10.12+ is the one deprecated use, and only when asked for (the
    default on 10.x, as the reference builds), with a note."""
    trt = fake_trt(version)
    engine = trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64, max_batch=2,
                                     workspace_gib=1, strongly_typed=strongly, layer_info=True)
    out = CPUBackend(engine)(torch.rand(2, 3, 64, 64))
    assert out.shape == (2, 84, _anchors(64, 64))
    assert set(trt.deprecated_uses) == expected
    assert ("weak typing" in capsys.readouterr().err) == bool(expected)


def test_a_removed_api_fails_the_test(tmp_path, fake_trt, monkeypatch):
    """If the code called BuilderFlag.FP16 on TensorRT 11 (removed there), the fake makes it fail."""
    fake_trt("11.1.0")
    monkeypatch.setattr(trt_engine, "version_tuple", lambda text: (10, 13))  # the code believes it runs 10.13
    with pytest.raises(AttributeError, match="FP16"):
        trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64, workspace_gib=1)


# ============================================================================= plugins
E2E = ["num_dets", "det_boxes", "det_scores", "det_classes"]
NMS_ATTRS = dict(background_class=-1, box_coding=1, iou_threshold=0.45, max_output_boxes=5, plugin_version="1",
                 score_activation=0, score_threshold=0.25, class_agnostic=0)


def _graph_onnx(path: Path, nodes: list, outputs: list, inits: list | None = None, stride: int = 32) -> Path:
    model = helper.make_model(
        helper.make_graph(nodes, "g", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                     ["batch", 3, "height", "width"])],
                          outputs, initializer=inits or []),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("TRT", 1)])
    for k, v in (("stride", str(stride)), ("names", str({i: f"class{i}" for i in range(80)}))):
        p = model.metadata_props.add()
        p.key, p.value = k, v
    onnx.save(model, str(path))
    return path


def _e2e_outputs() -> list:
    return [helper.make_tensor_value_info("num_dets", TensorProto.INT32, ["batch", 1]),
            helper.make_tensor_value_info("det_boxes", TensorProto.FLOAT, ["batch", 5, 4]),
            helper.make_tensor_value_info("det_scores", TensorProto.FLOAT, ["batch", 5]),
            helper.make_tensor_value_info("det_classes", TensorProto.INT32, ["batch", 5])]


def _nms_onnx(path: Path, op: str = "EfficientNMS_TRT", **attrs: Any) -> Path:
    node = helper.make_node(op, ["images", "images"], E2E, name=f"/end2end/{op}", domain="TRT",
                            **{**NMS_ATTRS, **attrs})
    return _graph_onnx(path, [node], _e2e_outputs())


def _plugin_library(tmp_path: Path, trt: types.ModuleType, monkeypatch: Any, *creators: tuple[str, str]) -> Path:
    """A 'plugin library' the fake can load in place of ctypes.CDLL (no real .so can exist here)."""
    lib = tmp_path / "libyolo_plugins.so"
    lib.write_bytes(b"")
    trt.plugin_libraries[str(lib.resolve())] = list(creators)
    monkeypatch.setattr(trt_engine.ctypes, "CDLL", trt.dlopen)
    return lib


def test_plugins_are_registered_before_parsing_and_before_loading(tmp_path, fake_trt):
    trt = fake_trt("10.3.0")
    engine = trt_engine.build_engine(_nms_onnx(tmp_path / "e2e.onnx"), tmp_path / "e2e.engine", imgsz=64,
                                     max_batch=2, workspace_gib=1)
    order = [c[0] for c in trt.calls]
    assert order.index("init_libnvinfer_plugins") < order.index("parse_from_file")
    assert trt_engine.read_engine_metadata(engine)["plugins"] == [
        {"name": "EfficientNMS_TRT", "version": "1", "namespace": ""}]
    trt = fake_trt("10.3.0")  # a fresh process: TensorRT's plugins are not registered yet
    be = CPUBackend(engine)
    order = [c[0] for c in trt.calls]
    assert order.index("init_libnvinfer_plugins") < order.index("deserialize_cuda_engine")
    out = be(torch.rand(2, 3, 64, 64))
    assert be.end2end and out["num_dets"].flatten().tolist() == [1, 2]


def test_without_init_the_fake_fails_as_tensorrt_does(tmp_path, fake_trt, monkeypatch):
    """The defect this guards against (NVIDIA/TensorRT issue #2675): a Python process that does not call
    init_libnvinfer_plugins can neither parse a plugin node nor load an engine holding one; the runner's
    sentence then names the plugin instead of blaming the TensorRT version."""
    onnx_path = _nms_onnx(tmp_path / "e2e.onnx")
    trt = fake_trt("10.3.0")
    network = trt.Builder(trt.Logger()).create_network(0)
    parser = trt.OnnxParser(network, trt.Logger())
    assert parser.parse_from_file(str(onnx_path)) is False
    assert "Plugin not found, are the plugin name, version, and namespace correct?" in str(parser.get_error(0))
    engine = trt_engine.build_engine(onnx_path, tmp_path / "e2e.engine", imgsz=64, max_batch=2, workspace_gib=1)
    fake_trt("10.3.0")
    monkeypatch.setattr(trt_engine, "load_plugins", lambda logger, plugins=(): None)
    with pytest.raises(QATError, match=r"needs the plugin EfficientNMS_TRT \(version 1\), which is not registered"):
        CPUBackend(engine)  # the sidecar lists the plugin: checked before deserializing
    trt_engine.metadata_path(engine).unlink()
    with pytest.raises(QATError) as e:
        CPUBackend(engine)  # no sidecar: TensorRT's own error names it
    assert "needs the plugin EfficientNMS_TRT, which is not registered" in str(e.value)
    assert "another TensorRT" not in str(e.value)


def test_efficientnmsx_is_third_party_and_needs_its_library(tmp_path, fake_trt, monkeypatch):
    onnx_path = _nms_onnx(tmp_path / "seg.onnx", op="EfficientNMSX_TRT")
    trt = fake_trt("10.13.3")
    with pytest.raises(QATError, match=r"EfficientNMSX_TRT \(version 1\).*is not part of TensorRT.*--plugins"):
        trt_engine.build_engine(onnx_path, tmp_path / "seg.engine", imgsz=64, max_batch=2, workspace_gib=1)
    lib = _plugin_library(tmp_path, trt, monkeypatch, ("EfficientNMSX_TRT", "1"))
    engine = trt_engine.build_engine(onnx_path, tmp_path / "seg.engine", imgsz=64, max_batch=2, workspace_gib=1,
                                     plugins=[lib])
    assert ("dlopen", str(lib.resolve()), True) in trt.calls
    trt = fake_trt("10.13.3")
    lib = _plugin_library(tmp_path, trt, monkeypatch, ("EfficientNMSX_TRT", "1"))
    with pytest.raises(QATError, match="EfficientNMSX_TRT.*not part of TensorRT.*--plugins"):
        CPUBackend(engine)
    assert CPUBackend(engine, plugins=[lib]).end2end
    with pytest.raises(QATError, match=r"plugin library .*missing\.so not found"):
        CPUBackend(engine, plugins=[tmp_path / "missing.so"])


def test_roialign_is_imported_as_roialign_trt_version_2(tmp_path, fake_trt):
    boxes = helper.make_tensor_value_info("pooled", TensorProto.FLOAT, ["n", 3, 4, 4])
    node = helper.make_node("RoiAlign", ["images", "rois", "idx"], ["pooled"], name="/roi",
                            coordinate_transformation_mode="half_pixel", output_height=4, output_width=4)
    inits = [numpy_helper.from_array(torch.zeros(1, 4).numpy(), "rois"),
             numpy_helper.from_array(torch.zeros(1, dtype=torch.int64).numpy(), "idx")]
    path = _graph_onnx(tmp_path / "roi.onnx", [node], [boxes], inits)
    assert trt_engine.onnx_metadata(path)["plugins"] == [{"name": "ROIAlign_TRT", "version": "2", "namespace": ""}]
    trt = fake_trt("10.3.0")
    trt_engine.build_engine(path, tmp_path / "roi.engine", imgsz=64, max_batch=1, workspace_gib=1)
    assert trt.deprecated_uses == []  # version 2 (IPluginV3), not the deprecated version 1
    fake_trt("10.0.0")  # before 10.1 TensorRT has no version 2
    with pytest.raises(QATError, match=r"needs the plugin ROIAlign_TRT \(version 2\)"):
        trt_engine.build_engine(path, tmp_path / "roi0.engine", imgsz=64, max_batch=1, workspace_gib=1)


def test_efficientnms_deprecation_note(tmp_path, fake_trt, capsys):
    trt = fake_trt("10.13.3")
    trt_engine.build_engine(_nms_onnx(tmp_path / "e2e.onnx"), tmp_path / "e2e.engine", imgsz=64, max_batch=1,
                            workspace_gib=1, strongly_typed=True)
    assert "EfficientNMS_TRT is deprecated since TensorRT 10.12" in capsys.readouterr().err
    assert trt.deprecated_uses == ["plugin EfficientNMS_TRT version 1 (deprecated since 10.12)"]


def _qdq_conv_onnx(path: Path, scale: float = 0.02, topk: int | None = None) -> Path:
    inits = [numpy_helper.from_array(torch.tensor(scale).numpy(), "s"),
             numpy_helper.from_array(torch.tensor(0, dtype=torch.int8).numpy(), "z"),
             numpy_helper.from_array(torch.ones(84, 3, 1, 1, dtype=torch.int8).numpy(), "w_q"),
             numpy_helper.from_array(torch.full((84,), 0.01).numpy(), "w_s"),
             numpy_helper.from_array(torch.zeros(84, dtype=torch.int8).numpy(), "w_z")]
    nodes = [helper.make_node("QuantizeLinear", ["images", "s", "z"], ["q"], name="/in/Q"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["dq"], name="/in/DQ"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w"], name="/w/DQ", axis=0),
             helper.make_node("Conv", ["dq", "w"], ["c"], name="/model.0/conv/Conv"),
             helper.make_node("Sigmoid", ["c"], ["sig"], name="/model.0/act/Sigmoid"),
             helper.make_node("Reshape", ["sig", "shape"], ["output0"], name="/head/Reshape")]
    inits.append(numpy_helper.from_array(torch.tensor([0, 84, -1]).numpy(), "shape"))
    if topk is not None:
        inits.append(numpy_helper.from_array(torch.tensor([topk]).numpy(), "k"))
        nodes.append(helper.make_node("TopK", ["output0", "k"], ["tv", "ti"], name="/topk", axis=2))
    out = [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 84, "anchors"])]
    return _graph_onnx(path, nodes, out, inits)


@pytest.mark.parametrize("case, match", [
    ("iou_zero", r"iouThreshold > 0"),
    ("scale_zero", r"Scale coefficients must all be positive"),
    ("topk_3840", r"TopK K must be less than 3840"),
])
def test_fake_parser_rejects_what_tensorrt_rejects(tmp_path, fake_trt, case, match):
    fake_trt("11.1.0")
    path = {"iou_zero": lambda: _nms_onnx(tmp_path / "m.onnx", iou_threshold=0.0),
            "scale_zero": lambda: _qdq_conv_onnx(tmp_path / "m.onnx", scale=0.0),
            "topk_3840": lambda: _qdq_conv_onnx(tmp_path / "m.onnx", topk=3840)}[case]()
    with pytest.raises(QATError, match=f"could not parse .*{match}"):
        trt_engine.build_engine(path, tmp_path / "m.engine", imgsz=64, max_batch=1, workspace_gib=1)


def test_end2end_options_stay_inside_tensorrt_limits():
    """The export refuses what the fake parser (and TensorRT) would: iou_threshold 0 with the plugin, K >= 3840."""
    from utils.qat.onnx.end2end import MAX_TOPK, NMSOptions
    assert MAX_TOPK == 3839 and NMSOptions().backend == "onnx"
    with pytest.raises(QATError, match=r"--iou-thres must be above 0 .* --nms trt"):
        NMSOptions(backend="trt", iou_thres=0.0).check()
    NMSOptions(backend="onnx", iou_thres=0.0).check()  # INMSLayer takes [0, 1]
    with pytest.raises(QATError, match="between 1 and 3839"):
        NMSOptions(topk_all=3840).check()
    NMSOptions(backend="trt", topk_all=3839).check()


# ============================================================================= timing cache, layer information
def test_timing_cache_from_another_gpu_is_replaced(tmp_path, fake_trt, capsys):
    onnx_path, cache = make_onnx(tmp_path / "m.onnx"), tmp_path / "m.timing.cache"
    fake_trt("10.3.0", device="GPU-A")
    trt_engine.build_engine(onnx_path, tmp_path / "m.engine", imgsz=64, workspace_gib=1, timing_cache=cache)
    assert _cache_doc(cache) == {"device": "GPU-A", "entries": 1}
    trt = fake_trt("10.3.0", device="GPU-B")
    trt_engine.build_engine(onnx_path, tmp_path / "m.engine", imgsz=64, workspace_gib=1, timing_cache=cache)
    assert "refused the timing cache" in capsys.readouterr().err
    assert _calls(trt, "set_timing_cache") == [("set_timing_cache", "GPU-A", False), ("set_timing_cache", "GPU-B", False)]
    assert _cache_doc(cache) == {"device": "GPU-B", "entries": 1}
    cache.write_bytes(b"not a cache")
    trt_engine.build_engine(onnx_path, tmp_path / "m.engine", imgsz=64, workspace_gib=1, timing_cache=cache)
    assert "refused the timing cache" in capsys.readouterr().err and _cache_doc(cache)["device"] == "GPU-B"


def test_no_timing_cache_kept_is_said_not_serialized(tmp_path, fake_trt, monkeypatch, capsys):
    """get_timing_cache() returns None when nothing could be attached: nothing to serialize, and it says so."""
    trt = fake_trt("10.3.0")
    monkeypatch.setattr(trt.IBuilderConfig, "set_timing_cache", lambda self, cache, ignore: False)
    cache = tmp_path / "m.timing.cache"
    engine = trt_engine.build_engine(make_onnx(tmp_path / "m.onnx"), tmp_path / "m.engine", imgsz=64,
                                     workspace_gib=1, timing_cache=cache)
    assert engine.is_file() and not cache.exists()
    assert "was not written" in capsys.readouterr().err


@pytest.mark.parametrize("version", ["10.3.0", "11.1.0"])
def test_python_built_engine_writes_the_layer_json(tmp_path, fake_trt, version):
    """build_engine(layer_info=True): ProfilingVerbosity.DETAILED, then IEngineInspector's JSON beside the engine,
    which engine_graph reads on both schemas (10.x "Bindings" + Format/Datatype, 11.x "I/O Tensors" + split)."""
    trt = fake_trt(version)
    onnx_path = _qdq_conv_onnx(tmp_path / "q.onnx")
    engine = trt_engine.build_engine(onnx_path, tmp_path / "q.engine", imgsz=64, max_batch=2, workspace_gib=1,
                                     layer_info=True)
    assert ("profiling_verbosity", "DETAILED") in trt.calls
    doc = engine_graph.load_layer_info(trt_engine.layer_info_path(engine))
    assert ("I/O Tensors" in doc) == (vt(version) >= (11, 0))
    s = engine_graph.precision_summary(doc)
    assert s["detailed"] and s["compute_by_output_dtype"].get("INT8") == 1 and "unknown" not in s["by_output_dtype"]
    assert (s["inputs"], s["outputs"]) == (["images"], ["output0"])
    plain = trt_engine.build_engine(onnx_path, tmp_path / "p.engine", imgsz=64, max_batch=2, workspace_gib=1)
    assert not trt_engine.layer_info_path(plain).exists()
