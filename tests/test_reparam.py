"""reparameterization.py: YOLOv9 training checkpoints (auxiliary branch) -> GELAN inference models.

Proof of correctness: for one size per layer-map family (t, c, e; the maps of every size are checked against
upstream's notebook), a yolov9-X model with random weights
(Kaiming convs, BatchNorm statistics measured on the very photos used for the comparison, so
activations are O(1) throughout instead of vanishing or exploding) is saved the way upstream
training saves it, converted by running the CLI, loaded back with upstream ``attempt_load``, and
its output on real COCO photos must equal the main-branch output of the training model (max abs
difference < 1e-4 in FP32), while differing from the auxiliary branch's.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess

import pytest
import torch
import torch.nn as nn
import yaml
from conftest import ELSEWHERE, cli_error, run_tool, tree_has
from helpers import (UPSTREAM_LOADS_PICKLES, TINY_GELAN, build, real_images, reinit, upstream_config_dir,
                     upstream_loads_pickles)

IMGSZ = {"t": 256, "s": 256, "m": 256, "c": 256, "e": 192}  # yolov9-e is large for a CPU run
N_IMAGES = {"e": 1}  # default 2
# The end-to-end proof runs on one size per layer-map family of upstream's reparameterization notebook: t (t/s:
# same index, ELAN1 blocks), c (m/c: +1 after Silence; the size the other tests convert) and e (its own split map).
# s and m differ from t and c only in widths (and m in AConv for ADown, both plain convs to the map); their maps
# are checked against the notebook for every size by test_derived_layer_map_agrees_with_upstream_notebook.
CONVERTED_SIZES = [pytest.param("t", marks=pytest.mark.models), "c", "e"]
TOL = 1e-4


def needs(tree: Path, size: str) -> None:
    if size in ("t", "s") and not tree_has(tree, "ELAN1"):
        pytest.skip(f"yolov9-{size} needs ELAN1 from upstream models/common.py, which this YOLOv9 tree lacks; "
                    + ELSEWHERE)


def photos(shared: Path, n: int, size: int) -> torch.Tensor:
    return real_images(shared / "datasets" / "coco334" / "images" / "val2017", n, size)


@torch.no_grad()
def calibrate_bn(model: nn.Module, images: torch.Tensor) -> nn.Module:
    """Give every BatchNorm the statistics of its input on ``images``: eval mode then equals train mode there."""
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    count: dict[nn.Module, int] = {}
    hooks = [bn.register_forward_pre_hook(lambda m, inp: count.__setitem__(m, inp[0].numel() // inp[0].shape[1]))
             for bn in bns]
    momentum = {bn: bn.momentum for bn in bns}
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average: one batch -> exactly its statistics
    try:
        model.train()
        model(images)
    finally:
        for h in hooks:
            h.remove()
        for bn in bns:
            bn.momentum = momentum[bn]
    for bn in bns:
        bn.running_var.mul_((count[bn] - 1) / count[bn])  # torch keeps the unbiased variance, train mode uses biased
    return model.eval()


def training_model(tree: Path, cfg: str, images: torch.Tensor, nc: int | None = None, seed: int = 0) -> nn.Module:
    if "segment" in cfg:
        from utils.qat.core import yolov9
        model = reinit(yolov9.build(tree / cfg, nc, task="segment"), seed)
        model.names = {i: f"class{i}" for i in range(model.yaml["nc"])}
    else:
        model = build(tree / cfg, nc=nc, seed=seed)
    return calibrate_bn(model, images)


def save_training_checkpoint(path: Path, model: nn.Module, ema: nn.Module | None = None) -> Path:
    """As upstream train_dual.py writes it: FP16 copies of the model (and EMA) beside the training state.

    Without ``ema`` the file looks like a finished run's best.pt (strip_optimizer: EMA moved into 'model').
    """
    torch.save({"epoch": -1 if ema is None else 3, "best_fitness": None, "model": copy.deepcopy(model).half(),
                "ema": None if ema is None else copy.deepcopy(ema).half(), "updates": None if ema is None else 40,
                "optimizer": None, "opt": {"cfg": "yolov9.yaml", "epochs": 4}, "git": None, "date": None}, path)
    return path


def load_training(path: Path) -> nn.Module:
    """The model upstream evaluates from a training checkpoint: the EMA when present, FP32."""
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return (ckpt.get("ema") or ckpt["model"]).float().eval()


def load_converted(path: Path, fuse: bool = False) -> nn.Module:
    from models.experimental import attempt_load
    with upstream_loads_pickles():
        return attempt_load(str(path), device="cpu", fuse=fuse)


def convert(tree: Path, *args: str) -> CompletedProcess:
    return run_tool(tree, "reparameterization.py", *args, timeout=1200)


def ok(r: CompletedProcess) -> str:
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def refused(tree: Path, *args: str) -> str:
    """The sentence reparameterization.py stops with (its main in this process; run_cli prints it, exit 2)."""
    return cli_error(tree, "reparameterization.py", *args)


def fails(err: str, *phrases: str) -> str:
    for phrase in phrases:
        assert phrase in err, err
    return err


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def n_layers(cfg: Path) -> int:
    d = yaml.safe_load(cfg.read_text())
    return len(d["backbone"]) + len(d["head"])


@dataclass
class Conversion:
    weights: Path
    out: Path
    result: CompletedProcess
    images: torch.Tensor


@pytest.fixture(scope="session")
def converted(yolov9_tree, shared, tmp_path_factory):
    """size -> a random yolov9-{size} best.pt and its conversion by the CLI (each made once per session)."""
    cache: dict[str, Conversion] = {}

    def get(size: str) -> Conversion:
        needs(yolov9_tree, size)
        if size not in cache:
            root = tmp_path_factory.mktemp(f"reparam-{size}")
            images = photos(shared, N_IMAGES.get(size, 2), IMGSZ[size])
            model = training_model(yolov9_tree, f"models/detect/yolov9-{size}.yaml", images)
            weights = save_training_checkpoint(root / "best.pt", model)
            del model
            out = root / f"yolov9-{size}-converted.pt"
            result = convert(yolov9_tree, "--model", size, "--weights", str(weights), "--save", str(out))
            cache[size] = Conversion(weights, out, result, images)
        return cache[size]

    return get


# ---------------------------------------------------------------------------------------------
# The proof: converted output == main branch output, for every size

@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("size", CONVERTED_SIZES)
def test_converted_model_reproduces_the_main_branch(yolov9_tree, converted, size):
    conv = converted(size)
    out = ok(conv.result)
    assert f"checkpoint structure: models/detect/yolov9-{size}.yaml" in out, out
    assert "output matches the checkpoint's main branch" in out and f"saved {conv.out}" in out, out

    dual = load_training(conv.weights)
    model = load_converted(conv.out)
    assert type(dual.model[-1]).__name__ == "DualDDetect"
    assert type(model.model[-1]).__name__ == "DDetect"
    assert len(model.model) == n_layers(yolov9_tree / "models" / "detect" / f"gelan-{size}.yaml")
    with torch.no_grad():
        (aux, main), (raw_aux, raw_main) = dual(conv.images)
        y, raw = model(conv.images)
    assert max_diff(y, main) < TOL
    for a, b in zip(raw, raw_main):  # per-level box distributions and class logits, before decoding
        assert max_diff(a, b) < TOL
    # The comparison has teeth: the outputs depend on the photo and the auxiliary head differs.
    assert main[:, 4:].std() > 0.05, "class scores collapsed: the random model is degenerate"
    assert max_diff(y, aux) > 1.0
    assert max(a.std().item() for a in raw_main) > 0.1

    # Upstream checkpoint format, FP16, names and class count kept.
    ckpt = torch.load(conv.out, map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == -1 and ckpt["ema"] is None and ckpt["optimizer"] is None
    saved = ckpt["model"]
    assert {p.dtype for p in saved.parameters()} == {torch.float16}
    assert saved.nc == 80 and saved.names == dual.names
    assert saved.stride.tolist() == dual.stride.tolist()

    # What val.py / detect.py do: attempt_load with Conv+BN fusion. Same predictions up to the rounding
    # of the fused weights (on average: deep random models amplify it at a few anchors; a wrong mapping
    # would differ by the order of the outputs everywhere).
    fused = load_converted(conv.out, fuse=True)
    with torch.no_grad():
        yf = fused(conv.images)[0]
    assert yf.shape == main.shape and torch.isfinite(yf).all()
    assert (yf - main).abs().mean() < 1e-2 * main.abs().mean()


def _meta_model(tree: Path, cfg: str) -> nn.Module:
    from models.yolo import parse_model
    d = yaml.safe_load((tree / cfg).read_text())
    with torch.device("meta"):
        layers, _ = parse_model(copy.deepcopy(d), ch=[3])
    holder = nn.Module()
    holder.model = layers
    return holder


@pytest.mark.parametrize("size", [*(pytest.param(s, marks=pytest.mark.models) for s in "ts"), "m", "c", "e"])
def test_derived_layer_map_agrees_with_upstream_notebook(yolov9_tree, size):
    """The graph-derived map equals what upstream's tools/reparameterization.ipynb hard-codes per size."""
    needs(yolov9_tree, size)
    from utils.qat.model.reparam import build_layer_map, build_state_map
    dual = _meta_model(yolov9_tree, f"models/detect/yolov9-{size}.yaml")
    gelan = _meta_model(yolov9_tree, f"models/detect/gelan-{size}.yaml")
    got = build_layer_map(dual, gelan)
    head = len(gelan.model) - 1
    # the notebook's tables: t/s same index, m/c index+1 (Silence), e: 0..28 same, 29..41 +7; heads 29/38/49
    if size in "ts":
        want = {g: g for g in range(head)} | {head: 29}
    elif size in "mc":
        want = {g: g + 1 for g in range(head)} | {head: 38}
    else:
        want = {g: g if g < 29 else g + 7 for g in range(head)} | {head: 49}
    assert got == want
    keys = build_state_map(dual, gelan)
    assert keys[f"model.{head}.cv2.0.0.conv.weight"] == f"model.{want[head]}.cv4.0.0.conv.weight"
    assert keys[f"model.{head}.cv3.2.2.bias"] == f"model.{want[head]}.cv5.2.2.bias"
    assert keys[f"model.{head}.dfl.conv.weight"] == f"model.{want[head]}.dfl2.conv.weight"
    assert set(keys) == set(gelan.state_dict())


