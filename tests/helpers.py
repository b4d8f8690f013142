"""Shared helpers for tests: real images, randomly initialised models that do not vanish, upstream's own scripts."""
from __future__ import annotations

import contextlib
import functools
import shutil
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn as nn

from utils.qat.core.yolov9 import reinit  # noqa: F401  (the tests' random weights; the tree is on sys.path)

# A tiny GELAN touching every quantizer kind: Conv, RepNCSPELAN4 (residual Add, internal cat),
# AConv and ADown (avg/max pool), SPPELAN (MaxPool), Upsample, Concat, DDetect.
TINY_GELAN = {
    "nc": 4, "depth_multiple": 1.0, "width_multiple": 1.0, "anchors": 3,
    "backbone": [
        [-1, 1, "Conv", [16, 3, 2]],
        [-1, 1, "Conv", [32, 3, 2]],
        [-1, 1, "RepNCSPELAN4", [32, 32, 16, 1]],
        [-1, 1, "AConv", [48]],
        [-1, 1, "RepNCSPELAN4", [48, 48, 24, 1]],  # 4 P3
        [-1, 1, "ADown", [64]],
        [-1, 1, "RepNCSPELAN4", [64, 64, 32, 1]],  # 6 P4
        [-1, 1, "ADown", [64]],
        [-1, 1, "RepNCSPELAN4", [64, 64, 32, 1]],  # 8 P5
    ],
    "head": [
        [-1, 1, "SPPELAN", [64, 32]],  # 9
        [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
        [[-1, 6], 1, "Concat", [1]],
        [-1, 1, "RepNCSPELAN4", [64, 64, 32, 1]],  # 12
        [-1, 1, "nn.Upsample", [None, 2, "nearest"]],
        [[-1, 4], 1, "Concat", [1]],
        [-1, 1, "RepNCSPELAN4", [48, 48, 24, 1]],  # 15
        [-1, 1, "ADown", [48]],
        [[-1, 12], 1, "Concat", [1]],
        [-1, 1, "RepNCSPELAN4", [64, 64, 32, 1]],  # 18
        [-1, 1, "ADown", [64]],
        [[-1, 9], 1, "Concat", [1]],
        [-1, 1, "RepNCSPELAN4", [64, 64, 32, 1]],  # 21
        [[15, 18, 21], 1, "DDetect", ["nc"]],
    ],
}


def real_images(folder: Path, n: int, size: int) -> torch.Tensor:
    """``n`` real photos from ``folder``, resized to ``size`` x ``size``, float in [0, 1], NCHW."""
    files = sorted(p for p in Path(folder).iterdir() if p.suffix.lower() in {".jpg", ".png"})[:n]
    ims = [cv2.resize(cv2.imread(str(p)), (size, size))[:, :, ::-1].transpose(2, 0, 1) for p in files]
    return torch.from_numpy(np.ascontiguousarray(np.stack(ims))).float() / 255


def build(cfg, nc: int | None = None, seed: int = 0) -> nn.Module:
    """A DetectionModel from a yaml path or dict, re-initialised, with class names set."""
    from utils.qat.core import yolov9
    model = yolov9.build(cfg, nc)
    model.names = {i: f"class{i}" for i in range(model.yaml["nc"] if nc is None else nc)}
    return reinit(model, seed)


# Upstream's own loaders (attempt_load, strip_optimizer, val.py) call torch.load without weights_only, and
# torch >= 2.6 refuses the full pickles upstream writes. No toolkit command goes through them (the toolkit reads
# checkpoints with utils.qat.model.checkpoint.read), so compat leaves torch.load alone; a test that runs upstream's
# loader on a checkpoint it wrote itself lifts the default for its own process, as a user of those scripts would.
UPSTREAM_LOADS_PICKLES = "import functools, torch; torch.load = functools.partial(torch.load, weights_only=False)\n"


@contextlib.contextmanager
def upstream_loads_pickles():
    """In this process: upstream's attempt_load reads the full pickles these tests wrote (UPSTREAM_LOADS_PICKLES)."""
    original = torch.load
    torch.load = functools.partial(original, weights_only=False)
    try:
        yield
    finally:
        torch.load = original


def upstream_config_dir(folder: Path) -> dict:
    """Environment for upstream's val.py: a config dir holding Arial.ttf (matplotlib's DejaVuSans), since upstream's
    check_dataset downloads the font when it is missing, and no toolkit command needs that patched."""
    import matplotlib
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", folder / "Arial.ttf")
    return {"YOLOV5_CONFIG_DIR": str(folder)}


def narrow_class_branch(model, width: int = 8):
    """``model`` with its head's class branch ``width`` channels wide instead of the yaml's (as Ultralytics builds
    YOLOv9-t: 80 where upstream's yaml builds 128), random weights."""
    from models.common import Conv
    from utils.qat.core import yolov9
    head = yolov9.head(model)
    for i, branch in enumerate(head.cv3):
        c1 = branch[0].conv.in_channels
        head.cv3[i] = nn.Sequential(Conv(c1, width, 3), Conv(width, width, 3), nn.Conv2d(width, head.nc, 1))
    return reinit(model, seed=1).eval()


def quantized_checkpoint(fp: nn.Module, images: torch.Tensor, path: Path):
    """``fp`` calibrated on ``images`` (max, calibrated head scales: the quick recipe) and saved as a quantized
    checkpoint at ``path``: ``(quantized model, path)``."""
    from utils.qat.model import checkpoint
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    qmodel, info = quantize(fp, [images], QuantConfig(method="max", head_amax="calibrated"), example=images[:1])
    qmodel.names = fp.names
    return qmodel, checkpoint.save_quantized(path, qmodel, info)
