"""Make upstream YOLOv9 run on today's Python stack without editing its files.

Every CLI of the toolkit calls :func:`apply` before it imports anything from the
upstream tree. Each shim below names the upstream symptom it cures; each is a
no-op where the stack still provides what upstream expects.
"""
from __future__ import annotations

import functools
import importlib
import os
import shutil
import sys
import types
from pathlib import Path

from utils.qat import noise

_TRUSTED: set[str] = set()
_applied = False


def trust_checkpoint(path: str | os.PathLike) -> None:
    """Allow ``torch.load`` to unpickle ``path`` (a file the user named on the command line)."""
    _TRUSTED.add(os.path.realpath(path))


def is_trusted(path) -> bool:
    return isinstance(path, (str, os.PathLike)) and os.path.realpath(path) in _TRUSTED


def _shim_numpy_trapz() -> None:
    # utils/metrics.py compute_ap: AttributeError: module 'numpy' has no attribute 'trapz' (numpy >= 2.4)
    import numpy as np
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid


def _shim_pillow_getsize() -> None:
    # utils/plots.py Annotator.box_label: 'FreeTypeFont' object has no attribute 'getsize' (Pillow >= 10)
    from PIL import ImageFont
    if not hasattr(ImageFont.FreeTypeFont, "getsize"):
        def getsize(self, text, *args, **kwargs):
            left, top, right, bottom = self.getbbox(text, *args, **kwargs)
            return right, bottom
        ImageFont.FreeTypeFont.getsize = getsize


def _shim_pkg_resources() -> None:
    # utils/general.py: ModuleNotFoundError: No module named 'pkg_resources' (setuptools >= 81)
    try:
        import pkg_resources  # noqa: F401
        return
    except ImportError:
        pass
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.version import parse as parse_version

    class DistributionNotFound(Exception):
        pass

    class VersionConflict(Exception):
        pass

    def require(requirements):
        reqs = [requirements] if isinstance(requirements, str) else list(requirements)
        for text in reqs:
            req = Requirement(str(text))
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError as e:
                raise DistributionNotFound(req.name) from e
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                raise VersionConflict(f"{req.name} {have} does not satisfy {req.specifier}")
        return []

    mod = types.ModuleType("pkg_resources")
    mod.parse_version = parse_version
    mod.require = require
    mod.DistributionNotFound = DistributionNotFound
    mod.VersionConflict = VersionConflict
    sys.modules["pkg_resources"] = mod


def _shim_ipython() -> None:
    # utils/general.py `import IPython` and models/common.py `from IPython.display import display`:
    # ModuleNotFoundError where IPython is not installed (used only for notebooks).
    try:
        import IPython  # noqa: F401
        return
    except ImportError:
        pass
    mod = types.ModuleType("IPython")
    mod.__path__ = []  # a package, so `IPython.display` imports
    mod.version_info = (99, 0)  # matplotlib compares it; "new enough" skips its IPython integration
    mod.get_ipython = lambda: None
    display = types.ModuleType("IPython.display")
    display.display = print
    display.clear_output = lambda *a, **k: None
    mod.display = display
    sys.modules["IPython"] = mod
    sys.modules["IPython.display"] = display


def _shim_torch_load() -> None:
    # models/experimental.py attempt_load, utils/general.py strip_optimizer:
    # UnpicklingError 'Weights only load failed' (torch >= 2.6 defaults to weights_only=True).
    # Only files the user named (trust_checkpoint) are unpickled in full.
    import torch
    if getattr(torch.load, "_yolov9_qat_shim", False):
        return
    original = torch.load

    @functools.wraps(original)
    def load(f, *args, **kwargs):
        if "weights_only" not in kwargs and is_trusted(f):
            kwargs["weights_only"] = False
        return original(f, *args, **kwargs)

    load._yolov9_qat_shim = True
    torch.load = load


def _shim_torch_save_trusts_own_files() -> None:
    # train.py: strip_optimizer(last.pt) and the final attempt_load(best.pt) raise UnpicklingError
    # 'Weights only load failed' on the checkpoints train.py itself has just written (torch >= 2.6).
    # A file this process wrote with torch.save is as trusted as the process: trust it for loading.
    import torch
    if getattr(torch.save, "_yolov9_qat_shim", False):
        return
    original = torch.save

    @functools.wraps(original)
    def save(obj, f, *args, **kwargs):
        result = original(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            trust_checkpoint(f)
        return result

    save._yolov9_qat_shim = True
    torch.save = save


def local_font() -> Path:
    """A TrueType font that ships with matplotlib (an upstream requirement)."""
    import matplotlib
    return Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"


def _shim_font() -> None:
    # utils/general.py check_font and utils/plots.py check_pil_font download Arial.ttf at run time
    # (URLError offline). Put a local font where upstream looks and never download.
    general = importlib.import_module("utils.general")
    config_dir = Path(general.CONFIG_DIR)

    def check_font(font=general.FONT, progress=False):
        target = config_dir / Path(font).name
        if not Path(font).exists() and not target.exists():
            try:
                config_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(local_font(), target)
            except OSError:
                pass  # unwritable config dir: check_pil_font then falls back to PIL's default font

    for name in (general.FONT, "Arial.Unicode.ttf"):
        check_font(name)
    general.check_font = check_font
    plots = sys.modules.get("utils.plots")
    if plots is not None:
        plots.check_font = check_font


def apply(yolov9_root: str | os.PathLike | None = None) -> None:
    """Install every shim. ``yolov9_root`` is put on ``sys.path`` (default: the current directory)."""
    global _applied
    root = str(Path(yolov9_root or os.getcwd()).resolve())
    if root not in sys.path:
        sys.path.insert(0, root)
    if _applied:
        return
    noise.silence()
    _shim_numpy_trapz()
    _shim_pillow_getsize()
    _shim_pkg_resources()
    _shim_ipython()
    _shim_torch_load()
    _shim_torch_save_trusts_own_files()
    _shim_font()
    _applied = True