# ---------------------------------------------------------------------------------------------
# Other structures and checkpoint layouts

@pytest.mark.slow
@pytest.mark.e2e
def test_last_pt_with_ema_custom_classes_and_all_flags(yolov9_tree, shared, tmp_path):
    """A mid-training last.pt (model + EMA), 20 classes: the EMA is converted, the class count is the checkpoint's."""
    images = photos(shared, 2, 256)
    ema = training_model(yolov9_tree, "models/detect/yolov9-c.yaml", images, nc=20, seed=0)
    raw = training_model(yolov9_tree, "models/detect/yolov9-c.yaml", images, nc=20, seed=1)
    weights = save_training_checkpoint(tmp_path / "last.pt", raw, ema=ema)
    del ema, raw
    out = tmp_path / "out" / "c20.pt"
    r = convert(yolov9_tree, "--cfg", "models/detect/gelan-c.yaml", "--weights", str(weights), "--model", "c",
                "--device", "cpu", "--classes_num", "80", "--save", str(out))
    log = ok(r)
    assert "notice: --classes_num 80 is ignored: the checkpoint's head predicts 20 classes" in log, log
    model = load_converted(out)
    assert model.nc == 20 and len(model.names) == 20 and model.model[-1].nc == 20
    ckpt = torch.load(weights, map_location="cpu", weights_only=False)
    with torch.no_grad():
        y = model(images)[0]
        want = ckpt["ema"].float().eval()(images)[0][1]
        other = ckpt["model"].float().eval()(images)[0][1]
    assert max_diff(y, want) < TOL
    assert max_diff(y, other) > 1.0


