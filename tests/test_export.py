"""ONNX export (export_qat.py, export_yoloV9.py), End2End NMS graphs and val_trt.py on ONNX Runtime, on CPU.

The reference model (GELAN-C) is exported floating point and quantized (calibrated once per module, 'max'
on 4 images at 160 px) in every mode; each graph is run by ONNX Runtime on real images and compared with
PyTorch. EfficientNMS_TRT graphs are checked structurally (no CPU runtime implements the plugin).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from conftest import cli_error, run_tool
from helpers import TINY_GELAN, build, real_images

ort = pytest.importorskip("onnxruntime")

IMGSZ = 160
E2E_OUTPUTS = ["num_dets", "det_boxes", "det_scores", "det_classes"]


# ---------------------------------------------------------------------------------------------
# fixtures: models, checkpoints and images made once per module
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def work(tmp_path_factory, gelan_c):
    """A folder with the FP reference checkpoint linked in (exports land next to the weights)."""
    d = tmp_path_factory.mktemp("export")
    (d / "gelan-c.pt").symlink_to(gelan_c)
    return d


@pytest.fixture(scope="module")
def images(shared):
    return real_images(shared / "datasets" / "coco334" / "images" / "val2017", 2, IMGSZ)


@pytest.fixture(scope="module")
def fp_model(yolov9_tree, gelan_c):
    from utils.qat.onnx.onnx_export import load_for_export
    model, task, quantized, _ = load_for_export(gelan_c)
    assert task == "detect" and not quantized
    return model


@pytest.fixture(scope="module")
def qat_ckpt(yolov9_tree, work, gelan_c, shared):
    """A quantized checkpoint of GELAN-C (PTQ 'max' on 4 real images at 160 px), written once."""
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.model import checkpoint
    fp = checkpoint.load_fp(gelan_c)
    calib = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 4, IMGSZ)
    qmodel, info = quantize(fp, [calib[:2], calib[2:]], QuantConfig(method="max", head_amax="calibrated"), example=calib[:1])
    qmodel.names = fp.names
    return checkpoint.save_quantized(work / "qat_gelan-c.pt", qmodel, info)


@pytest.fixture(scope="module")
def qat_model(qat_ckpt):
    from utils.qat.onnx.onnx_export import load_for_export
    model, task, quantized, fp_patterns = load_for_export(qat_ckpt)
    assert quantized and task == "detect"
    return model, fp_patterns


@pytest.fixture(scope="module")
def fp_dynamic(fp_model, work):
    from utils.qat.onnx.onnx_export import export_onnx
    out = work / "fp-dynamic.onnx"
    export_onnx(fp_model, out, imgsz=IMGSZ, dynamic=True)
    return out


@pytest.fixture(scope="module")
def fp_static(fp_model, work):
    """The FP graph at batch 2 (test_fp_static_export_matches_pytorch checks it; the FP16 test's FP32 reference)."""
    from utils.qat.onnx.onnx_export import export_onnx
    out = work / "fp-static.onnx"
    rep = export_onnx(fp_model, out, imgsz=IMGSZ, batch_size=2, metadata={"source": "gelan-c.pt"})
    return out, rep


@pytest.fixture(scope="module")
def qat_plain_cli(yolov9_tree, qat_ckpt):
    """export_qat.py --include onnx --dynamic --simplify --inplace (the reference README's command), run once."""
    r = run_tool(yolov9_tree, "export_qat.py", "--weights", str(qat_ckpt), "--include", "onnx", "--dynamic",
                 "--simplify", "--inplace", "--imgsz", str(IMGSZ))
    assert r.returncode == 0, r.stdout + r.stderr
    return r, qat_ckpt.with_suffix(".onnx")


def _run(path, x: torch.Tensor) -> dict[str, np.ndarray]:
    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(None, {s.get_inputs()[0].name: x.numpy()})))


@torch.no_grad()
def _torch(model, x: torch.Tensor) -> np.ndarray:
    from utils.qat.core.yolov9 import outputs
    return outputs(model(x), "detect")[0].numpy()


def _io(path) -> tuple[dict, dict]:
    m = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in m.graph.initializer}

    def dims(v):
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim]
    ins = {v.name: (dims(v), v.type.tensor_type.elem_type) for v in m.graph.input if v.name not in inits}
    outs = {v.name: (dims(v), v.type.tensor_type.elem_type) for v in m.graph.output}
    return ins, outs


def _meta(path) -> dict:
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def _confident_box_diff(got: np.ndarray, ref: np.ndarray, conf: float = 0.25) -> float:
    """Max |box difference| (pixels) over anchors PyTorch scores above ``conf``."""
    mask = ref[:, 4:].max(1) > conf  # B, A
    assert mask.any(), "no confident anchors on the test images"
    return float(np.abs(got[:, :4] - ref[:, :4]).transpose(0, 2, 1)[mask].max())


def _no_partial_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


# ---------------------------------------------------------------------------------------------
# plain exports
# ---------------------------------------------------------------------------------------------

