"""Opening a checkpoint without running anything it names: ``torch.load(weights_only=True)`` under an allow-list.

A ``.pt`` is a pickle, and a pickle may call any function while it is unpickled (``os.system`` through
``__reduce__``). YOLOv9's format pickles whole models, so the plain ``weights_only=True`` refuses it; this module
allows exactly what YOLOv9 checkpoints contain, found by listing the globals of real ones (upstream train.py /
train_dual.py checkpoints with ``ema``, ``optimizer``, ``opt`` and ``best_fitness``, FP16 and FP32; converted GELANs;
detection, dual-head and segmentation models; this toolkit's quantized checkpoints):

- the ``nn.Module`` classes of the tree's own model modules (``models.*``, derived from the modules themselves, so
  a fork's own blocks are covered) and of ``torch.nn.modules``;
- what upstream's ``opt`` (``vars(argparse.Namespace)``: ``pathlib`` paths) and ``best_fitness`` (a numpy array
  or scalar) bring; tensors, dtypes, ``OrderedDict`` and ``set`` are torch's own defaults (quantized checkpoints,
  modelopt state included, need nothing more);
- ``builtins.getattr`` only as a method lookup on those classes: upstream's Segment and DSegment keep
  ``self.detect = Detect.forward``, which pickles as ``getattr(Detect, "forward")``.

Before anything is unpickled the file's globals are listed (``torch.serialization.get_unsafe_globals_in_checkpoint``
and a scan of the pickle for their order); the first one outside the list, or on :data:`DENIED` (a second guard:
anything that runs code is refused even where a module would otherwise allow it), stops the load with one sentence.
``trust=True`` (``--trust-weights``) loads the file with the full pickle instead, and says so once per file.
"""
from __future__ import annotations

import _compat_pickle
import argparse
import os
import pathlib
import pickle
import pickletools
import re
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

from utils.qat.core.errors import QATError

#: Modules whose globals are never allowed: they run commands, open files or import code.
DENIED_MODULES = ("os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "importlib", "runpy", "pty",
                  "ctypes", "code", "codeop", "pickle", "_pickle", "marshal", "webbrowser", "multiprocessing",
                  "asyncio", "pdb", "io", "_io", "tempfile", "signal", "threading", "_thread")
#: Builtins that run, import or reach arbitrary code (``getattr`` is allowed only as the method lookup of :func:`allowed`).
DENIED_BUILTINS = ("eval", "exec", "compile", "open", "getattr", "setattr", "delattr", "__import__", "globals",
                   "locals", "vars", "breakpoint", "input", "exit", "quit", "help", "memoryview", "type", "object")

TRUST_HINT = "if you trust the file, pass --trust-weights to load it with the full pickle"
_announced: set[str] = set()


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """``--trust-weights``, for every command that reads a ``.pt`` (``args.trust_weights``: ``trust`` of :func:`load`)."""
    parser.add_argument("--trust-weights", action="store_true",
                        help="load a .pt that names code outside YOLOv9's model classes and torch (e.g. a fork's own "
                             "objects) with the full pickle, which runs whatever it names: only for files you trust "
                             "(without it such a file is refused before anything in it runs)")


def denied(name: str) -> bool:
    """True for a global (``module.name``) that can run code: :data:`DENIED_MODULES`, :data:`DENIED_BUILTINS`."""
    module, _, attr = name.rpartition(".")
    if module == "builtins":
        return attr in DENIED_BUILTINS
    return any(module == m or module.startswith(m + ".") for m in DENIED_MODULES)


def model_classes() -> set[type]:
    """The ``nn.Module`` classes defined in the tree's model modules (``models`` and every ``models.*`` that
    ``models.yolo`` imports) and in ``torch.nn.modules``."""
    import torch.nn as nn

    import models.yolo  # noqa: F401  (imports models.common, models.experimental and whatever a fork adds)
    found = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "models" or name.startswith(("models.", "torch.nn.modules."))):
            continue
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == name
                    and not denied(f"{obj.__module__}.{obj.__qualname__}")):
                found.add(obj)
    return found


def _numpy_globals() -> list[Any]:
    """numpy arrays, scalars and dtypes as pickled by numpy 1 (``numpy.core``) and 2 (``numpy._core``)."""
    import numpy as np
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    dtypes = [c for c in vars(getattr(np, "dtypes", types.SimpleNamespace())).values()
              if isinstance(c, type) and issubclass(c, np.dtype)]  # what BUILD sets a dtype's state on
    return [np.ndarray, np.dtype, *dtypes,
            *((getattr(multiarray, f), f"{m}.multiarray.{f}") for f in ("_reconstruct", "scalar")
              for m in ("numpy.core", "numpy._core"))]


