"""What both engine builders share: the Python API one (``trt_engine``) and the trtexec one (``trtexec``).

- the install hint (:data:`INSTALL_TENSORRT`) and the check that TensorRT imports (:func:`require_tensorrt`),
- TensorRT versions: :func:`version_tuple` (``"10.3.0.26"`` -> ``(10, 3)``), :func:`release`
  (``(10, 3, 0)``), the installed package's version (:func:`installed_version`, :func:`trt_version`),
- the ONNX side of a build: the file exists (:func:`require_onnx`), its one image input
  (:func:`image_input`, :func:`read_image_input`), and the optimization profile for it
  (:func:`profile_shapes`, :func:`check_batches`),
- plugin libraries named on the command line exist (:func:`check_plugin_files`).

Each mistake has one error sentence here, whichever builder meets it. Neither ``tensorrt`` nor ``onnx`` is
imported at module level.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence, Union

from utils.qat.core.errors import QATError

__all__ = ["INSTALL_TENSORRT", "require_tensorrt", "installed_version", "trt_version", "trt_version_string",
           "version_tuple", "release", "require_onnx", "image_input", "read_image_input", "check_batches",
           "profile_shapes", "check_plugin_files"]

PathLike = Union[str, "os.PathLike[str]"]
INSTALL_TENSORRT = "./install_dependencies.sh --tensorrt"
Shape = tuple[int, ...]


# ----------------------------------------------------------------------------- the installed TensorRT
def require_tensorrt() -> None:
    """Raise a QATError naming the install command when ``import tensorrt`` fails."""
    try:
        import tensorrt
    except (ImportError, OSError) as e:  # OSError: the wheel is there but its CUDA libraries are not
        raise QATError(f"TensorRT is not installed here (import tensorrt: {e}); install it with "
                       f"{INSTALL_TENSORRT}.") from e
    if not hasattr(tensorrt, "__version__") or not hasattr(tensorrt, "Builder"):
        # e.g. only tensorrt-stubs is installed: its tensorrt/ folder of .pyi files imports as an empty package
        where = ", ".join(getattr(tensorrt, "__path__", [])) or "?"
        raise QATError(f"TensorRT is not installed here (import tensorrt found only an empty package at {where}, "
                       f"e.g. from tensorrt-stubs); install it with {INSTALL_TENSORRT}.")


def installed_version() -> str | None:
    """The installed TensorRT Python package's version, or None when there is none (no error)."""
    try:
        import tensorrt
    except (ImportError, OSError):
        return None
    version = getattr(tensorrt, "__version__", None)  # None for an empty package (e.g. only tensorrt-stubs)
    return str(version) if version else None


def trt_version_string() -> str:
    """The installed TensorRT's version as it reports it (a QATError when it is not installed)."""
    require_tensorrt()
    import tensorrt as trt
    return str(trt.__version__)


def trt_version() -> tuple[int, int]:
    """(major, minor) of the installed TensorRT Python package."""
    return version_tuple(trt_version_string())


def version_tuple(version: str | Sequence[int]) -> tuple[int, int]:
    """``"10.3.0.26"`` -> ``(10, 3)``; ``"11"`` -> ``(11, 0)``; a sequence of ints is taken as it is."""
    if isinstance(version, str):
        m = re.match(r"\s*(\d+)(?:\.(\d+))?", version)
        if not m:
            raise QATError(f"cannot read a TensorRT version from {version!r}; pass it as MAJOR.MINOR (e.g. 10.3), "
                           f"or reinstall TensorRT with {INSTALL_TENSORRT}.")
        return int(m.group(1)), int(m.group(2) or 0)
    return int(version[0]), int(version[1]) if len(version) > 1 else 0


def release(version: str) -> tuple[int, ...]:
    """``"10.3.0.26"`` -> ``(10, 3, 0)``: engines load only in the TensorRT release that built them."""
    return tuple(int(x) for x in re.findall(r"\d+", str(version))[:3])


