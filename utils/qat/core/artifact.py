"""What an exported model carries about itself, read and written in one place.

An ONNX export keeps it in ``metadata_props`` (string values), a TensorRT engine ``X.engine`` in the JSON
sidecar ``X.engine.json``. :class:`ArtifactMeta` holds the fields every consumer needs (``stride``,
``names``, ``task``, ``imgsz``) and converts them both ways:

- :meth:`ArtifactMeta.read` takes either (strings or JSON values alike);
- :meth:`ArtifactMeta.props` writes ONNX ``metadata_props`` strings (:func:`read_props` / :func:`write_props`
  move them in and out of a model), :meth:`ArtifactMeta.sidecar` the engine's JSON fields.

``names`` is written as JSON (``{"0": "person", ...}``) and read from JSON or from a Python literal
(upstream YOLOv9's export.py writes ``str(model.names)``: ``{0: 'person', ...}`` or ``['person', ...]``),
parsed with ``ast.literal_eval``, which evaluates no code. A value that cannot be read counts as absent.

The End2End output names (:data:`END2END_OUTPUTS`, :data:`MASK_OUTPUT`) live here too: they are what tells a
consumer that a graph or engine already holds NMS (and, with the rank of the outputs, which task a graph without
metadata serves: :func:`task_from_outputs`). A stated size is bounded (:data:`MAX_SIDE`, ...) before anything is
sized by it. No onnx, torch or TensorRT import here.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from utils.qat.core.errors import QATError

__all__ = ["END2END_OUTPUTS", "MASK_OUTPUT", "ArtifactMeta", "check_fixed_input", "is_end2end", "parse_names",
           "parse_stride", "read_props", "task_from_outputs", "write_props"]

#: The outputs of an End2End graph (NMS in the graph), in order; segmentation adds :data:`MASK_OUTPUT`.
END2END_OUTPUTS = ("num_dets", "det_boxes", "det_scores", "det_classes")
MASK_OUTPUT = "det_masks"
#: The largest stride, input side and fixed batch a file may state (anything larger is a damaged file, not a model:
#: YOLOv9's strides are 8 to 64, its inputs 640 to 1280 pixels).
MAX_STRIDE, MAX_SIDE, MAX_BATCH = 128, 8192, 1024


def is_end2end(output_names: Iterable[str]) -> bool:
    """The graph or engine with these outputs holds NMS (every name of :data:`END2END_OUTPUTS`)."""
    return set(END2END_OUTPUTS) <= set(output_names)


def task_from_outputs(output_names: Sequence[str], ranks: Sequence[int]) -> str:
    """The task of a graph or engine whose metadata does not say: 'segment' when it has :data:`MASK_OUTPUT` or
    (without NMS) a rank-4 output, the prototypes of a plain export; else 'detect'."""
    if MASK_OUTPUT in output_names or (not is_end2end(output_names) and 4 in ranks):
        return "segment"
    return "detect"


def _literal(value: Any) -> Any:
    """A string as JSON, else as a Python literal (never evaluated as code); other values as they are."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None


def parse_names(value: Any) -> dict[int, str] | None:
    """Class names ``{index: name}`` from a dict or list, or their text as JSON or as a Python literal;
    None when absent or not readable."""
    names = _literal(value)
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    if not isinstance(names, dict):
        return None
    try:
        return {int(k): str(v) for k, v in names.items()}
    except (TypeError, ValueError):
        return None


def parse_stride(value: Any) -> int | None:
    """The largest stride from ``32``, ``"32"``, ``"32.0"`` or a list of strides; None when not readable, or not a
    power of two up to :data:`MAX_STRIDE` (the input sizes are rounded up to a multiple of it)."""
    v = _literal(value)
    if isinstance(v, (list, tuple)) and v:
        v = max(v, key=lambda x: x if isinstance(x, (int, float)) else 0)
    try:
        stride = int(float(v))
    except (TypeError, ValueError, OverflowError):
        return None
    return stride if 0 < stride <= MAX_STRIDE and stride & (stride - 1) == 0 else None


def _imgsz(value: Any) -> list[int] | None:
    v = _literal(value)
    if isinstance(v, int):
        v = [v, v]
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and 0 < x <= MAX_SIDE for x in v):
        return [int(v[0]), int(v[1])]
    return None


def check_fixed_input(batch: int | None, height: int | None, width: int | None, source: Any) -> None:
    """The fixed batch and input size a graph or engine states are ones the evaluator may allocate: the images are
    letterboxed into (and a short last batch padded to) exactly these sizes."""
    if batch is not None and not 0 < batch <= MAX_BATCH:
        raise QATError(f"{source} states a fixed batch of {batch} (at most {MAX_BATCH} is evaluated); export it "
                       f"again with --dynamic or a smaller --batch-size.")
    for side in (height, width):
        if side is not None and not 0 < side <= MAX_SIDE:
            raise QATError(f"{source} states a fixed input of {height}x{width} pixels (at most {MAX_SIDE} a side is "
                           f"evaluated); export it again with --dynamic or a smaller --imgsz.")


@dataclass
class ArtifactMeta:
    """The self-description of an exported model; every field may be unknown (None)."""
    stride: int | None = None
    names: dict[int, str] | None = None
    task: str | None = None
    imgsz: list[int] | None = None

    @classmethod
    def read(cls, fields: Mapping[str, Any]) -> "ArtifactMeta":
        """From ONNX ``metadata_props`` (strings: this toolkit's export, or upstream YOLOv9's) or from an engine's
        ``X.engine.json`` (JSON values); other keys are ignored."""
        task = fields.get("task")
        return cls(stride=parse_stride(fields.get("stride")), names=parse_names(fields.get("names")),
                   task=str(task) if task else None, imgsz=_imgsz(fields.get("imgsz")))

    def props(self) -> dict[str, str]:
        """As ONNX ``metadata_props`` strings (the unknown fields left out)."""
        out: dict[str, str] = {}
        if self.stride is not None:
            out["stride"] = str(self.stride)
        if self.names is not None:
            out["names"] = json.dumps({str(k): v for k, v in self.names.items()})
        if self.task is not None:
            out["task"] = self.task
        if self.imgsz is not None:
            out["imgsz"] = json.dumps(list(self.imgsz))
        return out

    def sidecar(self) -> dict[str, Any]:
        """The fields as an engine's ``X.engine.json`` holds them (JSON types; None where unknown)."""
        return {"stride": self.stride,
                "names": {str(k): v for k, v in self.names.items()} if self.names else None,
                "imgsz": list(self.imgsz) if self.imgsz is not None else None,
                "task": self.task}


def read_props(model: Any) -> dict[str, str]:
    """The ``metadata_props`` of an ``onnx.ModelProto`` as a dict."""
    return {p.key: p.value for p in model.metadata_props}


def write_props(model: Any, props: Mapping[str, Any]) -> None:
    """Replace the ``metadata_props`` of an ``onnx.ModelProto``; non-string values are stored as JSON."""
    del model.metadata_props[:]
    for k, v in props.items():
        p = model.metadata_props.add()
        p.key = str(k)
        p.value = v if isinstance(v, str) else json.dumps(v)
