"""The quantization engine on the real reference model (GELAN-C) and small models, on CPU."""
from __future__ import annotations

import copy
import fnmatch
import json
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from helpers import TINY_GELAN, build, real_images, reinit

IMGSZ = 160


@pytest.fixture(scope="module")
def calib_images(shared):
    return real_images(shared / "datasets" / "coco369" / "images" / "train2017", 4, IMGSZ)


@pytest.fixture(scope="module")
def val_images(shared):
    return real_images(shared / "datasets" / "coco334" / "images" / "val2017", 2, IMGSZ)


@pytest.fixture(scope="module")
def gelan_c_fp(yolov9_tree, gelan_c):
    from utils.qat.model import checkpoint
    return checkpoint.load_fp(gelan_c)


@pytest.fixture(scope="module")
def gelan_c_q(gelan_c_fp, calib_images):
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    qmodel, info = quantize(gelan_c_fp, [calib_images[:2], calib_images[2:]], QuantConfig(method="max", head_amax="calibrated"),
                            example=calib_images[:1])
    qmodel.names = gelan_c_fp.names
    return qmodel, info


def assert_int8_close(got: np.ndarray, ref: np.ndarray) -> None:
    """ONNX Runtime vs PyTorch fake-quant: the same graph, but convs that differ in the last float bit flip
    INT8 rounding at a few ties and the flips spread; outputs agree closely, not bitwise."""
    assert got.shape == ref.shape
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.97
    assert np.median(np.abs(got - ref)) < 0.05 * np.median(np.abs(ref)) + 1e-4


def _quantizers(model):
    from modelopt.torch.quantization.nn import TensorQuantizer
    return {n: m for n, m in model.named_modules() if isinstance(m, TensorQuantizer)}


def test_every_conv_quantized_except_dfl(gelan_c_q):
    qmodel, _ = gelan_c_q
    convs = {n: m for n, m in qmodel.named_modules() if isinstance(m, torch.nn.Conv2d)}
    assert len(convs) > 100
    for name, conv in convs.items():
        fp = "dfl" in name
        assert conv.input_quantizer.is_enabled is not fp, name
        assert conv.weight_quantizer.is_enabled is not fp, name
        if not fp:
            assert conv.weight_quantizer.axis == 0 and conv.input_quantizer.axis is None
            assert conv.weight_quantizer.num_bits == 8 and not conv.weight_quantizer.unsigned
            assert conv.weight_quantizer.amax.numel() == conv.out_channels  # per output channel


def test_extra_quantizers_placed(gelan_c_q):
    qmodel, _ = gelan_c_q
    names = [n for n, q in _quantizers(qmodel).items() if q.is_enabled]
    kinds = {
        "concat": [n for n in names if fnmatch.fnmatch(n, "model.*.input_quantizer") and n.count(".") == 2],
        "residual": [n for n in names if n.endswith("residual_input_quantizer")],
        "branch": [n for n in names if n.endswith("branch_input_quantizer")],
        "avgpool": [n for n in names if n.endswith("avgpool_input_quantizer")],
        "maxpool": [n for n in names if n.endswith("maxpool_input_quantizer") or ".m.input_quantizer" in n],
    }
    for kind, found in kinds.items():
        assert found, f"no {kind} quantizer placed"
    # GELAN-C: Upsample layers 10 and 13 and Concat layers 11, 14, 17, 20 carry input quantizers
    for i in (10, 11, 13, 14, 17, 20):
        assert f"model.{i}.input_quantizer" in names