def tiny_dual(gelan: dict) -> dict:
    """A YOLOv9-style training yaml around ``gelan``: Silence, the GELAN as main branch, a CBLinear/CBFuse
    auxiliary branch (as in yolov9-c) and DualDDetect. Matches no upstream size."""
    shift = [[-1, 1, "Silence", []]]
    main = [[f if isinstance(f, int) else [x if x == -1 else x + 1 for x in f], n, m, a]
            for f, n, m, a in gelan["backbone"] + gelan["head"][:-1]]
    p3, p4, p5 = (x + 1 for x in gelan["head"][-1][0])
    w3, w4, w5 = 48, 64, 64  # the widths of TINY_GELAN's P3, P4, P5
    b3, b4, b5 = 5, 7, 9  # main backbone P3, P4, P5 (after the shift)
    c = len(shift) + len(main)  # first auxiliary layer
    aux = [[b3, 1, "CBLinear", [[w3]]], [b4, 1, "CBLinear", [[w3, w4]]], [b5, 1, "CBLinear", [[w3, w4, w5]]],
           [0, 1, "Conv", [16, 3, 2]], [-1, 1, "Conv", [32, 3, 2]], [-1, 1, "RepNCSPELAN4", [32, 32, 16, 1]],
           [-1, 1, "AConv", [w3]], [[c, c + 1, c + 2, -1], 1, "CBFuse", [[0, 0, 0]]],
           [-1, 1, "RepNCSPELAN4", [w3, w3, 24, 1]],  # aux P3 = c + 8
           [-1, 1, "ADown", [w4]], [[c + 1, c + 2, -1], 1, "CBFuse", [[1, 1]]],
           [-1, 1, "RepNCSPELAN4", [w4, w4, 32, 1]],  # aux P4 = c + 11
           [-1, 1, "ADown", [w5]], [[c + 2, -1], 1, "CBFuse", [[2]]],
           [-1, 1, "RepNCSPELAN4", [w5, w5, 32, 1]]]  # aux P5 = c + 14
    head = [[[c + 8, c + 11, c + 14, p3, p4, p5], 1, "DualDDetect", ["nc"]]]
    layers = shift + main + aux + head
    return {**{k: v for k, v in gelan.items() if k not in ("backbone", "head")},
            "backbone": layers[:len(gelan["backbone"]) + 1], "head": layers[len(gelan["backbone"]) + 1:]}


