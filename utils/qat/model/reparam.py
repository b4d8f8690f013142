"""Reparameterize YOLOv9 training models (auxiliary branch) into their GELAN inference structure.

A YOLOv9 training model (``yolov9-*.yaml``) computes a main branch and an auxiliary branch and
ends in a multi-head detector (``DualDDetect``: auxiliary head ``cv2/cv3/dfl`` on the first input
group, main head ``cv4/cv5/dfl2`` on the second; upstream evaluates ``preds[0][1]``). Inference
keeps only what the main head needs, which is exactly a GELAN model (``gelan-*.yaml``).

The layer correspondence is derived from the two graphs, not from per-size tables: starting at the
two heads, each GELAN layer's inputs (``.f``) are paired with the inputs of the dual head's main
group, recursively, checking at every step that the paired layers have the same type, the same
settings (strides, groups, upsampling, concat/fuse indices, activation...) and the same parameter
shapes. Parameter-free pass-through layers (``Silence``) are looked through. Whatever the main head
does not reach (the auxiliary branch and head) is dropped.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from utils.qat.core.atomic import atomic_path
from utils.qat.core.errors import QATError
from utils.qat.core.yolov9 import FAMILIES, build, head_name, is_dual, isolated_build, num_classes, outputs, task_of_model

SIZES = ("t", "s", "m", "c", "e")
INPUT = "input"  # the image tensor: the source of layer 0 (and of anything behind a Silence at 0)
PASS_THROUGH = {"Silence"}  # parameter-free layers that return their input unchanged


@dataclass(frozen=True)
class HeadSpec:
    """How one multi-branch head reduces to its single-branch inference head."""
    target: str  # class name of the inference head
    inputs: Callable[[int], list[int]]  # number of head inputs -> positions of the main branch inputs
    modules: dict[str, str]  # inference head submodule -> training head submodule
    yaml: str  # inference yaml to suggest, relative to the tree root ({} = size letter)


def _group(k: int, n_groups: int, extra: int = 0) -> Callable[[int], list[int]]:
    """Inputs ``[group 0..., group 1..., ..., extra 0, extra 1, ...]``: the k-th group (and the k-th extra input)."""
    def pick(n: int) -> list[int]:
        nl = (n - extra) // n_groups
        return list(range(k * nl, (k + 1) * nl)) + ([n - extra + k] if extra else [])
    return pick


# Which input group and which submodules form the head upstream evaluates at inference
# (models/yolo.py forward of each class; val_dual.py takes preds[0][1], val_triple.py preds[2],
# TripleDDetect returns its third head, DualDSegment its second head, mask coefficients and protos).
HEAD_SPECS: dict[str, HeadSpec] = {
    "DualDDetect": HeadSpec("DDetect", _group(1, 2), {"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2"},
                            "models/detect/gelan-{}.yaml"),
    "DualDetect": HeadSpec("Detect", _group(1, 2), {"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2"},
                           "models/detect/gelan-{}.yaml"),
    "TripleDDetect": HeadSpec("DDetect", _group(2, 3), {"cv2": "cv6", "cv3": "cv7", "dfl": "dfl3"},
                              "models/detect/gelan-{}.yaml"),
    "TripleDetect": HeadSpec("Detect", _group(2, 3), {"cv2": "cv6", "cv3": "cv7", "dfl": "dfl3"},
                             "models/detect/gelan-{}.yaml"),
    # inputs: [A3 A4 A5, P3 P4 P5, proto_aux, proto_main] -> DSegment [P3 P4 P5, proto]
    "DualDSegment": HeadSpec("DSegment", _group(1, 2, extra=2),
                             {"cv2": "cv4", "cv3": "cv5", "dfl": "dfl2", "cv4": "cv7", "proto": "proto2"},
                             "models/segment/gelan-{}-dseg.yaml"),
}


# ---------------------------------------------------------------------------------------------------
# model inspection

def sources(layer: nn.Module) -> list:
    """Absolute indices of a layer's inputs (``INPUT`` for the image)."""
    i, f = layer.i, layer.f
    out = []
    for j in ([f] if isinstance(f, int) else list(f)):
        if j < 0:
            j = i + j
            if j < 0:
                out.append(INPUT)
                continue
        out.append(j)
    return out