def test_fp_static_export_matches_pytorch(fp_model, fp_static, images):
    out, rep = fp_static
    ins, outs = _io(out)
    assert ins == {"images": ([2, 3, IMGSZ, IMGSZ], onnx.TensorProto.FLOAT)}
    assert outs == {"output0": ([2, 84, 525], onnx.TensorProto.FLOAT)}
    assert rep["opset"] == 17 and not rep["quantized"] and rep["qdq_pairs"] == 0 and rep["lint"] is None
    meta = _meta(out)
    assert meta["stride"] == "32" and meta["task"] == "detect" and meta["quantized"] == "false"
    assert json.loads(meta["names"])["0"] == "person" and json.loads(meta["imgsz"]) == [IMGSZ, IMGSZ]
    assert meta["source"] == "gelan-c.pt" and meta["version"]
    from utils.qat.core.provenance import toolkit_commit
    assert meta.get("toolkit_commit") == toolkit_commit()  # None (absent) where the tree records no commit
    diff = np.abs(_run(out, images)["output0"] - _torch(fp_model, images))
    print(f"FP static: max |ORT - PyTorch| boxes {diff[:, :4].max():.2e} px, scores {diff[:, 4:].max():.2e}")
    assert diff[:, :4].max() < 2e-3 and diff[:, 4:].max() < 1e-4
    # the head was put back the way it was
    head = fp_model.model[-1]
    assert "export" not in head.__dict__ and type(head).export is False


def test_fp_dynamic_export_runs_at_two_sizes(fp_model, fp_dynamic, images):
    out = fp_dynamic
    ins, outs = _io(out)
    assert ins["images"][0] == ["batch", 3, "height", "width"]
    assert outs["output0"][0] == ["batch", 84, "anchors"]
    for x in (images, torch.nn.functional.interpolate(images[:1], size=(128, 224), mode="bilinear")):
        got, ref = _run(out, x)["output0"], _torch(fp_model, x)
        assert got.shape == ref.shape
        assert np.abs(got - ref).max() < 2e-3, x.shape


@pytest.mark.slow
@pytest.mark.e2e
def test_qat_reference_command_plain(qat_plain_cli, qat_ckpt, qat_model, images):
    """export_qat.py --include onnx --dynamic --simplify --inplace (the reference README's command)."""
    r, out = qat_plain_cli
    assert out.is_file() and str(out) in r.stdout
    assert "Q/DQ pairs" in r.stdout and "Q/DQ lint: clean" in r.stdout and "simplify: done" in r.stdout
    ins, outs = _io(out)
    assert ins["images"][0] == ["batch", 3, "height", "width"] and outs["output0"][0] == ["batch", 84, "anchors"]
    from utils.qat.onnx import onnx_lint
    model = onnx.load(str(out))
    assert onnx_lint.lint(model)["total"] == 0
    s = onnx_lint.qdq_summary(model)
    assert s["opset"] == 17 and s["quantized_conv"] == s["conv"] - 1  # every conv but the DFL's
    assert s["qdq_pairs"] > 100 and s["dequantize_linear"] == s["qdq_pairs"] + s["quantized_conv"]
    assert _meta(out)["quantized"] == "true"
    assert _meta(out)["source_sha256"] == hashlib.sha256(qat_ckpt.read_bytes()).hexdigest()  # what it exported
    # weights are stored as INT8, exactly the integers PyTorch's fake quantization uses
    from onnx import numpy_helper
    from utils.qat.onnx.onnx_export import quantized_weights
    qmodel, _ = qat_model
    fake = quantized_weights(qmodel)
    inits = {t.name: t for t in model.graph.initializer}
    int8 = {n: t for n, t in inits.items() if t.data_type == onnx.TensorProto.INT8 and n.endswith(".weight_int8")}
    assert len(int8) == s["quantized_conv"]
    for dq in (n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in int8):
        k = numpy_helper.to_array(int8[dq.input[0]]).astype(np.float32)
        scale = numpy_helper.to_array(inits[dq.input[1]])
        w = fake[dq.input[0].removeprefix("model.").removesuffix("_int8")]
        assert np.abs(k * scale.reshape(-1, *[1] * (k.ndim - 1)) - w).max() <= 1e-6 * np.abs(w).max()
    qmodel, _ = qat_model
    for x in (images, torch.nn.functional.pad(images, (32, 32, 0, 0), value=0.5)):  # 160x160, 160x224
        got, ref = _run(out, x)["output0"], _torch(qmodel, x)
        assert got.shape == ref.shape
        box = _confident_box_diff(got, ref)
        print(f"INT8 {tuple(x.shape)}: max |ORT - fake-quant| all {np.abs(got - ref).max():.3f}, boxes of "
              f"confident anchors {box:.3f} px, scores {np.abs(got - ref)[:, 4:].max():.4f}")
        # A value on a rounding boundary can quantize one level apart in ORT and PyTorch (FP32 summation order
        # differs); such flips cascade through ~50 quantized layers: typically far below a pixel, at most a few.
        assert box < 5.0 and np.abs(got - ref)[:, 4:].max() < 0.15
        confident = ref[:, 4:].max(1) > 0.25
        assert np.median(np.abs(got - ref)[:, :4].transpose(0, 2, 1)[confident]) < 1.0