@pytest.mark.slow
@pytest.mark.e2e
def test_custom_structure_is_mapped_from_its_graph(yolov9_tree, shared, tmp_path):
    """A custom training yaml (no upstream size) converts into its custom GELAN yaml: nothing is size-specific."""
    gelan_yaml = tmp_path / "tiny-gelan.yaml"
    gelan_yaml.write_text(yaml.safe_dump(TINY_GELAN, sort_keys=False))
    dual_yaml = tmp_path / "tiny-dual.yaml"
    dual_yaml.write_text(yaml.safe_dump(tiny_dual(TINY_GELAN), sort_keys=False))
    images = photos(shared, 2, 256)
    model = calibrate_bn(build(dual_yaml, seed=3), images)
    weights = save_training_checkpoint(tmp_path / "best.pt", model)
    out = tmp_path / "tiny-converted.pt"
    log = ok(convert(yolov9_tree, "--model", "c", "--weights", str(weights), "--cfg", str(gelan_yaml),
                     "--save", str(out)))
    assert "matches none of this tree's yolov9-*.yaml (a custom model)" in log, log
    assert "--classes_num" not in log, log  # not given: nothing to say about it
    dual, converted = load_training(weights), load_converted(out)
    assert len(converted.model) == len(TINY_GELAN["backbone"]) + len(TINY_GELAN["head"])
    with torch.no_grad():
        (aux, main), _ = dual(images)
        y = converted(images)[0]
    assert max_diff(y, main) < TOL
    assert max_diff(y, aux) > 1.0


@pytest.mark.slow
@pytest.mark.e2e
def test_yolov9_cf_triple_head_converts_to_gelan_c(yolov9_tree, shared, tmp_path):
    """yolov9-cf (TripleDDetect: auxiliary, coarse, fine) -> gelan-c from the head upstream evaluates (the third)."""
    images = photos(shared, 2, 256)
    model = training_model(yolov9_tree, "models/detect/yolov9-cf.yaml", images)
    weights = save_training_checkpoint(tmp_path / "best.pt", model)
    out = tmp_path / "cf-converted.pt"
    log = ok(convert(yolov9_tree, "--model", "c", "--weights", str(weights), "--save", str(out)))
    assert "checkpoint structure: models/detect/yolov9-cf.yaml (TripleDDetect" in log, log
    assert "gelan-c.yaml" in log
    dual, converted = load_training(weights), load_converted(out)
    with torch.no_grad():
        want = dual(images)[0]
        y = converted(images)[0]
    assert max_diff(y, want) < TOL


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.models
def test_segmentation_dseg(yolov9_tree, shared, tmp_path):
    """yolov9-c-dseg (DualDSegment) -> DSegment: converted where the structures map, one sentence where not."""
    if "class DualDSegment(" not in (yolov9_tree / "models" / "yolo.py").read_text():
        pytest.skip(f"this YOLOv9 tree has no DualDSegment/DSegment (models/yolo.py); {ELSEWHERE}")
    images = photos(shared, 2, 256)
    model = training_model(yolov9_tree, "models/segment/yolov9-c-dseg.yaml", images)
    weights = save_training_checkpoint(tmp_path / "best.pt", model)
    del model

    # Upstream's own pair does not correspond: the main mask branch of yolov9-c-dseg has a depth-2
    # RepNCSPELAN4 (layer 41), gelan-c-dseg.yaml a depth-1 one (layer 22). The message shows both entries.
    out = tmp_path / "dseg-converted.pt"
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(weights), "--save", str(out)),
          "gelan-c-dseg.yaml does not fit the checkpoint", "layer 22 [15, 1, RepNCSPELAN4, [256, 256, 128, 1]]",
          "layer 41 [16, 1, RepNCSPELAN4, [256, 256, 128, 2]]")
    assert not out.exists()

    # With that layer built like the checkpoint's the structures map, and the main branch is reproduced.
    spec = yaml.safe_load((yolov9_tree / "models" / "segment" / "gelan-c-dseg.yaml").read_text())
    entry = (spec["backbone"] + spec["head"])[22]
    assert entry[3] == [256, 256, 128, 1]
    entry[3] = [256, 256, 128, 2]
    cfg = tmp_path / "gelan-c-dseg-n2.yaml"
    cfg.write_text(yaml.safe_dump(spec, sort_keys=False))
    log = ok(convert(yolov9_tree, "--model", "c", "--weights", str(weights), "--cfg", str(cfg), "--save", str(out)))
    assert "checkpoint structure: models/segment/yolov9-c-dseg.yaml (DualDSegment" in log, log
    dual, converted = load_training(weights), load_converted(out)
    assert type(converted).__name__ == "SegmentationModel"
    assert type(converted.model[-1]).__name__ == "DSegment"
    with torch.no_grad():
        want, (_, want_mc, want_proto) = dual(images)
        got, (_, got_mc, got_proto) = converted(images)
    assert max_diff(got, want) < TOL  # boxes, class scores and mask coefficients of the main branch
    assert max_diff(got_mc, want_mc) < TOL and max_diff(got_proto, want_proto) < TOL
    assert want_proto.std() > 0.05

    # the other segmentation head (Segment, a Proto module) cannot take these weights: one sentence says so
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(weights), "--cfg", "models/segment/gelan-c-seg.yaml",
                  "--save", str(out.with_name("seg.pt"))), "gelan-c-seg.yaml ends in Segment", "DSegment")
    assert not out.with_name("seg.pt").exists()