def test_shared_scale_groups_equal_amax(gelan_c_q):
    qmodel, info = gelan_c_q
    quantizers = _quantizers(qmodel)
    assert len(info.scale_groups) > 10
    for group in info.scale_groups:
        amaxes = {float(quantizers[n].amax) for n in group}
        assert len(amaxes) == 1, group
    grouped = {n for g in info.scale_groups for n in g}
    # a Concat shares its scale with the convs reading its output; ADown's average pool's output (the default
    # --pool-scale own) one scale for both halves after it, the max pool and the convs they feed, not the pool's input
    assert {"model.11.input_quantizer", "model.12.cv1.conv.input_quantizer"} <= next(
        set(g) for g in info.scale_groups if "model.11.input_quantizer" in g)
    pooled = next(set(g) for g in info.scale_groups if "model.3.cv1.conv.input_quantizer" in g)
    assert {"model.3.maxpool_input_quantizer", "model.3.cv2.conv.input_quantizer"} <= pooled <= grouped
    assert "model.3.avgpool_input_quantizer" not in pooled
    # SPPELAN: every MaxPool input and the conv after the concat
    assert {"model.9.cv2.m.input_quantizer", "model.9.cv5.conv.input_quantizer"} <= next(
        set(g) for g in info.scale_groups if "model.9.cv5.conv.input_quantizer" in g)


def test_fake_quant_close_to_fp(gelan_c_fp, gelan_c_q, val_images):
    """Fake-quant is on (the quantizers enabled, each with a calibrated amax) and moves the class scores by a
    bounded amount; the same model with those quantizers off gives FP's scores again, so the gap is INT8's."""
    qmodel, _ = gelan_c_q
    on = [q for q in _quantizers(qmodel).values() if q.is_enabled]
    assert len(on) > 200
    assert all(q.amax is not None and torch.isfinite(q.amax).all() and (q.amax > 0).all() for q in on)
    with torch.no_grad():
        ref = gelan_c_fp(val_images)[0][:, 4:]
        out = qmodel(val_images)[0][:, 4:]
        for q in on:
            q.disable()
        try:
            off = qmodel(val_images)[0][:, 4:]
        finally:
            for q in on:
                q.enable()
    gap, fp_gap = (out - ref).abs().max().item(), (off - ref).abs().max().item()
    assert fp_gap < 1e-4  # float rounding of the fused convs only (1.4e-6 measured)
    assert 1e-2 < gap < 0.2 and gap > 100 * fp_gap  # INT8 moves a score by 0.06 at most here
    assert torch.corrcoef(torch.stack([ref.flatten(), out.flatten()]))[0, 1] > 0.95