@pytest.mark.slow
def test_half_fp_and_qat(fp_model, fp_static, qat_model, qat_plain_cli, work, images):
    """--half is NVIDIA ModelOpt AutoCast: I/O stay FP32, FP initializers become FP16; on the Q/DQ graph the opset
    is 19 with FP16 scales and every quantized Conv reads its input and weight straight from a DequantizeLinear (no
    Cast in between: what ModelOpt keeps "for optimal TRT fusion"); the lint stays clean; outputs stay close.
    The FP32 references are the module's graphs of the same models (the static FP one, the reference command's
    INT8 one), not exported again: a GELAN-C export is what this test spends its time on."""
    from utils.qat.onnx.onnx_export import export_onnx
    from utils.qat.onnx.onnx_lint import conv_feeds
    qmodel, fp_patterns = qat_model
    for name, model, kw, full in (("fp", fp_model, {}, fp_static[0]),
                                  ("qat", qmodel, {"allow_fp": fp_patterns}, qat_plain_cli[1])):
        half = work / f"{name}-fp16.onnx"
        rep = export_onnx(model, half, imgsz=IMGSZ, batch_size=2, half=True, **kw)
        assert rep["half"] and _meta(half)["half"] == "true"
        m = onnx.load(str(half))
        ins, outs = _io(half)
        assert ins["images"][1] == outs["output0"][1] == onnx.TensorProto.FLOAT  # I/O stay FP32
        conv_w = [t for t in m.graph.initializer if t.dims and len(t.dims) == 4]
        q_scale_inputs = {n.input[1] for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}
        f16 = [t for t in m.graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
        assert f16, "no FP16 initializers"
        if name == "fp":
            assert all(t.data_type == onnx.TensorProto.FLOAT16 for t in conv_w)
            assert os.path.getsize(half) < 0.6 * os.path.getsize(full)
        else:
            assert rep["opset"] == 19 and rep["lint"]["total"] == 0
            assert rep["int8_weights"] == rep["quantized_conv"] > 100
            scales = [t.data_type for t in m.graph.initializer if t.name in q_scale_inputs]
            scales += [a.t.data_type for n in m.graph.node if n.op_type == "Constant" and n.output[0] in q_scale_inputs
                       for a in n.attribute if a.name == "value"]
            assert len(scales) == len(q_scale_inputs) and set(scales) == {onnx.TensorProto.FLOAT16}
            feeds = conv_feeds(m)
            assert feeds["input"]["DequantizeLinear -> Conv"] == rep["quantized_conv"]
            assert feeds["weight"]["DequantizeLinear -> Conv"] == rep["quantized_conv"]
            assert not any("Cast" in k for k in feeds["input"]) and not any("Cast" in k for k in feeds["weight"])
        ref = _run(full, images)["output0"]
        got = _run(half, images)["output0"]
        box = _confident_box_diff(got, ref)
        print(f"{name} FP16 vs FP32 graph: boxes of confident anchors {box:.3f} px, scores "
              f"{np.abs(got - ref)[:, 4:].max():.4f}")
        if name == "fp":
            assert box < 1.0 and np.abs(got - ref)[:, 4:].max() < 0.01
        else:  # FP16 rounding (and FP16 scales) move some activations across an INT8 rounding boundary: flips cascade
            assert box < 5.0 and np.abs(got - ref)[:, 4:].max() < 0.15


def test_half_without_autocast_packages_is_one_sentence(fp_model, work, monkeypatch):
    import builtins

    from utils.qat.core.errors import QATError
    from utils.qat.onnx.onnx_export import export_onnx
    real_import = builtins.__import__

    def no_autocast(name, *args, **kwargs):
        if name.startswith("modelopt.onnx"):
            raise ImportError("No module named 'onnx_graphsurgeon'")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_autocast)
    out = work / "no-autocast.onnx"
    with pytest.raises(QATError) as e:
        export_onnx(fp_model, out, imgsz=IMGSZ, half=True)
    assert "onnx_graphsurgeon" in str(e.value) and "install_dependencies.sh" in str(e.value)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# End2End
# ---------------------------------------------------------------------------------------------

def _detections(outs: dict, i: int) -> np.ndarray:
    n = int(outs["num_dets"][i, 0])
    d = np.concatenate([outs["det_boxes"][i, :n], outs["det_scores"][i, :n, None],
                        outs["det_classes"][i, :n, None].astype(np.float32)], 1)
    return d[np.lexsort((d[:, 5], -d[:, 4]))]


def _upstream(pred: np.ndarray, conf: float, iou: float, topk: int, agnostic: bool) -> list[np.ndarray]:
    from utils.general import non_max_suppression
    dets = non_max_suppression(torch.from_numpy(pred), conf, iou, agnostic=agnostic, multi_label=not agnostic,
                               max_det=topk)
    return [d.numpy()[np.lexsort((d.numpy()[:, 5], -d.numpy()[:, 4]))] for d in dets]


@pytest.mark.parametrize("agnostic", [False, True])
def test_end2end_onnx_fp_equals_upstream_nms(fp_model, work, images, agnostic):
    from utils.qat.onnx.onnx_export import export_onnx
    out = work / f"fp-e2e-onnx-{agnostic}.onnx"
    conf, iou, topk = 0.01, 0.6, 50
    export_onnx(fp_model, out, imgsz=IMGSZ, batch_size=2, end2end=dict(
        backend="onnx", topk_all=topk, iou_thres=iou, conf_thres=conf, class_agnostic=agnostic))
    ins, outs = _io(out)
    assert outs == {"num_dets": ([2, 1], onnx.TensorProto.INT32),
                    "det_boxes": ([2, topk, 4], onnx.TensorProto.FLOAT),
                    "det_scores": ([2, topk], onnx.TensorProto.FLOAT),
                    "det_classes": ([2, topk], onnx.TensorProto.INT32)}
    got = _run(out, images)
    ref = _upstream(_torch(fp_model, images), conf, iou, topk, agnostic)
    for i, r in enumerate(ref):
        g = _detections(got, i)
        assert len(g) == len(r) and len(r) > 0
        assert np.abs(g - r).max() < 1e-3
        assert (got["det_scores"][i, len(g):] == 0).all() and (got["det_boxes"][i, len(g):] == 0).all()