def _path_globals() -> list[Any]:
    """pathlib paths of upstream's ``opt``. A path of the other OS loads as its pure path (the full pickle fails
    on it: ``cannot instantiate 'WindowsPath' on your system``)."""
    windows = os.name == "nt"
    return [(pathlib.PosixPath if not windows else pathlib.PurePosixPath, "pathlib.PosixPath"),
            (pathlib.WindowsPath if windows else pathlib.PureWindowsPath, "pathlib.WindowsPath"),
            pathlib.PurePosixPath, pathlib.PureWindowsPath]


def allowed(classes: set[type] | None = None) -> list[Any]:
    """Everything a YOLOv9 checkpoint may name beyond torch's defaults, for ``torch.serialization.safe_globals``."""
    classes = model_classes() if classes is None else classes

    def method_of(cls: Any, name: Any) -> Any:
        """``getattr`` as upstream checkpoints use it: a plain method of an allowed class, nothing else."""
        value = getattr(cls, name, None) if cls in classes and isinstance(name, str) and not name.startswith("_") \
            else None
        if not isinstance(value, types.FunctionType):
            raise pickle.UnpicklingError(f"GLOBAL builtins.getattr on {getattr(cls, '__name__', cls)!r}.{name}")
        return value

    return [*classes, *_numpy_globals(), *_path_globals(), argparse.Namespace, (method_of, "builtins.getattr")]


def globals_in_order(path: Path) -> list[str]:
    """The globals a zip checkpoint's pickle names, in the order it names them (torch's own list is a set)."""
    with zipfile.ZipFile(path) as z:
        records = [n for n in z.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
        data = z.read(records[0]) if records else b""
    names = []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            module, name = str(arg).split(" ", 1)
            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            names.append(f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}")
    return list(dict.fromkeys(names))


def _refusal(path: Path, name: str) -> QATError:
    module, _, attr = name.rpartition(".")
    if module.startswith("models.") and not hasattr(sys.modules.get(module), attr):  # the full pickle fails too
        return QATError(f"{path} was not loaded: it names {name}, which this YOLOv9 tree does not define; run the "
                        f"command in the YOLOv9 tree (version or fork) the checkpoint was made with.")
    why = "which runs code" if denied(name) else "which YOLOv9 checkpoints do not contain (unpickling it could run code)"
    return QATError(f"{path} was not loaded: it names {name}, {why}; {TRUST_HINT}.")


def first_foreign(path: Path, safe: list[Any]) -> str | None:
    """The first global of a zip checkpoint that is neither torch's default nor in ``safe``, or that can run code;
    None when there is none. ``builtins.getattr`` passes here: :func:`allowed` replaces it by a method lookup."""
    import torch
    with torch.serialization.safe_globals(safe):
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    for name in globals_in_order(path):
        if name in unsafe or (denied(name) and name != "builtins.getattr"):
            return name
    return min(unsafe) if unsafe else None  # a name the two scans spell differently


def _full_pickle(path: Path) -> Any:
    import torch
    if str(path) not in _announced:
        _announced.add(str(path))
        print(f"notice: --trust-weights: loading {path} with the full pickle, which runs any code it names.")
    return torch.load(path, map_location="cpu", weights_only=False)


def _restricted(path: Path) -> Any:
    import torch
    safe = allowed()
    is_zip = zipfile.is_zipfile(path)  # torch.save's format since torch 1.6; older files get the restricted load alone
    if is_zip:
        try:
            name = first_foreign(path, safe)
        except (pickle.UnpicklingError, EOFError) as e:
            raise QATError(f"{path} was not loaded: its pickle uses instructions torch.save never writes ({e}); "
                           f"{TRUST_HINT}.") from e
        if name is not None:
            raise _refusal(path, name)
    try:
        with torch.serialization.safe_globals(safe):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the restricted unpickler refused what the scan could not see
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found:
            raise _refusal(path, found.group(1).rstrip(".")) from e
        if is_zip:
            raise QATError(f"{path} was not loaded: it holds an object that YOLOv9 checkpoints do not contain; "
                           f"{TRUST_HINT}.") from e
        raise


def load(path: str | os.PathLike, trust: bool = False) -> Any:
    """The object a ``.pt`` holds, read without running code unless ``trust``; a QATError for a file that names
    anything else, or that is no PyTorch checkpoint."""
    path = Path(path)
    try:
        return _full_pickle(path) if trust else _restricted(path)
    except QATError:
        raise
    except Exception as e:  # pickle, zip and torch errors all mean the same thing to the user
        raise QATError(f"{path} is not a PyTorch checkpoint ({type(e).__name__}); pass a YOLOv9 .pt file.") from e