def test_checkpoint_round_trip_in_fresh_process(yolov9_tree, gelan_c_q, val_images, tmp_path):
    from utils.qat.model import checkpoint
    qmodel, info = gelan_c_q
    path = checkpoint.save_quantized(tmp_path / "q.pt", qmodel, info)
    assert not list(tmp_path.glob("*.part"))
    with zipfile.ZipFile(path) as z:
        pickled = b"".join(z.read(n) for n in z.namelist() if n.endswith(".pkl"))
    # The toolkit classes a checkpoint pickles are quantize/'s only (the quantized twins): the modules that
    # moved into packages (utils/qat/core, model, ...) are never in a pickle, so checkpoints written before the move still load.
    toolkit = {m.decode() for m in re.findall(rb"utils\.qat[\w.]*", pickled)}
    assert all(m.startswith("utils.qat.quantize.") for m in toolkit), toolkit
    torch.save(val_images, tmp_path / "x.pt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # oneDNN's kernel choice varies with the thread count; fix it on both sides
    try:
        with torch.no_grad():
            expected = qmodel(val_images)[0]
    finally:
        torch.set_num_threads(threads)
    code = (
        "import sys, torch; sys.path.insert(0, '.'); torch.set_num_threads(1)\n"
        "from utils.qat.core import compat; compat.apply('.')\n"
        "from utils.qat.model import checkpoint\n"
        f"m, info, ck = checkpoint.load_quantized(r'{path}')\n"
        f"x = torch.load(r'{tmp_path / 'x.pt'}')\n"
        "with torch.no_grad(): y = m(x)[0]\n"
        f"torch.save(y, r'{tmp_path / 'y.pt'}')\n"
        "print(ck['version'], info.config.method, len(info.scale_groups))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=yolov9_tree, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"max {len(info.scale_groups)}" in r.stdout
    got = torch.load(tmp_path / "y.pt")
    assert (got - expected).abs().max().item() == 0.0


def test_checkpoint_kind_errors(yolov9_tree, gelan_c, gelan_c_q, tmp_path):
    from utils.qat.model import checkpoint
    from utils.qat.core.errors import QATError
    qmodel, info = gelan_c_q
    qpath = checkpoint.save_quantized(tmp_path / "q.pt", qmodel, info)
    with pytest.raises(QATError, match="quantized .*floating-point"):
        checkpoint.load_fp(qpath)
    with pytest.raises(QATError, match="floating-point checkpoint"):
        checkpoint.load_quantized(gelan_c)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(QATError, match="not a PyTorch checkpoint"):
        checkpoint.read(tmp_path / "junk.pt")
    with pytest.raises(QATError, match="not found"):
        checkpoint.read(tmp_path / "missing.pt")


@pytest.mark.slow
def test_skip_layers_leave_no_qdq(gelan_c_fp, calib_images, tmp_path):
    import onnx

    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.onnx.onnx_export import export_onnx
    from utils.qat.onnx.onnx_lint import lint
    qmodel, info = quantize(gelan_c_fp, [calib_images[:2]], QuantConfig(method="max", skip=("22", "model.15.cv4*"), head_amax="calibrated"),
                            example=calib_images[:1])
    enabled = [n for n, q in _quantizers(qmodel).items() if q.is_enabled]
    assert not [n for n in enabled if n.startswith("model.22.") or n.startswith("model.15.cv4")]
    assert not [n for g in info.scale_groups for n in g if n.startswith("model.22.")]
    qmodel.names = gelan_c_fp.names
    out = tmp_path / "skip.onnx"
    export_onnx(qmodel, out, imgsz=(IMGSZ, IMGSZ), metadata={})
    graph = onnx.load(out).graph
    head_convs = [n for n in graph.node if n.op_type == "Conv" and "/model.22/" in n.name]
    producers = {o: n for n in graph.node for o in n.output}
    assert head_convs
    assert all(producers.get(n.input[1]) is None or producers[n.input[1]].op_type != "DequantizeLinear"
               for n in head_convs), "excluded head convs must keep FP weights"
    report = lint(out, allow_fp=["*dfl*", "*/model.22/*", "*/model.15/cv4/*"])
    assert report["total"] == 0, report["findings"]


@pytest.mark.slow
def test_onnx_scales_shared_and_ort_matches(gelan_c_q, val_images, tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    from utils.qat.onnx.onnx_export import export_onnx
    from utils.qat.onnx.onnx_lint import lint
    qmodel, _ = gelan_c_q
    out = tmp_path / "q.onnx"
    export_onnx(qmodel, out, imgsz=(IMGSZ, IMGSZ), batch_size=2, metadata={})
    model = onnx.load(out)
    assert lint(model)["total"] == 0
    consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    producers = {o: n for n in model.graph.node for o in n.output}
    checked = 0
    for node in model.graph.node:
        if node.op_type != "Concat" or not any(f"/model.{i}/" in node.name for i in (11, 14, 17, 20)):
            continue
        scales = [float(consts[producers[i].input[1]]) for i in node.input
                  if i in producers and producers[i].op_type == "DequantizeLinear"]
        if len(scales) >= 2:
            assert max(scales) - min(scales) <= 1e-7 * max(scales), node.name
            checked += 1
    assert checked >= 4  # the four head Concat layers
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: val_images.numpy()})[0]
    with torch.no_grad():
        ref = qmodel(val_images)[0].numpy()
    assert_int8_close(got, ref)


def test_finetune_updates_every_trainable_parameter(gelan_c_fp, gelan_c_q, calib_images):
    from utils.qat.quantize.model_quant import fuse
    from utils.qat.quantize.finetune import QATConfig, finetune
    qmodel, _ = gelan_c_q
    student = copy.deepcopy(qmodel)
    teacher = fuse(copy.deepcopy(gelan_c_fp))
    before = {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}
    frozen = [n for n, p in student.named_parameters() if not p.requires_grad]
    assert frozen == ["model.22.dfl.conv.weight"]
    small = torch.nn.functional.interpolate(calib_images[:1], size=64)
    results = finetune(student, teacher, lambda: [small], QATConfig(epochs=1, iters=1, lr=1e-3))
    assert len(results) == 1 and results[0].loss > 0
    unchanged = [n for n, p in student.named_parameters() if n in before and torch.equal(p, before[n])]
    assert not unchanged, f"no gradient reached: {unchanged[:5]}"


# modelopt's entropy search runs per quantizer in Python (about 1.5 s each on 2 CPU cores): a few convs only
MINI = {"nc": 2, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": 3,
        "backbone": [[-1, 1, "Conv", [8, 3, 2]], [-1, 1, "Conv", [16, 3, 2]], [-1, 1, "Conv", [16, 3, 2]]],
        "head": [[[2], 1, "DDetect", ["nc"]]]}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["max", "percentile", "mse", "entropy", "mse-image"])