@pytest.mark.slow
def test_end2end_onnx_qat_equals_plain_graph_plus_nms(qat_model, qat_plain_cli, work, images):
    """INT8 End2End (--nms onnx, dynamic, simplified): the detections of the plain INT8 graph (the reference
    command's export) + upstream NMS, at two image sizes."""
    from utils.qat.onnx.onnx_export import export_onnx
    qmodel, fp_patterns = qat_model
    e2e = work / "qat-e2e-onnx.onnx"
    conf, iou, topk = 0.01, 0.6, 50
    rep = export_onnx(qmodel, e2e, imgsz=IMGSZ, dynamic=True, simplify=True, allow_fp=fp_patterns, end2end=dict(
        backend="onnx", topk_all=topk, iou_thres=iou, conf_thres=conf))
    assert rep["lint"]["total"] == 0 and rep["int8_weights"] > 100 and rep["simplify"] == "done"
    for x in (images, torch.nn.functional.pad(images, (0, 64, 0, 0), value=0.5)):
        got = _run(e2e, x)
        ref = _upstream(_run(qat_plain_cli[1], x)["output0"], conf, iou, topk, False)
        for i, r in enumerate(ref):
            g = _detections(got, i)
            assert len(g) == len(r) > 0 and np.abs(g - r).max() < 1e-3


@pytest.mark.slow
@pytest.mark.e2e
def test_end2end_trt_reference_command(yolov9_tree, qat_ckpt, work):
    """export_qat.py --include onnx_end2end --nms trt (the reference README's graph): an EfficientNMS_TRT plugin
    node, with a notice that the plugin is deprecated since TensorRT 10.12 (the default is --nms onnx)."""
    r = run_tool(yolov9_tree, "export_qat.py", "--weights", str(qat_ckpt), "--include", "onnx_end2end",
                 "--imgsz", str(IMGSZ), "--nms", "trt")
    assert r.returncode == 0, r.stdout + r.stderr
    out = qat_ckpt.with_name(qat_ckpt.stem + "-end2end.onnx")
    assert out.is_file() and "EfficientNMS_TRT" in r.stdout and "Q/DQ lint: clean" in r.stdout
    assert "deprecated since TensorRT 10.12" in r.stdout
    m = onnx.load(str(out))
    onnx.checker.check_model(m)
    nms = [n for n in m.graph.node if n.op_type == "EfficientNMS_TRT"]
    assert len(nms) == 1 and nms[0].domain == "TRT"
    assert any(o.domain == "TRT" for o in m.opset_import)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nms[0].attribute}
    assert attrs == {"background_class": -1, "box_coding": 1, "iou_threshold": pytest.approx(0.45),
                     "max_output_boxes": 100, "plugin_version": b"1", "score_activation": 0,
                     "score_threshold": pytest.approx(0.25), "class_agnostic": 0}
    assert list(nms[0].output) == E2E_OUTPUTS
    ins, outs = _io(out)
    assert ins == {"images": ([1, 3, IMGSZ, IMGSZ], onnx.TensorProto.FLOAT)}
    assert outs == {"num_dets": ([1, 1], onnx.TensorProto.INT32), "det_boxes": ([1, 100, 4], onnx.TensorProto.FLOAT),
                    "det_scores": ([1, 100], onnx.TensorProto.FLOAT),
                    "det_classes": ([1, 100], onnx.TensorProto.INT32)}
    # the plugin's inputs: xywh boxes (B, A, 4) and scores (B, A, 80) sliced from the head output
    producers = {o: n for n in m.graph.node for o in n.output}
    assert producers[nms[0].input[0]].op_type == producers[nms[0].input[1]].op_type == "Slice"
    assert json.loads(_meta(out)["end2end"])["backend"] == "trt"
    assert "QuantizeLinear" in {n.op_type for n in m.graph.node}


@pytest.mark.slow
def test_end2end_trt_options_and_segmentation_graph(yolov9_tree, work):
    """--class-agnostic / thresholds reach the plugin; segmentation uses EfficientNMSX_TRT + ROIAlign_TRT and the
    --nms onnx segmentation graph runs in ONNX Runtime (tiny random model with an upstream Segment head)."""
    from utils.qat.onnx.onnx_export import export_onnx
    det = build(TINY_GELAN)
    out = work / "tiny-e2e-trt.onnx"
    export_onnx(det, out, imgsz=64, dynamic=True, end2end=dict(backend="trt", topk_all=20, iou_thres=0.5,
                                                                conf_thres=0.3, class_agnostic=True))
    nms = next(n for n in onnx.load(str(out)).graph.node if n.op_type == "EfficientNMS_TRT")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nms.attribute}
    assert attrs["class_agnostic"] == 1 and attrs["max_output_boxes"] == 20
    assert attrs["iou_threshold"] == pytest.approx(0.5) and attrs["score_threshold"] == pytest.approx(0.3)

    seg_cfg = {**TINY_GELAN, "head": TINY_GELAN["head"][:-1] + [[[15, 18, 21], 1, "Segment", ["nc", 8, 32]]]}
    seg = build(seg_cfg)
    r = 16
    opts = dict(topk_all=10, iou_thres=0.5, conf_thres=0.0, mask_resolution=r, pooler_scale=0.25)
    trt_out, onnx_out = work / "tiny-seg-trt.onnx", work / "tiny-seg-onnx.onnx"
    export_onnx(seg, trt_out, imgsz=64, task="segment", end2end=dict(backend="trt", **opts))
    g = onnx.load(str(trt_out)).graph
    ops = {n.op_type: n for n in g.node}
    assert "EfficientNMSX_TRT" in ops and "ROIAlign_TRT" in ops
    roi = {a.name: onnx.helper.get_attribute_value(a) for a in ops["ROIAlign_TRT"].attribute}
    assert roi["output_height"] == roi["output_width"] == r and roi["spatial_scale"] == pytest.approx(0.25)
    assert roi["plugin_version"] == b"2"  # IPluginV3, since TensorRT 10.1; version 1 is deprecated (10.12)
    from utils.qat.trt.trt_engine import onnx_metadata
    assert [p["name"] for p in onnx_metadata(trt_out)["plugins"]] == ["EfficientNMSX_TRT", "ROIAlign_TRT"]
    assert [o.name for o in g.output] == E2E_OUTPUTS + ["det_masks"]
    export_onnx(seg, onnx_out, imgsz=64, batch_size=2, task="segment", end2end=dict(backend="onnx", **opts))
    x = torch.rand(2, 3, 64, 64)
    got = _run(onnx_out, x)
    assert got["det_masks"].shape == (2, 10, r * r)
    n = got["num_dets"][:, 0]
    assert (n > 0).all()
    masks = got["det_masks"]
    assert ((masks >= 0) & (masks <= 1)).all()
    for i in range(2):
        assert (masks[i, n[i]:] == 0).all() and (masks[i, :n[i]].max(1) > 0).all()