def _norm(v):
    """A comparable form of a module setting (2 == 2.0, so upsampling factors stored either way agree)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return f"<{type(v).__name__}>"  # never a value (a tensor's contents are weights, not structure)


# attributes that do not change what a module computes in eval mode
_IGNORED_SETTINGS = {"training", "inplace", "momentum", "recompute_scale_factor", "i", "f", "type", "np"}


def signature(module: nn.Module) -> dict:
    """What a layer computes, independent of its weights: classes, settings and parameter shapes."""
    sig: dict[str, object] = {}
    for name, m in module.named_modules():
        sig[f"{name or '.'}:class"] = type(m).__name__
        for k, v in vars(m).items():
            if k.startswith("_") or k in _IGNORED_SETTINGS:
                continue
            if v is None or isinstance(v, (bool, int, float, str, list, tuple)):
                sig[f"{name + '.' if name else ''}{k}"] = _norm(v)
    for k, v in module.state_dict().items():
        sig[f"{k}:shape"] = tuple(v.shape)
    return sig


def _difference(a: dict, b: dict) -> str:
    """The first difference between two signatures, in words ('' if none).

    Classes and parameter shapes must agree key for key; a setting counts where both sides have it
    (a checkpoint pickled by another upstream commit may carry an attribute the tree no longer sets).
    """
    for k in list(a) + [k for k in b if k not in a]:
        strict = k.endswith((":class", ":shape"))
        if (strict or (k in a and k in b)) and a.get(k, "nothing") != b.get(k, "nothing"):
            va, vb = a.get(k, "nothing"), b.get(k, "nothing")
            if k.endswith(":class"):
                path = k[:-len(":class")]
                return f"{'the layer' if path == '.' else path} is {va} vs {vb}"
            if k.endswith(":shape"):
                return f"{k[:-len(':shape')]} has shape {va} vs {vb}"
            return f"{k} = {va} vs {vb}"
    return ""


def _layer(model: nn.Module, i) -> str:
    """'layer 12 [[-1, 6], 1, Concat, [1]]' (its yaml entry when the model has one), 'the input image' for INPUT."""
    if i == INPUT:
        return "the input image"
    spec = getattr(model, "yaml", None)
    entries = (spec.get("backbone", []) + spec.get("head", [])) if isinstance(spec, dict) else []
    if i < len(entries) and len(entries[i]) == 4:
        f, n, m, args = entries[i]
        return f"layer {i} [{f}, {n}, {m}, {args}]"
    return f"layer {i} ({type(model.model[i]).__name__})"


# ---------------------------------------------------------------------------------------------------
# the layer map

def _through(model: nn.Module, src):
    """Follow parameter-free pass-through layers back to the layer that computes the value."""
    while src != INPUT and type(model.model[src]).__name__ in PASS_THROUGH:
        (src,) = sources(model.model[src])
    return src


def build_layer_map(dual_model: nn.Module, gelan_model: nn.Module) -> dict[int, int]:
    """Map each layer index of ``gelan_model`` to the layer of ``dual_model`` that computes the same thing.

    Derived from the graphs: the inference head's inputs are paired with the inputs of the dual
    head's main group, and so on back to the image. Raises QATError naming the first layer that
    does not correspond (type, settings or parameter shapes) or a GELAN layer left without a source.
    """
    name = getattr(gelan_model, "yaml_file", "the inference yaml")
    dual_head, gelan_head = dual_model.model[-1], gelan_model.model[-1]
    spec = HEAD_SPECS.get(type(dual_head).__name__)
    if spec is None:
        raise QATError(f"the checkpoint ends in {type(dual_head).__name__}, not a YOLOv9 training head "
                       f"({', '.join(HEAD_SPECS)}); only yolov9-*.yaml training models need reparameterizing.")
    if type(gelan_head).__name__ != spec.target:
        raise QATError(f"{name} ends in {type(gelan_head).__name__} but the checkpoint's {type(dual_head).__name__} "
                       f"reduces to {spec.target}; pass a --cfg whose head is {spec.target} "
                       f"(such as {Path(spec.yaml.format('<size>')).name}).")
    d_src = sources(dual_head)
    d_main = [d_src[k] for k in spec.inputs(len(d_src))]
    g_src = sources(gelan_head)
    if len(g_src) != len(d_main):
        raise QATError(f"{name}'s head takes {len(g_src)} inputs but the checkpoint's main head takes {len(d_main)}; "
                       f"pass the gelan yaml that matches the checkpoint as --cfg.")
    mapping: dict[int, int] = {len(gelan_model.model) - 1: len(dual_model.model) - 1}
    used: dict[int, int] = {len(dual_model.model) - 1: len(gelan_model.model) - 1}
    stack = list(zip(g_src, d_main))
    while stack:
        g, d = stack.pop()
        if g != INPUT and d != INPUT and all(type(m.model[x]).__name__ in PASS_THROUGH
                                             for m, x in ((gelan_model, g), (dual_model, d))):
            mapping.setdefault(g, d)
            used.setdefault(d, g)
        g, d = _through(gelan_model, g), _through(dual_model, d)
        if g == INPUT or d == INPUT:
            if g != d:
                raise QATError(f"{name} does not fit the checkpoint: its {_layer(gelan_model, g)} corresponds to "
                               f"{_layer(dual_model, d)} of the checkpoint; pass the gelan yaml that matches "
                               f"the checkpoint as --cfg.")
            continue
        if g in mapping:
            if mapping[g] != d:
                raise QATError(f"{name} does not fit the checkpoint: its layer {g} would take the weights of both "
                               f"checkpoint layers {mapping[g]} and {d}; pass the gelan yaml that matches the "
                               f"checkpoint as --cfg.")
            continue
        if d in used:
            raise QATError(f"{name} does not fit the checkpoint: its layers {used[d]} and {g} both correspond to "
                           f"checkpoint layer {d}; pass the gelan yaml that matches the checkpoint as --cfg.")
        gm, dm = gelan_model.model[g], dual_model.model[d]
        diff = _difference(signature(gm), signature(dm))
        if diff:
            raise QATError(f"{name} does not fit the checkpoint: its {_layer(gelan_model, g)} corresponds to "
                           f"checkpoint {_layer(dual_model, d)} but they differ ({diff}); pass a --cfg whose layer "
                           f"{g} is built like the checkpoint's layer {d} (the gelan yaml of the same size).")
        gs, ds = sources(gm), sources(dm)
        if len(gs) != len(ds):
            raise QATError(f"{name} does not fit the checkpoint: its {_layer(gelan_model, g)} takes {len(gs)} inputs, "
                           f"checkpoint {_layer(dual_model, d)} takes {len(ds)}; pass the gelan yaml that matches "
                           f"the checkpoint as --cfg.")
        mapping[g], used[d] = d, g
        stack.extend(zip(gs, ds))
    for i, layer in enumerate(gelan_model.model):
        if i not in mapping and any(True for _ in layer.parameters()):
            raise QATError(f"{name} does not fit the checkpoint: its {_layer(gelan_model, i)} is not on "
                           f"the path to its head, so no checkpoint layer provides its weights; pass the gelan yaml "
                           f"that matches the checkpoint as --cfg.")
    return dict(sorted(mapping.items()))


def build_state_map(dual_model: nn.Module, gelan_model: nn.Module) -> dict[str, str]:
    """``gelan_model.state_dict()`` key -> ``dual_model.state_dict()`` key, every key covered, shapes equal."""
    layer_map = build_layer_map(dual_model, gelan_model)
    name = getattr(gelan_model, "yaml_file", "the inference yaml")
    gh, dh = len(gelan_model.model) - 1, len(dual_model.model) - 1
    dual_head, gelan_head = dual_model.model[-1], gelan_model.model[-1]
    spec = HEAD_SPECS[type(dual_head).__name__]
    for g_sub in dict(gelan_head.named_children()):
        d_sub = spec.modules.get(g_sub)
        if d_sub is None or not hasattr(dual_head, d_sub):
            raise QATError(f"{name}'s head has a part '{g_sub}' that the checkpoint's {type(dual_head).__name__} "
                           f"has no counterpart for; pass the gelan yaml that matches the checkpoint as --cfg.")
        diff = _difference(signature(getattr(gelan_head, g_sub)), signature(getattr(dual_head, d_sub)))
        if diff:
            raise QATError(f"{name} does not fit the checkpoint: head part {g_sub} differs from the checkpoint's "
                           f"{d_sub} ({diff}); pass the gelan yaml that matches the checkpoint (same size and "
                           f"classes) as --cfg.")
    for attr in ("nc", "reg_max", "nm", "no"):
        if hasattr(gelan_head, attr) and getattr(gelan_head, attr) != getattr(dual_head, attr, None):
            raise QATError(f"{name}'s head has {attr}={getattr(gelan_head, attr)}, the checkpoint's "
                           f"{getattr(dual_head, attr, None)}; pass the gelan yaml that matches the checkpoint.")
    dual_sd = dual_model.state_dict()
    keymap = {}
    for key, value in gelan_model.state_dict().items():
        _, idx, rest = key.split(".", 2)
        idx = int(idx)
        if idx == gh:
            sub, tail = rest.split(".", 1)
            src = f"model.{dh}.{spec.modules[sub]}.{tail}"
        else:
            src = f"model.{layer_map[idx]}.{rest}"
        if src not in dual_sd or tuple(dual_sd[src].shape) != tuple(value.shape):
            raise QATError(f"{name} does not fit the checkpoint: {key} {tuple(value.shape)} has no counterpart "
                           f"({src} {tuple(dual_sd[src].shape) if src in dual_sd else 'absent'}); pass the gelan "
                           f"yaml that matches the checkpoint as --cfg.")
        keymap[key] = src
    return keymap


# ---------------------------------------------------------------------------------------------------
# building models from the tree's yamls

def tree_root() -> Path:
    """The YOLOv9 tree whose ``models`` package is imported."""
    import models.yolo
    return Path(models.yolo.__file__).resolve().parents[1]


def _load_yaml(path: Path) -> dict:
    import yaml
    with open(path, encoding="ascii", errors="ignore") as f:
        return yaml.safe_load(f)


def _structure(layers) -> list:
    """Per layer: type, inputs and parameter shapes (settings such as BN eps are set after parse_model)."""
    return [(type(m).__name__, tuple(sources(m)), tuple((k, tuple(v.shape)) for k, v in m.state_dict().items()))
            for m in layers]


def identify(model: nn.Module, root: Path | None = None) -> Path | None:
    """The tree's yolov9-*.yaml (models/detect, models/segment) whose structure equals ``model``'s, if any.

    Compared layer by layer (type, inputs, parameter shapes: the channel widths), with the yaml's ``nc`` set
    to the checkpoint's. Built on the meta device: no memory, no weights.
    """
    from models.yolo import parse_model
    root = root or tree_root()
    nc = num_classes(model)
    have = _structure(model.model)
    candidates = sorted((root / "models").glob("*/yolov9-*.yaml"))
    for path in candidates:
        if not re.match(r"yolov9-[tsmce]", path.stem):
            continue
        d = _load_yaml(path)
        if len(d.get("backbone", [])) + len(d.get("head", [])) != len(have):
            continue
        d["nc"] = nc
        try:
            with isolated_build(), torch.device("meta"):
                layers, _ = parse_model(copy.deepcopy(d), ch=[3])
        except Exception:  # a yaml this tree cannot build (e.g. modules it lacks)
            continue
        if _structure(layers) == have:
            return path
    return None


# ---------------------------------------------------------------------------------------------------
# conversion

def verify(dual_model: nn.Module, gelan_model: nn.Module, imgsz: int = 64, tol: float = 1e-3) -> float:
    """Run both (FP32, eval) on one random image; the converted model must reproduce the main branch.

    Both compute the same operations on the same weights, so they agree to rounding; a wrong mapping
    shows as differences of the order of the outputs themselves. Returns the largest difference.
    """
    dual_model.float().eval()
    gelan_model.float().eval()
    p = next(gelan_model.parameters())
    x = torch.rand(1, 3, imgsz, imgsz, generator=torch.Generator().manual_seed(0)).to(p.device)
    with torch.no_grad():
        want = outputs(dual_model(x), task_of_model(dual_model))
        got = outputs(gelan_model(x), task_of_model(gelan_model))
    worst = 0.0
    for a, b in zip(want, got):
        if a.shape != b.shape:
            raise QATError(f"the converted model's output has shape {tuple(b.shape)}, the checkpoint's main branch "
                           f"{tuple(a.shape)}; pass the gelan yaml that matches the checkpoint as --cfg.")
        err = (a - b).abs().max().item()
        if err > tol * max(1.0, a.abs().max().item()):
            raise QATError(f"the converted model does not reproduce the checkpoint's main branch (max abs diff "
                           f"{err:.3g}); the --cfg structure computes differently from the checkpoint's: pass the "
                           f"gelan yaml the checkpoint was designed with.")
        worst = max(worst, err)
    return worst


def convert(dual_model: nn.Module, cfg: str | Path, nc: int | None = None, names=None,
            device: str | torch.device = "cpu", check: bool = True) -> nn.Module:
    """Build ``cfg`` and fill it with the main-branch weights of ``dual_model``; returns the FP32 model.

    With ``check`` the result is run against ``dual_model`` (which is turned FP32, eval) on a random image.
    """
    device = torch.device(device)
    nc = num_classes(dual_model) if nc is None else nc
    dual_model = dual_model.to(device)
    gelan = build(Path(cfg), nc, task=task_of_model(dual_model)).to(device)
    keymap = build_state_map(dual_model, gelan)
    dual_sd = dual_model.state_dict()
    gelan.load_state_dict({k: dual_sd[v] for k, v in keymap.items()}, strict=True)
    stride = getattr(dual_model, "stride", None)
    if stride is not None and not torch.equal(gelan.stride.cpu().float(), stride.cpu().float()):
        raise QATError(f"{Path(cfg).name} has strides {gelan.stride.tolist()}, the checkpoint "
                       f"{dual_model.stride.tolist()}; pass the gelan yaml that matches the checkpoint as --cfg.")
    names = names if names is not None else getattr(dual_model, "names", None)
    gelan.names = names if names is not None else [str(i) for i in range(nc)]
    gelan.nc = nc
    if hasattr(dual_model, "hyp"):
        gelan.hyp = dual_model.hyp
    if check:
        verify(dual_model, gelan)
    return gelan.eval()


# ---------------------------------------------------------------------------------------------------
# checkpoints

def load_training_model(path: str | Path, trust: bool = False) -> nn.Module:
    """The model of an upstream checkpoint: the EMA when present (as upstream attempt_load), else 'model'.
    ``trust``: as ``utils.qat.model.checkpoint.read``."""
    from utils.qat.model import checkpoint
    ckpt = checkpoint.read(path, trust)
    if checkpoint.is_quantized(ckpt):
        raise QATError(f"{path} is a quantized (yolov9-qat) checkpoint; reparameterize the training checkpoint "
                       f"before quantizing it.")
    model = ckpt.get("ema") or ckpt.get("model")
    if not isinstance(getattr(model, "model", None), nn.Sequential):
        raise QATError(f"{path} holds no YOLOv9 layer list; pass a checkpoint written by YOLOv9 train_dual.py.")
    from utils.qat.model.bounds import check_geometry
    from utils.qat.model.numbers import check_fp
    check_geometry(model, str(path))
    check_fp(model, str(path))
    return model


def save_checkpoint(model: nn.Module, path: str | Path) -> Path:
    """Upstream checkpoint format (as train.py's strip_optimizer writes it): FP16 model, epoch -1."""
    model = copy.deepcopy(model).cpu().half()
    ckpt = {"model": model, "optimizer": None, "best_fitness": None, "ema": None, "updates": None,
            "opt": None, "git": None, "date": datetime.now().isoformat(), "epoch": -1}
    with atomic_path(path) as tmp:
        torch.save(ckpt, tmp)
    return Path(path)


def resolve_cfg(cfg: str | Path, root: Path | None = None) -> Path:
    """``cfg`` as given, else relative to the tree root; QATError when neither exists."""
    p = Path(cfg)
    if p.is_file():
        return p
    root = root or tree_root()
    if not p.is_absolute() and (root / p).is_file():
        return root / p
    raise QATError(f"--cfg {cfg} not found; pass the GELAN inference yaml of the model "
                   f"(e.g. models/detect/gelan-c.yaml).")


def reparameterize(weights: str | Path, model: str, save: str | Path | None = None, cfg: str | Path | None = None,
                   classes_num: int | None = None, device: str = "cpu",
                   log: Callable[[str], object] = print, trust: bool = False) -> Path:
    """The whole conversion, every check made before anything is written; returns the saved path.
    ``classes_num``: what the user said the class count is (the checkpoint's count is used; a different value is
    reported as ignored); ``trust``: read ``weights`` with the full pickle (``utils.qat.model.checkpoint.read``)."""
    if model not in SIZES:
        raise QATError(f"--model {model} is not a YOLOv9 size; use one of {', '.join(SIZES)}.")
    from utils.qat.core.device import select_device
    dev = select_device(device)
    save = Path(save or f"yolov9-{model}-converted.pt")
    if Path(weights).exists() and save.resolve() == Path(weights).resolve():
        raise QATError(f"--save {save} would overwrite --weights; choose another output path.")
    dual = load_training_model(weights, trust)
    head = head_name(dual)
    if head in FAMILIES and not is_dual(dual):
        raise QATError(f"{weights} is already reparameterized (it ends in {head}, the inference head): nothing to "
                       f"do, use it as it is.")
    if not is_dual(dual):
        raise QATError(f"{weights} ends in {head}, not a YOLOv9 training head ({', '.join(HEAD_SPECS)}); only "
                       f"models trained from yolov9-*.yaml need reparameterizing.")
    root = tree_root()
    found = identify(dual, root)
    if found is not None:
        letter = re.match(r"yolov9-([tsmce])", found.stem).group(1)
        if letter != model:
            raise QATError(f"--model {model} does not match the checkpoint: its structure is yolov9-{letter} "
                           f"({found.relative_to(root)}); rerun with --model {letter}.")
        log(f"checkpoint structure: {found.relative_to(root)} ({head}, {len(dual.model)} layers)")
    else:
        log(f"notice: the checkpoint ({head}, {len(dual.model)} layers) matches none of this tree's yolov9-*.yaml "
            f"(a custom model); taking --model {model} as given, the layer check below still applies")
    spec = HEAD_SPECS[head]
    cfg_path = resolve_cfg(cfg if cfg is not None else spec.yaml.format(model), root)
    nc = num_classes(dual)
    if classes_num is not None and classes_num != nc:
        log(f"notice: --classes_num {classes_num} is ignored: the checkpoint's head predicts {nc} classes, and the "
            f"converted model keeps them")
    converted = convert(dual, cfg_path, nc=nc, device=dev)
    n_params = sum(p.numel() for p in converted.parameters())
    dropped = len(dual.model) - len(converted.model)
    log(f"converted {head} -> {type(converted.model[-1]).__name__} with {cfg_path.name}: {len(converted.model)} "
        f"layers kept, {dropped} training-only layers dropped, {n_params / 1e6:.2f} M parameters, {nc} classes; "
        f"output matches the checkpoint's main branch")
    save_checkpoint(converted, save)
    log(f"saved {save} (FP16)")
    return save