def test_calibration_methods(yolov9_tree, shared, method):
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    model = build(MINI if method == "entropy" else TINY_GELAN)
    x = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 2, 64)
    qmodel, info = quantize(model, [x], QuantConfig(method=method, head_amax="calibrated"), example=x[:1])
    amax = [float(q.amax.max()) for n, q in _quantizers(qmodel).items() if q.is_enabled and "input" in n]
    assert all(np.isfinite(amax)) and min(amax) > 0
    with torch.no_grad():
        ref, out = model(x)[0], qmodel(x)[0]
    assert torch.corrcoef(torch.stack([ref.flatten(), out.flatten()]))[0, 1] > 0.9


def test_unknown_method_and_double_quantize(yolov9_tree):
    from utils.qat.quantize.model_quant import QuantConfig, prepare
    from utils.qat.core.errors import QATError
    model = build(TINY_GELAN)
    with pytest.raises(QATError, match="unknown calibration method"):
        QuantConfig(method="minmax")
    qmodel, info = prepare(model, QuantConfig(method="max", head_amax="calibrated"))
    assert info.scale_groups == [] and info.config.method == "max"  # groups come from calibration
    with pytest.raises(QATError, match="already quantized"):
        prepare(qmodel)


def test_skip_layer_errors(yolov9_tree):
    from utils.qat.quantize.model_quant import QuantConfig, prepare
    from utils.qat.core.errors import QATError
    model = build(TINY_GELAN)
    with pytest.raises(QATError, match="not a layer of this model"):
        prepare(model, QuantConfig(skip=("99",)))
    with pytest.raises(QATError, match="matches no module"):
        prepare(model, QuantConfig(skip=("model.7.nothing*",)))