# ---------------------------------------------------------------------------------------------
# DeepStream
# ---------------------------------------------------------------------------------------------

def _deepstream_expected(pred: np.ndarray) -> np.ndarray:
    x = pred.transpose(0, 2, 1)
    xy, wh = x[..., :2], x[..., 2:4]
    scores = x[..., 4:]
    return np.concatenate([xy - wh / 2, xy + wh / 2, scores.max(-1, keepdims=True),
                           scores.argmax(-1)[..., None].astype(np.float32)], -1)


@pytest.mark.slow
@pytest.mark.e2e
def test_deepstream_qat_export(yolov9_tree, qat_ckpt, qat_model, images):
    """export_yoloV9.py --size N --dynamic --simplify on a QAT checkpoint."""
    r = run_tool(yolov9_tree, "export_yoloV9.py", "--weights", str(qat_ckpt), "--size", str(IMGSZ), "--dynamic",
                 "--simplify")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "QAT" in r.stdout and "single head" in r.stdout
    out = qat_ckpt.with_name(qat_ckpt.name + ".onnx")
    labels = (out.parent / "labels.txt").read_text().splitlines()
    assert len(labels) == 80 and labels[0] == "person"
    ins, outs = _io(out)
    assert ins == {"input": (["batch", 3, IMGSZ, IMGSZ], onnx.TensorProto.FLOAT)}
    assert outs == {"output": (["batch", 525, 6], onnx.TensorProto.FLOAT)}
    got = _run(out, images)["output"]
    want = _deepstream_expected(_torch(qat_model[0], images))
    conf = want[..., 4] > 0.25
    assert np.abs(got[..., :4] - want[..., :4])[conf].max() < 4.0
    assert (got[..., 5][conf] == want[..., 5][conf]).mean() > 0.95


@pytest.mark.slow
@pytest.mark.e2e
def test_deepstream_fp_dual_head(yolov9_tree, work):
    """An FP checkpoint with a dual head (DualDDetect): main branch only, --batch 2 --size H W."""
    dual_cfg = {**TINY_GELAN, "head": TINY_GELAN["head"][:-1] + [[[15, 18, 21, 15, 18, 21], 1, "DualDDetect", ["nc"]]]}
    model = build(dual_cfg).eval()
    weights = work / "tiny-dual.pt"
    torch.save({"model": model, "epoch": -1}, weights)
    r = run_tool(yolov9_tree, "export_yoloV9.py", "--weights", str(weights), "--batch", "2", "--size", "64", "96")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FP" in r.stdout and "dual head" in r.stdout and "DualDDetect" in r.stdout
    out = work / "tiny-dual.pt.onnx"
    ins, outs = _io(out)
    assert ins == {"input": ([2, 3, 64, 96], onnx.TensorProto.FLOAT)}
    assert outs["output"][0] == [2, (8 * 12) + (4 * 6) + (2 * 3), 6]
    x = torch.rand(2, 3, 64, 96)
    fused = model.fuse()
    with torch.no_grad():
        main = fused(x)[0][-1].numpy()  # eval mode: ([aux, main], train outputs)
    got = _run(out, x)["output"]
    assert np.abs(got - _deepstream_expected(main)).max() < 1e-3
    assert (work / "labels.txt").read_text().splitlines()[:2] == ["class0", "class1"]


# ---------------------------------------------------------------------------------------------
# val_trt.py on ONNX Runtime vs the evaluator on PyTorch
# ---------------------------------------------------------------------------------------------

