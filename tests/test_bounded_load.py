"""Nothing a file states is allocated before it is checked against what the file holds (utils/qat/model/bounds.py,
structure.py, safe_load.py's records and spans, artifact.py's sizes, evaluation/label_cache.py).

Every lie is made from a genuine quantized checkpoint (the tiny GELAN with a class branch narrower than its yaml, so
its structure record is applied), one field changed as an attacker would; each must end in one sentence before the
model is built. The commands are run under an address-space limit that a lie would exceed many times over.
"""
from __future__ import annotations

import copy
import os
import resource
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from conftest import REPO
from helpers import TINY_GELAN, build, narrow_class_branch, quantized_checkpoint, real_images

IMGSZ = 64
LAYER = "model.22.cv3.0.0.conv"  # a 3x3 convolution the structure record changes (8 wide where the yaml builds 48)
GIB = 1 << 30


@pytest.fixture(scope="module")
def genuine(yolov9_tree, shared, tmp_path_factory):
    images = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 2, IMGSZ)
    path = tmp_path_factory.mktemp("genuine") / "q.pt"
    quantized_checkpoint(narrow_class_branch(build(TINY_GELAN)), images, path)
    return path


def _modes(ckpt):
    return [state["metadata"]["quantizer_state"] for _mode, state in ckpt["modelopt_state"]["modelopt_state_dict"]]


def _inflate(ckpt):  # 10^5 x 10^5 x 3 x 3 floats: 360 GB
    ckpt["structure"][LAYER].update(out_channels=10 ** 5, in_channels=10 ** 5)


def _zero_strides(ckpt):  # the weight the inflated record asks for, "stored" in 4 bytes
    w = ckpt["state_dict"][f"{LAYER}.weight"]
    ckpt["structure"][LAYER].update(out_channels=10 ** 7)
    ckpt["state_dict"][f"{LAYER}.weight"] = torch.zeros(1).expand(10 ** 7, *w.shape[1:])


def _amax(ckpt):  # a quantizer buffer modelopt makes with torch.empty(shape) before any weight is read
    for quantizers in _modes(ckpt):
        quantizers["model.0.conv.input_quantizer"]["_pytorch_state_metadata"] = {
            "params": {}, "buffers": {"_amax": {"shape": torch.Size([10 ** 6, 10 ** 5]), "dtype": torch.float32}}}


def _block_sizes(ckpt):
    for quantizers in _modes(ckpt):
        quantizers["model.0.conv.input_quantizer"]["_block_sizes"] = {-1: 10 ** 9}


def _wide_yaml(ckpt):
    ckpt["yaml"] = {**ckpt["yaml"], "width_multiple": 300.0}