def test_config_is_plain_data_without_modelopt(yolov9_tree):
    """The settings module imports neither modelopt nor torch (qat.py's parser needs it before CUDA may
    start), and the checkpoint record round-trips through its flat dict."""
    code = ("import sys; from utils.qat.quantize.config import QuantConfig, QuantInfo; "
            "info = QuantInfo(QuantConfig('percentile', 99.9, (' 22', '', 'model.1*')), ['model.22.'], [['a', 'b']]); "
            "assert info.config.skip == ('22', 'model.1*'); assert QuantInfo.from_dict(info.to_dict()) == info; "
            "print(sorted(m for m in ('modelopt', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=yolov9_tree, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def _per_conv_activation(name: str):
    """TINY_GELAN with a channel-dependent activation (FReLU, AconC) in every Conv: yamls cannot express it."""
    from models.common import Conv
    from utils import activations
    model = build(TINY_GELAN)
    for m in model.modules():
        if isinstance(m, Conv) and not isinstance(m.act, torch.nn.Identity):
            m.act = getattr(activations, name)(m.conv.out_channels)
    return model


ACTIVATIONS = {
    "SiLU": lambda: build(TINY_GELAN),
    "ReLU": lambda: build({**TINY_GELAN, "activation": "nn.ReLU()"}),
    "LeakyReLU": lambda: build({**TINY_GELAN, "activation": "nn.LeakyReLU(0.1)"}),
    "Mish": lambda: build({**TINY_GELAN, "activation": "nn.Mish()"}),
    "FReLU": lambda: _per_conv_activation("FReLU"),
    "AconC": lambda: _per_conv_activation("AconC"),
}


@pytest.mark.slow
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_activation_variants_quantize_and_export(yolov9_tree, shared, act, tmp_path):
    import onnxruntime as ort

    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.onnx.onnx_export import export_onnx
    from utils.qat.onnx.onnx_lint import lint
    torch.manual_seed(0)  # a randomly initialised model: the same one whatever ran before
    model = ACTIVATIONS[act]()
    x = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 2, 64)
    qmodel, info = quantize(model, [x], QuantConfig(method="max", head_amax="calibrated"), example=x[:1])
    if act == "FReLU":  # FReLU's own depthwise conv is quantized too
        assert any(n.endswith("act.conv") and m.weight_quantizer.is_enabled for n, m in qmodel.named_modules()
                   if hasattr(m, "weight_quantizer"))
    out = tmp_path / f"{act}.onnx"
    export_onnx(qmodel, out, imgsz=(64, 64), batch_size=2, metadata={})
    report = lint(out)
    assert report["total"] == 0, report["findings"]
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        ref = qmodel(x)[0].numpy()
    assert_int8_close(got, ref)


# One model per set of modules (Q/DQ placement and shared scales follow the modules, derived from the graph):
# gelan-s has gelan-t's modules (ELAN1, AConv, RepNCSPELAN4, SPPELAN) with other widths, gelan-m a subset of them,
# so both are left out; gelan-c brings ADown, gelan-e CBLinear / CBFuse, yolov9-c / -e the dual heads.
SIZES = [pytest.param("gelan-t", marks=pytest.mark.models), "gelan-c", "gelan-e", "yolov9-c", "yolov9-e"]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SIZES)
def test_lint_clean_on_every_size(yolov9_tree, shared, cfg, tmp_path):
    """Zero TensorRT fusion blockers in the toolkit's own exports, dual heads included."""
    from conftest import ELSEWHERE, tree_has
    if cfg.endswith(("-t", "-s")) and not tree_has(yolov9_tree, "ELAN1"):
        pytest.skip(f"{cfg} needs ELAN1 from upstream models/common.py, which this YOLOv9 tree lacks; {ELSEWHERE}")
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.onnx.onnx_export import export_onnx
    from utils.qat.onnx.onnx_lint import lint
    model = build(yolov9_tree / "models" / "detect" / f"{cfg}.yaml", nc=80)
    x = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 1, 64)
    qmodel, info = quantize(model, [x], QuantConfig(method="max", head_amax="calibrated"), example=x)
    out = tmp_path / f"{cfg}.onnx"
    export_onnx(qmodel, out, imgsz=(64, 64), metadata={})
    report = lint(out)
    assert report["total"] == 0, json.dumps(report["findings"])[:2000]
    assert report["stats"]["quantized_conv"] >= report["stats"]["conv"] - 2  # only DFL convs stay FP