# ----------------------------------------------------------------------------- the ONNX being built
def require_onnx(path: Path) -> None:
    """Raise a QATError when the ONNX to build from does not exist."""
    if not path.is_file():
        raise QATError(f"ONNX file {path} not found; export it first with "
                       f"python3 export_qat.py --weights W --include onnx --dynamic --simplify.")


def image_input(model: Any, source: PathLike = "the ONNX") -> tuple[str, list[int | None]]:
    """Name and dims (None = dynamic) of a loaded ONNX model's one image input."""
    from utils.qat.onnx.onnx_graph import graph_inputs, input_dims
    inputs = graph_inputs(model)
    if len(inputs) != 1:
        raise QATError(f"{source} has {len(inputs)} inputs; expected one image input: re-export it with export_qat.py.")
    return inputs[0].name, input_dims(inputs[0])


def read_image_input(onnx_path: PathLike) -> tuple[str, list[int | None]]:
    """:func:`image_input` of an ONNX file; ``("images", [None, 3, None, None])`` when the onnx package is
    missing (the builder then reports what it finds itself)."""
    try:
        import onnx
    except ImportError:
        return "images", [None, 3, None, None]
    return image_input(onnx.load(str(onnx_path), load_external_data=False), onnx_path)


def check_batches(min_batch: int, opt_batch: int, max_batch: int) -> None:
    """The optimization profile's batch sizes are in order."""
    if not 1 <= min_batch <= opt_batch <= max_batch:
        raise QATError(f"batch sizes must satisfy 1 <= min <= opt <= max, got {min_batch}/{opt_batch}/{max_batch}; "
                       f"fix --min/--opt/--max.")


def profile_shapes(dims: Sequence[int | None], *, min_batch: int, opt_batch: int, max_batch: int,
                   imgsz: int | Sequence[int] | None, name: str = "images") -> tuple[Shape, Shape, Shape] | None:
    """min/opt/max shapes (B, C, H, W) of the image input ``name`` with ``dims`` (None or a negative number =
    dynamic), or None when the input is fully static. ``imgsz`` (N or H, W) fixes a dynamic height/width and
    must match a fixed one; a fixed batch overrides the batch sizes."""
    dims = [None if d is None or d < 0 else int(d) for d in dims]
    hw = None if imgsz is None else ((int(imgsz), int(imgsz)) if isinstance(imgsz, int)
                                     else (int(imgsz[0]), int(imgsz[-1])))
    if len(dims) != 4:
        shown = "x".join("?" if d is None else str(d) for d in dims)
        raise QATError(f"the ONNX input {name!r} has shape {shown}; expected images B x C x H x W: re-export it "
                       f"with export_qat.py.")
    b, c, h, w = dims
    if c is None:
        raise QATError(f"the ONNX input {name!r} has a dynamic channel dimension; re-export it with export_qat.py.")
    if h is None or w is None:
        if hw is None:
            raise QATError(f"the ONNX input {name!r} has dynamic height/width: pass --imgsz N to fix the engine's "
                           f"image size.")
        h, w = hw
    elif hw is not None and (h, w) != hw:
        raise QATError(f"the ONNX input {name!r} is fixed at {h}x{w} but {hw[0]}x{hw[1]} was asked for; re-export "
                       f"it with --imgsz {hw[0]} (or --dynamic), or drop --imgsz.")
    if b is not None:
        if all(d is not None for d in dims):
            return None
        min_batch = opt_batch = max_batch = b
    check_batches(min_batch, opt_batch, max_batch)
    return (min_batch, c, h, w), (opt_batch, c, h, w), (max_batch, c, h, w)


def check_plugin_files(plugins: Sequence[PathLike]) -> None:
    """Every plugin library named with --plugins is a file."""
    for p in plugins:
        if not Path(p).is_file():
            raise QATError(f"plugin library {p} not found; pass the .so file that provides the plugin with "
                           f"--plugins PATH.")