def _val(tree, onnx_path, data, project, name):
    r = run_tool(tree, "val_trt.py", "--onnx", str(onnx_path), "--backend", "onnxruntime", "--data", str(data),
                 "--imgsz", str(IMGSZ), "--batch-size", "4", "--workers", "0", "--project", str(project),
                 "--name", name, "--exist-ok", "--save-json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| AP |" in r.stdout.replace("| Model | AP |", "| AP |")
    assert (Path(project) / name / "predictions.json").is_file()
    return json.loads((Path(project) / name / "results.json").read_text())


def _evaluate(model, data):
    from utils.qat.evaluation.backends import TorchBackend
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.evaluation.evaluate import evaluate
    return evaluate(TorchBackend(model, torch.device("cpu")), load_data_yaml(data), imgsz=IMGSZ, batch_size=4,
                    workers=0)


def test_a_runs_evaluations_share_one_val_loader_and_score_alike(fp_model, small_data, monkeypatch):
    """A run scores its model after every stage (FP, PTQ, each epoch). ``Evaluation`` makes the val loader once
    and keeps it, workers and all: the same scores as a loader of its own every time, also after a pass that broke
    off after its first batch (the kept loader is then one batch into its order), and a pass over fewer images
    makes its own loader."""
    import utils.qat.evaluation.evaluate as evaluate_module
    from utils.qat.evaluation.backends import TorchBackend
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.run.pipeline import Evaluation

    made = []
    real = evaluate_module.dataloader

    def counted(*args, **kwargs):
        made.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "dataloader", counted)
    data = load_data_yaml(small_data)
    score = Evaluation(data, imgsz=IMGSZ, batch_size=4, device=torch.device("cpu"), workers=1)

    class BreaksOff(TorchBackend):
        def __call__(self, images):
            raise KeyboardInterrupt  # after the loader gave its first batch

    first, _ = score(fp_model, "first")
    with pytest.raises(KeyboardInterrupt):
        evaluate_module.evaluate(BreaksOff(fp_model, torch.device("cpu")), data, imgsz=IMGSZ, batch_size=4,
                                 workers=1, loaders=score.loaders)
    second, _ = score(fp_model, "second")
    assert len(made) == 1, "each full pass of the run made a loader of its own"
    fresh = _evaluate(fp_model, small_data)
    assert len(made) == 2
    for m in (first, second):
        assert m.images == fresh.images == 8
        assert (m.mAP50_95, m.mAP50, m.instances) == (fresh.mAP50_95, fresh.mAP50, fresh.instances)
        assert {h: x.mAP50_95 for h, x in m.halves.items()} == {h: x.mAP50_95 for h, x in fresh.halves.items()}
    score(fp_model, "a part", num_images=4)
    assert len(made) == 3


@pytest.mark.slow
@pytest.mark.e2e
def test_val_trt_fp_onnx_equals_pytorch(yolov9_tree, fp_model, fp_dynamic, work, small_data):
    got = _val(yolov9_tree, fp_dynamic, small_data, work / "runs", "fp")
    want = _evaluate(fp_model, small_data)
    print(f"FP: PyTorch mAP50-95 {want.mAP50_95:.4f} mAP50 {want.mAP50:.4f}; ONNX Runtime {got['AP']:.4f} "
          f"{got['AP50']:.4f}")
    assert got["images"] == want.images == 8
    assert abs(got["AP"] - want.mAP50_95) < 1e-3 and abs(got["AP50"] - want.mAP50) < 1e-3


@pytest.mark.e2e
def test_val_trt_says_a_fixed_size_graph_scores_squares(yolov9_tree, fp_static, fp_dynamic, work, small_data):
    """A graph with a fixed input letterboxes every image into its square, where qat.py eval scores rectangular
    batches (on yolov9-t-coco that alone moved mAP50-95 by 0.0028): val_trt.py says so for such a graph, and not
    for a --dynamic one."""
    common = ["--backend", "onnxruntime", "--data", str(small_data), "--imgsz", str(IMGSZ), "--workers", "0",
              "--num-image", "2", "--project", str(work / "runs"), "--exist-ok"]
    static = run_tool(yolov9_tree, "val_trt.py", "--onnx", str(fp_static[0]), "--batch-size", "2", *common,
                      "--name", "square")
    dynamic = run_tool(yolov9_tree, "val_trt.py", "--onnx", str(fp_dynamic), "--batch-size", "2", *common,
                       "--name", "rect")
    assert static.returncode == 0 and dynamic.returncode == 0, static.stderr + dynamic.stderr
    notice = f"every image is letterboxed into {IMGSZ}x{IMGSZ}, where qat.py eval"
    assert notice in static.stdout and "export with --dynamic to compare with the checkpoint" in static.stdout
    assert "letterboxed" not in dynamic.stdout


@pytest.mark.slow
@pytest.mark.e2e
def test_val_trt_end2end_equals_plain(yolov9_tree, fp_model, fp_dynamic, work, small_data):
    """An End2End graph (--nms onnx) with the evaluation thresholds scores like the plain graph + upstream NMS."""
    from utils.qat.onnx.onnx_export import export_onnx
    e2e = work / "fp-e2e-eval.onnx"
    export_onnx(fp_model, e2e, imgsz=IMGSZ, dynamic=True, end2end=dict(backend="onnx", topk_all=300, iou_thres=0.7,
                                                                        conf_thres=0.001))
    got = _val(yolov9_tree, e2e, small_data, work / "runs", "e2e")
    done = work / "runs" / "fp" / "results.json"  # test_val_trt_fp_onnx_equals_pytorch's run
    plain = json.loads(done.read_text()) if done.is_file() else _val(yolov9_tree, fp_dynamic, small_data,
                                                                      work / "runs", "fp")
    print(f"FP End2End (onnx NMS) mAP50-95 {got['AP']:.4f} mAP50 {got['AP50']:.4f}; plain {plain['AP']:.4f} "
          f"{plain['AP50']:.4f}")
    assert got["graph"] == "End2End" and got["images"] == 8
    assert abs(got["AP"] - plain["AP"]) < 1e-3 and abs(got["AP50"] - plain["AP50"]) < 1e-3