def test_fused_copy_folds_on_the_device_given(gelan_c_fp):
    """The quantized model and the QAT teacher are folded where they will run, whatever device the FP model is on
    (evaluating it first moves it to the GPU; a GPU's fold differs from the CPU's in the last bit of some weights,
    and GELAN-C's calibration moved with them); the FP model itself is left as it was. The GPU half runs where
    there is one."""
    from models.common import Conv
    from utils.qat.quantize.model_quant import fused_copy
    fused = fused_copy(gelan_c_fp, "cpu")
    assert not any(hasattr(m, "bn") for m in fused.modules() if isinstance(m, Conv))
    assert all(hasattr(m, "bn") for m in gelan_c_fp.modules() if isinstance(m, Conv))
    if torch.cuda.is_available():
        from_cpu = fused_copy(gelan_c_fp, "cuda:0").state_dict()
        from_gpu = fused_copy(copy.deepcopy(gelan_c_fp).to("cuda:0"), "cuda:0").state_dict()
        assert all(t.is_cuda for t in from_cpu.values())
        assert all(torch.equal(from_cpu[k], from_gpu[k]) for k in from_cpu)


def test_mse_amax_minimises_quantization_error(yolov9_tree):
    """modelopt 0.47's own MSE search is broken (returns its first candidate); ours finds the minimum."""
    from utils.qat.quantize.mse import mse_amax
    rng = np.random.default_rng(0)
    x = np.abs(np.concatenate([rng.normal(0, 1, 200_000), rng.normal(0, 8, 200)]))
    hist, edges = np.histogram(x, bins=2048, range=(0, x.max()))
    amax = float(mse_amax(hist, edges))
    centers = (edges[1:] + edges[:-1]) / 2

    def err(a):
        scale = a / 127
        return float((((np.clip(np.round(centers / scale), 0, 127) * scale) - centers) ** 2 * hist).sum())

    brute = min(centers[128:], key=err)
    assert abs(amax - brute) <= (edges[1] - edges[0]) + 1e-6
    assert centers[128] < amax < x.max() * 0.9  # neither the first candidate nor the plain max


def test_group_mse_amax_minimises_the_summed_error(yolov9_tree):
    """``--tie mse``: one histogram gives ``mse_amax``'s value; for a group, the candidate with the least error summed
    over the members' own histograms (brute force over the widest one's bin centres), which clips the wide member
    below where its own search would and stays above the narrow member's."""
    from utils.qat.quantize.mse import group_mse_amax, mse_amax
    rng = np.random.default_rng(1)
    narrow, wide = np.abs(rng.normal(0, 1, 100_000)), np.abs(rng.normal(0, 6, 20_000))
    hists = [np.histogram(x, bins=2048, range=(0, x.max())) for x in (narrow, wide)]
    assert float(group_mse_amax([hists[0]])) == float(mse_amax(*hists[0]))
    amax = float(group_mse_amax(hists))
    centers = [(e[1:] + e[:-1]) / 2 for _, e in hists]

    def err(a):
        scale = a / 127
        return sum(float((((np.clip(np.round(c / scale), 0, 127) * scale) - c) ** 2 * h).sum())
                   for (h, _), c in zip(hists, centers))

    brute = min(centers[1][128:], key=err)
    assert abs(amax - brute) <= (hists[1][1][1] - hists[1][1][0]) + 1e-6
    assert float(mse_amax(*hists[0])) < amax < float(mse_amax(*hists[1]))


