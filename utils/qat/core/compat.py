"""Make upstream YOLOv9 code that the toolkit's commands run work on today's Python stack, unedited.

Every CLI of the toolkit calls :func:`apply` before it imports anything from the upstream tree. Only
what a toolkit command reaches is patched (each shim is a no-op where the stack still has what upstream
expects), found by tracing qat.py quantize / eval, segment/qat_seg.py, export_qat.py, export_yoloV9.py,
val_trt.py and reparameterization.py:

- ``numpy.trapz`` (removed in numpy 2.4): upstream ``utils/metrics.py`` ``compute_ap`` integrates with it;
  every evaluation (``utils.qat.evaluation.evaluate`` calls ``ap_per_class``) reaches it.
- ``pkg_resources`` (removed in setuptools 81): ``utils/general.py`` imports it at module level, and
  ``utils/torch_utils.py`` calls ``check_version`` (``pkg.parse_version``) at import; every command imports
  both. requirements.txt pins setuptools < 81, the stand-in keeps a later install working.
- ``IPython`` (in upstream's requirements.txt, which README's quickstart install does not install):
  ``utils/general.py`` and ``models/common.py`` import it at module level, for notebooks only.

Not patched, because no toolkit command reaches them (upstream's own scripts do; run those with your
own adjustments): ``FreeTypeFont.getsize`` (Pillow 10, ``utils/plots.py`` ``Annotator``), the Arial.ttf
download (``check_font``, from ``check_dataset`` and the plots), and ``torch.load``'s weights_only=True
default (torch 2.6: upstream ``attempt_load`` / ``strip_optimizer``). The toolkit reads checkpoints in
one place, ``utils.qat.model.checkpoint.read``: ``weights_only=True`` under the allow-list of ``utils.qat.model.safe_load``.

Also kept: the thread settings of the environment. Upstream ``utils/general.py`` sets ``OMP_NUM_THREADS`` and
``NUMEXPR_MAX_THREADS`` in ``os.environ`` when it is imported, to min(8, CPUs - 1): 1 on a 2-core machine, 8 on 16
cores. The process that imports it keeps the threads it has, but every process it starts inherits the setting:
``benchmarks/peers.py``'s own ``qat.py quantize --ptq-only`` ran on one of two cores (148 s against 89 s from a
shell). The import keeps ``os.environ``'s values as they were before it (:class:`_KeepThreadSettings`).

Also applied: the exact-text silencing of third-party noise (:mod:`utils.qat.core.noise`).
"""
from __future__ import annotations

import importlib.abc
import os
import sys
import types
from pathlib import Path

from utils.qat.core import noise

_applied = False


def _shim_numpy_trapz() -> None:
    # utils/metrics.py compute_ap: AttributeError: module 'numpy' has no attribute 'trapz' (numpy >= 2.4)
    import numpy as np
    if not hasattr(np, "trapz"):
        np.trapz = np.trapezoid


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


THREAD_VARIABLES = ("OMP_NUM_THREADS", "NUMEXPR_MAX_THREADS")


class _KeepThreadSettings(importlib.abc.MetaPathFinder):
    """Finds upstream's ``utils.general`` as the other finders do, and runs its module code with
    :data:`THREAD_VARIABLES` of ``os.environ`` put back afterwards as they were (set, or unset)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "utils.general":
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
                run = spec.loader.exec_module

                def exec_module(module, run=run) -> None:
                    saved = {k: os.environ.get(k) for k in THREAD_VARIABLES}
                    try:
                        run(module)
                    finally:
                        for k, v in saved.items():
                            if v is None:
                                os.environ.pop(k, None)
                            else:
                                os.environ[k] = v
                spec.loader.exec_module = exec_module  # this spec's own loader object
                return spec
        return None


def _keep_thread_settings() -> None:
    if not any(isinstance(f, _KeepThreadSettings) for f in sys.meta_path):
        sys.meta_path.insert(0, _KeepThreadSettings())


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
    _shim_pkg_resources()
    _shim_ipython()
    _keep_thread_settings()
    _applied = True