LIES = {  # name -> (change, the sentence's words)
    "larger": (_inflate, f"records a Conv2d at {LAYER} whose weight would have shape (100000, 100000, 3, 3), but the "
                         "file stores one of shape (8, 48, 3, 3)"),
    "smaller": (lambda c: c["structure"][LAYER].update(out_channels=2),
                f"records a Conv2d at {LAYER} whose weight would have shape (2, 48, 3, 3)"),
    "kind": (lambda c: c["structure"][LAYER].update(type="ConvTranspose2d", output_padding=(0, 0)),
             f"records a ConvTranspose2d at {LAYER} where its yaml builds a Conv2d"),
    "groups": (lambda c: c["structure"][LAYER].update(groups=48, in_channels=48 * 48),
               f"records a Conv2d at {LAYER} that cannot be made (out_channels must be divisible by groups)"),
    "geometry": (lambda c: c["structure"][LAYER].update(padding=(10 ** 6, 10 ** 6)),
                 f"records a Conv2d at {LAYER} with padding (1000000, 1000000) where its yaml builds (1, 1)"),
    "zero strides": (_zero_strides, "holds a tensor of shape (10000000, 48, 3, 3) built from 4 stored bytes"),
    "quantizer buffer": (_amax, "its modelopt state gives model.0.conv.input_quantizer._amax the shape "
                                "(1000000, 100000) where the file stores ()"),
    "block quantizer": (_block_sizes, "its modelopt state gives model.0.conv.input_quantizer block_sizes"),
    "yaml width": (_wide_yaml, "its model yaml builds"),
    "classes": (lambda c: c.update(nc=10 ** 7), "its model yaml builds"),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_lie_is_one_sentence_before_anything_is_built(genuine, tmp_path, lie):
    from utils.qat.core.errors import QATError
    from utils.qat.model import checkpoint
    change, words = LIES[lie]
    ckpt = copy.deepcopy(torch.load(genuine, weights_only=True))
    change(ckpt)
    path = tmp_path / "lie.pt"
    torch.save(ckpt, path)
    with pytest.raises(QATError) as e:
        checkpoint.load_quantized(path)
    assert str(e.value).startswith(str(path)) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_the_genuine_checkpoint_loads_as_before(genuine):
    from utils.qat.model import bounds, checkpoint
    model, _info, ckpt = checkpoint.load_quantized(genuine)
    assert model.model[22].cv3[0][0].conv.out_channels == 8
    stored = bounds.stored_elements(ckpt["state_dict"])
    assert stored < bounds.yaml_elements(ckpt["yaml"], ckpt["nc"]) <= bounds.YAML_FACTOR * stored  # narrower than its yaml


def test_a_compressed_record_is_refused(genuine, tmp_path):
    """A record a zip stores compressed could unpack to far more than the file's size: torch.save never writes one."""
    from utils.qat.core.errors import QATError
    from utils.qat.model import safe_load
    packed = tmp_path / "packed.pt"
    with zipfile.ZipFile(genuine) as src, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    with pytest.raises(QATError, match=r"packed.pt was not loaded: its record .* is compressed, which torch.save never"):
        safe_load.load(packed)


# Runs the CLI script named by the first argument as `python3 SCRIPT ARGS...` would, and prints the process's own
# peak resident memory when it exits (its sys.exit included).
PEAK_REPORTED = ("import atexit, resource, runpy, sys; atexit.register(lambda: sys.stderr.write("
                 "f'peak-rss-kib {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}\\n')); sys.argv = sys.argv[1:]; "
                 "sys.path.insert(0, '.'); runpy.run_path(sys.argv[0], run_name='__main__')")


def _limited(limit: int):
    """A child process's address space capped at ``limit`` bytes (what it maps, not only what it touches)."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    return cap


@pytest.mark.slow
def test_commands_refuse_an_inflated_record_under_a_memory_limit(yolov9_tree, genuine, shapes, tmp_path):
    """Every command that loads a quantized checkpoint, run as users run it under a 12 GiB address-space limit (the
    lie asks for 360 GB): one 'error:' sentence, exit 2, a peak far below the limit, nothing written."""
    ckpt = torch.load(genuine, weights_only=True)
    _inflate(ckpt)
    lie = tmp_path / "lie.pt"
    torch.save(ckpt, lie)
    before = set(tmp_path.rglob("*"))
    commands = {
        "qat.py eval": ["qat.py", "eval", "--weights", str(lie), "--data", str(shapes), "--device", "cpu",
                        "--project", str(tmp_path / "runs")],
        "export_qat.py": ["export_qat.py", "--weights", str(lie), "--include", "onnx", "--device", "cpu"],
        "export_yoloV9.py": ["export_yoloV9.py", "--weights", str(lie)],
    }
    for name, args in commands.items():
        r = subprocess.run([sys.executable, "-c", PEAK_REPORTED, *args], cwd=yolov9_tree, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                           preexec_fn=_limited(12 * GIB))
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1, (name, r.returncode, r.stderr[-2000:])
        assert f"records a Conv2d at {LAYER} whose weight would have shape (100000, 100000, 3, 3)" in errors[0], name
        assert "Traceback" not in r.stderr, name
        peak = int(r.stderr.rsplit("peak-rss-kib ", 1)[1].split()[0]) * 1024  # the command's own high-water mark
        assert peak < 3 * GIB, (name, peak)
    assert set(tmp_path.rglob("*")) == before  # no run folder, no ONNX beside the checkpoint


def test_label_caches_are_read_as_data(yolov9_tree, shapes, tmp_path):
    """Upstream reads labels.cache with np.load(allow_pickle=True): a cache that would run code is not read (the
    labels are scanned again and the cache written anew), and a genuine one is read as it always was."""
    from utils.qat.evaluation import label_cache
    from utils.qat.evaluation.data import dataloader, load_data_yaml
    data = load_data_yaml(shapes, ("val",))
    _loader, dataset = dataloader(data, "val", 256, 4, 32, workers=0)
    cache = next(shapes.parent.rglob("val.cache"))
    genuine = np.load(cache, allow_pickle=True).item()
    assert label_cache.load(cache).item().keys() == genuine.keys()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    with open(cache, "wb") as f:
        np.save(f, np.array(Payload(), dtype=object), allow_pickle=True)
    with pytest.raises(label_cache.RefusedCache, match="posix.system"):
        label_cache.load(cache)
    _loader, again = dataloader(data, "val", 256, 4, 32, workers=0)
    assert not marker.exists()
    assert len(again) == len(dataset) and [len(x) for x in again.labels] == [len(x) for x in dataset.labels]
    assert label_cache.load(cache).item()["hash"] == genuine["hash"]  # written anew, genuine again


def test_graph_sizes_are_bounded(tmp_path):
    """A graph whose fixed batch or input size would make the evaluator allocate beyond reason, or whose stride
    would round every input up to it, is refused or ignored before any image is read."""
    import onnx
    from onnx import TensorProto, helper

    from utils.qat.core.artifact import parse_stride
    from utils.qat.core.errors import QATError
    from utils.qat.evaluation.backends import ORTBackend
    for shape, words in (([10 ** 6, 3, 64, 64], "states a fixed batch of 1000000"),
                         ([1, 3, 10 ** 6, 64], "states a fixed input of 1000000x64 pixels")):
        graph = helper.make_graph([helper.make_node("Identity", ["images"], ["output0"])], "g",
                                  [helper.make_tensor_value_info("images", TensorProto.FLOAT, shape)],
                                  [helper.make_tensor_value_info("output0", TensorProto.FLOAT, shape)])
        path = tmp_path / "big.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        with pytest.raises(QATError, match=words):
            ORTBackend(path)
    assert [parse_stride(v) for v in ("32", 64.0, "[8, 16, 32]", "1e300", 2 ** 40, 48, 0)] == [32, 64, 32, None, None,
                                                                                              None, None]



def test_an_fp_checkpoint_with_an_inflated_geometry_is_refused(yolov9_tree, tmp_path):
    """An FP checkpoint pickles whole modules: a convolution's padding of a million pixels would size every
    activation through it at the first image, so it is refused when the model is loaded."""
    from utils.qat.core.errors import QATError
    from utils.qat.model import checkpoint
    ckpt = torch.load(REPO / "weights" / "gelan-qs-shapes.pt", map_location="cpu", weights_only=False)  # ours
    ckpt["model"].model[0].conv.padding = (10 ** 6, 10 ** 6)
    torch.save(ckpt, tmp_path / "wide.pt")
    with pytest.raises(QATError, match=r"wide.pt was not loaded: its Conv2d at model.0.conv has padding "
                                       r"\(1000000, 1000000\) \(at most 64 is accepted\)"):
        checkpoint.load_fp(tmp_path / "wide.pt")
    checkpoint.load_fp(REPO / "weights" / "gelan-qs-shapes.pt")  # the genuine one loads