@pytest.mark.slow
def test_tie_mse_gives_each_group_one_scale_from_its_histograms(gelan_c_fp, calib_images):
    """``QuantConfig(tie="mse")``: every shared-scale group still carries one amax, now at most the group's largest
    (the ``max`` tie's), and below it for some groups; the record says which tie made it."""
    from utils.qat.quantize.config import QuantInfo
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    batches = [calib_images[:2], calib_images[2:]]
    runs = {tie: quantize(gelan_c_fp, batches, QuantConfig(method="mse", head_amax="calibrated", tie=tie),
                          example=calib_images[:1]) for tie in ("max", "mse")}
    (qmax, info), (qmse, _) = runs["max"], runs["mse"]
    by_max, by_mse = _quantizers(qmax), _quantizers(qmse)
    lower = 0
    for group in info.scale_groups:
        values = {float(by_mse[n].amax) for n in group}
        assert len(values) == 1, group
        shared, largest = values.pop(), float(by_max[group[0]].amax)
        assert shared <= largest * 1.001, group
        lower += shared < largest * 0.999
    assert lower > 0
    assert QuantInfo.from_dict(runs["mse"][1].to_dict()).config.tie == "mse"
    assert QuantInfo.from_dict({"calib_method": "mse"}).config.tie == "max"  # checkpoints from before the option


@pytest.mark.slow
def test_pool_scale_own_stops_averages_landing_on_rounding_ties(gelan_c_fp, calib_images):
    """``QuantConfig(pool_scale="own")``: each ADown's average pool output gets its own calibrated amax (the chunk
    after it still shares one), where ``shared`` ties it to the pool's input; with shared scales a large share of
    the averages of INT8 values sit exactly on a rounding tie of the next quantizer, with their own scale almost
    none. The setting travels in the checkpoint's record; older records read as ``shared``."""
    import torch.nn.functional as F

    from utils.qat.core.errors import QATError
    from utils.qat.quantize.config import QuantInfo
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    runs = {mode: quantize(gelan_c_fp, [calib_images], QuantConfig(method="max", head_amax="calibrated",
                                                                   pool_scale=mode), example=calib_images[:1])
            for mode in ("shared", "own")}
    ties = {}
    for mode, (qmodel, info) in runs.items():
        pools = [m for m in qmodel.modules() if type(m).__name__ == "QuantADown"]
        assert len(pools) == 5
        seen = []
        hooks = [m.avgpool_input_quantizer.register_forward_hook(lambda m, i, o: seen.append(o)) for m in pools]
        with torch.no_grad():
            qmodel.eval()(calib_images[:1])
        for h in hooks:
            h.remove()
        fractions = []
        for m, x in zip(pools, seen):
            s_in, s_out = float(m.avgpool_input_quantizer.amax) / 127, float(m.cv1.conv.input_quantizer.amax) / 127
            assert float(m.maxpool_input_quantizer.amax) == s_out * 127  # the two halves of the pool's output
            assert (s_in == s_out) == (mode == "shared")
            codes = F.avg_pool2d(torch.round(x.double() / s_in), 2, 1, 0, False, True) * s_in / s_out
            fractions.append(float(((codes - torch.floor(codes)) == 0.5).double().mean()))
        ties[mode] = fractions
        assert QuantInfo.from_dict(info.to_dict()).config.pool_scale == mode
    assert min(ties["shared"]) > 0.1 and max(ties["own"]) < 0.01, ties
    assert QuantInfo.from_dict({"calib_method": "max"}).config.pool_scale == "shared"
    with pytest.raises(QATError, match="unknown --pool-scale 'mine'; choose one of shared, own"):
        QuantConfig(pool_scale="mine")


def test_mse_amax_on_a_grown_histogram(yolov9_tree):
    """modelopt grows a histogram with torch.arange, which can leave one bin edge more than there are bins
    (found calibrating the embedded segmentation model); the MSE search takes histc's own edges then."""
    from modelopt.torch.quantization.calib import HistogramCalibrator

    from utils.qat.quantize.mse import mse_amax
    g = torch.Generator().manual_seed(0)
    for _ in range(3000):  # the 1502nd pair of batches below shows it with this seed
        c = HistogramCalibrator(num_bits=8, axis=None, unsigned=False)
        c.collect(torch.rand(100, generator=g))
        c.collect(torch.rand(100, generator=g) * (1 + torch.rand(1, generator=g).item() * 5))
        if len(c._calib_bin_edges) != len(c._calib_hist) + 1:
            break
    else:
        pytest.fail("no grown histogram with a spare edge: modelopt's histogram growth changed")
    amax = float(mse_amax(c._calib_hist, c._calib_bin_edges))
    assert 0 < amax <= float(c._calib_bin_edges[-1])