# ---------------------------------------------------------------------------------------------
# Checks before writing

def test_missing_weights(yolov9_tree, tmp_path):
    out = tmp_path / "x.pt"
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(tmp_path / "nope.pt"), "--save", str(out)),
          "not found", "nope.pt")
    assert not out.exists()


def test_gelan_checkpoint_is_already_reparameterized(yolov9_tree, gelan_c, converted, tmp_path):
    out = tmp_path / "x.pt"
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(gelan_c), "--save", str(out)),
          "already reparameterized", "nothing to do")
    conv = converted("c")
    ok(conv.result)
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(conv.out), "--save", str(out)),
          "already reparameterized")
    assert not out.exists()


def test_wrong_model_letter_names_the_detected_size(yolov9_tree, converted, tmp_path):
    conv = converted("c")
    out = tmp_path / "x.pt"
    err = fails(refused(yolov9_tree, "--model", "m", "--weights", str(conv.weights), "--save", str(out)),
                "--model m does not match", "yolov9-c", "--model c")
    assert not out.exists(), err


def test_cfg_missing_or_not_fitting(yolov9_tree, converted, tmp_path):
    conv = converted("c")
    out = tmp_path / "x.pt"
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(conv.weights), "--cfg",
                  "models/detect/gelan-x.yaml", "--save", str(out)), "--cfg models/detect/gelan-x.yaml not found")
    err = fails(refused(yolov9_tree, "--model", "c", "--weights", str(conv.weights), "--cfg",
                        "models/detect/gelan-m.yaml", "--save", str(out)), "gelan-m.yaml does not fit the checkpoint")
    assert re.search(r"its layer \d+ \[.*\] corresponds to checkpoint layer \d+ \[.*\] but they differ", err), err
    fails(refused(yolov9_tree, "--model", "c", "--weights", str(conv.weights), "--save", str(conv.weights)),
          "would overwrite --weights")
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_upstream_val_runs_on_the_converted_model(yolov9_tree, converted, small_data, tmp_path):
    conv = converted("c")
    ok(conv.result)
    project = tmp_path / "runs"
    code = UPSTREAM_LOADS_PICKLES + f"""
import sys
from utils.qat.core import compat
compat.apply()
sys.argv = ["val.py", "--data", {str(small_data)!r}, "--weights", {str(conv.out)!r}, "--img", "160",
            "--batch", "8", "--device", "cpu", "--workers", "0", "--project", {str(project)!r}, "--name", "val"]
import val  # upstream val.py as its __main__ runs it, without the plots (Pillow >= 10 lacks their getsize)
val.opt = val.parse_opt()
val.run(**vars(val.opt), plots=False)
"""
    r = run_tool(yolov9_tree, "-c", code, timeout=900, env=upstream_config_dir(tmp_path / "config"))
    log = ok(r) + r.stderr
    assert "Traceback" not in log, log[-3000:]
    assert any(line.split()[:2] == ["all", "8"] for line in log.splitlines()), log[-3000:]