@pytest.mark.e2e
def test_val_trt_reads_upstream_metadata(yolov9_tree, fp_model, fp_dynamic, work, small_data):
    """Upstream YOLOv9's export.py stores ``str(v)`` per key: ``stride`` '32', ``names`` a Python dict literal
    ("{0: 'person', ...}", not JSON). val_trt.py reads it (JSON or Python literal, never evaluated as code) and
    scores the graph like our own export of it."""
    import onnx
    from utils.qat.evaluation.backends import ORTBackend
    m = onnx.load(str(fp_dynamic))
    del m.metadata_props[:]
    for k, v in {"stride": int(max(fp_model.stride)), "names": dict(fp_model.names)}.items():
        p = m.metadata_props.add()
        p.key, p.value = k, str(v)  # as upstream export.py writes them
    assert m.metadata_props[1].value.startswith("{0: 'person', 1: 'bicycle'")
    upstream = work / "fp-upstream-meta.onnx"
    onnx.save(m, str(upstream))
    backend = ORTBackend(upstream)
    assert backend.stride == 32 and backend.names == dict(fp_model.names) and backend.task == "detect"
    got = _val(yolov9_tree, upstream, small_data, work / "runs", "upstream")
    done = work / "runs" / "fp" / "results.json"  # test_val_trt_fp_onnx_equals_pytorch's run
    plain = json.loads(done.read_text()) if done.is_file() else _val(yolov9_tree, fp_dynamic, small_data,
                                                                      work / "runs", "fp")
    assert got["images"] == 8 and got["AP"] == plain["AP"] and got["AP50"] == plain["AP50"]


@pytest.mark.slow
@pytest.mark.e2e
def test_val_trt_int8_onnx_scores_as_fake_quant(yolov9_tree, qat_model, qat_plain_cli, work, small_data):
    """GELAN-C's Q/DQ graph (simplified by onnxslim, as the reference README exports it) on ONNX Runtime scores
    what its checkpoint scores in PyTorch, to the last digit: val_trt.py computes the graph in the checkpoint's
    arithmetic (utils/qat/onnx/integer_graph.py)."""
    _, out = qat_plain_cli
    got = _val(yolov9_tree, out, small_data, work / "runs", "int8")
    want = _evaluate(qat_model[0], small_data)
    print(f"INT8: fake-quant mAP50-95 {want.mAP50_95:.4f} mAP50 {want.mAP50:.4f}; ONNX Runtime {got['AP']:.4f} "
          f"{got['AP50']:.4f}")
    assert got["images"] == want.images == 8
    assert (got["AP"], got["AP50"]) == (round(want.mAP50_95, 4), round(want.mAP50, 4))


# ---------------------------------------------------------------------------------------------
# errors: one sentence, non-zero exit, nothing half-written
# ---------------------------------------------------------------------------------------------

def test_cli_errors(yolov9_tree, work):
    """The CLIs' own checks: one sentence (run_cli prints it as 'error: ...', exit status 2; argparse's choices:
    tests/test_validate.py)."""
    bad = work / "errors"
    bad.mkdir()
    assert "not found" in cli_error(yolov9_tree, "export_qat.py", "--weights", str(bad / "nope.pt"))
    error = cli_error(yolov9_tree, "export_yoloV9.py", "--weights", str(work / "gelan-c.pt"), "--batch", "4",
                      "--dynamic")
    assert "--dynamic" in error and "--batch" in error
    assert not list(bad.iterdir())


def test_open_backend_by_suffix(yolov9_tree, work, fp_dynamic):
    """utils.qat.evaluation.backends.open_backend: a .pt checkpoint runs in PyTorch, an .onnx in ONNX Runtime, both with every
    attribute of the Backend protocol."""
    from typing import get_type_hints

    from utils.qat.evaluation.backends import Backend, open_backend
    for path, runtime in ((work / "gelan-c.pt", "PyTorch"), (fp_dynamic, "ONNX Runtime")):
        backend = open_backend(path, "cpu")
        assert (backend.runtime, backend.task, backend.stride) == (runtime, "detect", 32)
        assert [k for k in get_type_hints(Backend) if not hasattr(backend, k)] == []
        assert backend(torch.zeros(1, 3, 64, 64)).shape[:2] == (1, 84)


def test_library_errors(yolov9_tree, work, small_data):
    """The remaining error cases, in-process (the QATError sentences run_cli prints)."""
    import export_qat
    import val_trt
    from models.yolo import ClassificationModel
    from utils.qat.core.errors import QATError
    bad = work / "errors-lib"
    bad.mkdir()

    def export(*argv):
        return export_qat.main(export_qat.get_args_parser().parse_args(list(argv)))
    (bad / "junk.pt").write_text("not a checkpoint")
    with pytest.raises(QATError, match="not a PyTorch checkpoint"):
        export("--weights", str(bad / "junk.pt"))
    classifier = ClassificationModel.__new__(ClassificationModel)
    torch.nn.Module.__init__(classifier)
    torch.save({"model": classifier}, bad / "cls.pt")
    with pytest.raises(QATError, match="classify model.*End2End"):
        export("--weights", str(bad / "cls.pt"), "--include", "onnx_end2end")
    with pytest.raises(QATError, match="--topk-all"):
        export("--weights", str(work / "gelan-c.pt"), "--include", "onnx_end2end", "--topk-all", "0")
    with pytest.raises(QATError, match="--imgsz"):
        export("--weights", str(work / "gelan-c.pt"), "--imgsz", "320", "320", "320")
    engine = bad / "model.engine"
    engine.write_bytes(b"\0" * 16)
    try:
        import tensorrt
        has_trt = hasattr(tensorrt, "Builder")
    except ImportError:
        has_trt = False
    if not has_trt:
        args = val_trt.get_args_parser().parse_args(["--engine-file", str(engine), "--data", str(small_data)])
        with pytest.raises(QATError, match="TensorRT"):
            val_trt.main(args)
    args = val_trt.get_args_parser().parse_args(["--onnx", str(bad / "missing.onnx"), "--data", str(small_data)])
    with pytest.raises(QATError, match="not found"):
        val_trt.main(args)
    assert sorted(p.name for p in bad.iterdir()) == ["cls.pt", "junk.pt", "model.engine"]