def test_mse_image_weighs_every_image_alike(yolov9_tree):
    """``mse-image``: on images of one scale it finds the pooled MSE clipping value; when one image of 16 runs 100x
    above the rest (as on GELAN-QS-seg, docs/QAT_FINETUNING.md "GELAN-C run to run, and what limits GELAN-QS-seg"), the pooled search hands that image the scale,
    the image-weighted one stays many times below it."""
    from modelopt.torch.quantization.calib import HistogramCalibrator
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from utils.qat.quantize.mse import mse_amax
    from utils.qat.quantize.image_hist import ImageHistograms

    def pooled(x):
        c = HistogramCalibrator(num_bits=8, axis=None, unsigned=False)
        c.collect(x)
        return float(mse_amax(c._calib_hist, c._calib_bin_edges))

    def image_weighted(x):
        q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, axis=None))
        q.disable()  # passes its input through, as calibration runs it
        hists = ImageHistograms([q])
        q(x[:8]), q(x[8:])  # two batches add up
        hists.close()
        return float(hists.amax(q))

    batch = torch.randn(16, 8, 32, 32, generator=torch.Generator().manual_seed(0))
    assert image_weighted(batch) == pytest.approx(pooled(batch), rel=0.1)
    clean = pooled(batch[1:])
    batch[0] *= 100
    assert pooled(batch) > 50 * clean
    assert image_weighted(batch) < pooled(batch) / 4


SEG_CFGS = ["gelan-c-seg", pytest.param("gelan-c-dseg", marks=pytest.mark.models),
            pytest.param("yolov9-c-dseg", marks=pytest.mark.models)]


@pytest.mark.slow
@pytest.mark.parametrize("cfg", SEG_CFGS)
def test_lint_clean_on_segmentation_models(yolov9_tree, shared, cfg, tmp_path):
    """Segmentation heads (Segment's Proto branch with its Upsample, DualDSegment's two proto convs) get
    quantizers where TensorRT needs them: zero lint findings, output0 + output1 in the graph."""
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.core import yolov9
    from utils.qat.onnx.onnx_export import export_onnx
    from utils.qat.onnx.onnx_lint import lint
    yaml_path = yolov9_tree / "models" / "segment" / f"{cfg}.yaml"
    if "dseg" in cfg and "class DualDSegment(" not in (yolov9_tree / "models" / "yolo.py").read_text():
        from conftest import ELSEWHERE
        pytest.skip(f"{cfg} needs DualDSegment from upstream models/yolo.py, which this YOLOv9 tree lacks; {ELSEWHERE}")
    model = yolov9.build(yaml_path, 80, task="segment")
    model.names = {i: str(i) for i in range(80)}
    reinit(model)
    x = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 1, 64)
    qmodel, info = quantize(model, [x], QuantConfig(method="max", head_amax="calibrated"), example=x)
    out = tmp_path / f"{cfg}.onnx"
    export_onnx(qmodel, out, imgsz=(64, 64), task="segment", metadata={})
    report = lint(out)
    assert report["total"] == 0, json.dumps(report["findings"])[:2000]
    assert report["stats"]["quantized_conv"] >= report["stats"]["conv"] - 2  # only DFL convs stay FP
    import onnx
    assert [o.name for o in onnx.load(str(out)).graph.output] == ["output0", "output1"]
    from utils.qat.evaluation.backends import TorchBackend
    pred, protos = TorchBackend(qmodel, torch.device("cpu"), task="segment")(x)  # what the evaluator reads
    assert pred.shape[:2] == (1, 4 + 80 + 32) and protos.shape == (1, 32, 16, 16)