def test_unwritable_output_leaves_nothing(fp_model, work):
    from utils.qat.core.errors import QATError
    from utils.qat.onnx.onnx_export import export_onnx
    folder = work / "unwritable"
    folder.mkdir()
    (folder / "model.onnx").mkdir()  # the output path is taken by a folder: the final rename fails
    with pytest.raises(QATError, match="cannot write"):
        export_onnx(fp_model, folder / "model.onnx", imgsz=64)
    assert [p.name for p in folder.iterdir()] == ["model.onnx"] and (folder / "model.onnx").is_dir()


def test_export_skips_the_exporters_graph_checks_and_writes_the_same_onnx(shared, work, monkeypatch):
    """export_onnx leaves out the TorchScript exporter's graph checks (``torch._C._jit_pass_lint``, seconds each on
    a quantized model): the file is byte for byte the one written with them, and the checks are back after it."""
    import contextlib

    import torch
    from utils.qat.onnx import onnx_export
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    x = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 1, 64)
    qmodel, _ = quantize(build(TINY_GELAN), [x], QuantConfig(method="max", head_amax="calibrated"), example=x)
    calls = []
    original = torch._C._jit_pass_lint

    def counted(graph):
        calls.append(1)
        return original(graph)
    monkeypatch.setattr(torch._C, "_jit_pass_lint", counted)
    onnx_export.export_onnx(qmodel, work / "unlinted.onnx", imgsz=64, metadata={})
    assert not calls and torch._C._jit_pass_lint is counted
    monkeypatch.setattr(onnx_export, "_without_jit_lint", contextlib.nullcontext)
    onnx_export.export_onnx(qmodel, work / "linted.onnx", imgsz=64, metadata={})
    assert len(calls) >= 5
    assert (work / "unlinted.onnx").read_bytes() == (work / "linted.onnx").read_bytes()


def test_simplify_failure_keeps_unsimplified(yolov9_tree, work, monkeypatch, capsys):
    import export_qat
    from utils.qat.onnx import onnx_qdq

    def broken(model, **kwargs):
        raise RuntimeError("onnxslim failed: ValueError: boom")
    monkeypatch.setattr(onnx_qdq, "simplify", broken)
    weights = work / "slim" / "gelan-c.pt"
    weights.parent.mkdir()
    weights.symlink_to(work / "gelan-c.pt")
    args = export_qat.get_args_parser().parse_args(["--weights", str(weights), "--simplify", "--imgsz", "64"])
    reports = export_qat.main(args)
    out = capsys.readouterr().out
    assert reports[0]["simplify"].startswith("failed: onnxslim failed")
    assert "unsimplified" in out and "boom" in out
    onnx.checker.check_model(onnx.load(str(weights.with_suffix(".onnx"))))
    assert not _no_partial_files(weights.parent)


@pytest.mark.slow
def test_check_findings_keep_no_graph(qat_ckpt, work, monkeypatch, capsys):
    """--check (default for quantized checkpoints): lint findings are printed, no graph is kept, exit non-zero, and
    the sentence names the finding and its node; --no-check keeps the graph."""
    import export_qat
    from utils.qat.onnx import onnx_lint
    from utils.qat.core.errors import QATError
    lint = onnx_lint.lint

    def one_finding(model, **kwargs):
        report = lint(model, **kwargs)
        report["findings"] = {"concat_scale_mismatch": {"count": 1, "nodes": ["/model/model.11/Concat"]}}
        report["total"] = 1
        return report
    monkeypatch.setattr(onnx_lint, "lint", one_finding)
    weights = work / "check" / "qat.pt"
    weights.parent.mkdir()
    weights.symlink_to(qat_ckpt)
    args = export_qat.get_args_parser().parse_args(["--weights", str(weights), "--imgsz", "64"])
    with pytest.raises(QATError, match="lint found 1 TensorRT fusion blocker in the graph exported from .*qat.pt "
                                       r"\(concat_scale_mismatch at /model/model.11/Concat; all listed above\), so no "
                                       "graph was kept; .* pass --no-check to keep the graph as it is"):
        export_qat.main(args)
    out = capsys.readouterr().out
    assert "concat_scale_mismatch" in out and "/model/model.11/Concat" in out
    assert not weights.with_suffix(".onnx").exists() and not _no_partial_files(weights.parent)
    export_qat.main(export_qat.get_args_parser().parse_args(["--weights", str(weights), "--imgsz", "64",
                                                             "--no-check"]))
    assert weights.with_suffix(".onnx").is_file()
