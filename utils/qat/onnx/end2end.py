"""End2End graphs: NMS appended to an exported YOLOv9 ONNX, so the graph outputs final detections.

:func:`append_nms` works on the ONNX graph itself (no second exporter): it takes the plain export's
``output0`` (``B x (4 + nc [+ nm]) x A``: xywh boxes in input pixels, class scores, mask coefficients)
and, for segmentation, ``output1`` (``B x nm x H/4 x W/4`` prototypes), and replaces them with

    num_dets     (B, 1)    int32   number of valid detections per image
    det_boxes    (B, K, 4) float32 x1, y1, x2, y2 in input pixels (rows past num_dets are 0)
    det_scores   (B, K)    float32
    det_classes  (B, K)    int32
    det_masks    (B, K, R*R) float32 (segmentation only: sigmoid masks, R = mask_resolution, each
                                      pooled from the prototypes inside its box)

with K = ``topk_all``. Two back-ends give the same names, shapes and dtypes:

- ``onnx`` (the default): standard ONNX operators only (``NonMaxSuppression``, ``TopK``, ``GatherND``,
  ``RoiAlign``), which ONNX Runtime runs and TensorRT's parser maps to its native NMS layer (``INMSLayer``)
  and, for ``RoiAlign``, to TensorRT's own ROIAlign_TRT version 2 plugin. Stock TensorRT 10 and 11, no
  plugin library to pass.
- ``trt``: TensorRT's ``EfficientNMS_TRT`` plugin, domain ``TRT`` (deprecated since TensorRT 10.12:
  "use INMSLayer instead"; still in 11, as a deprecated V2 plugin). Segmentation: ``EfficientNMSX_TRT``,
  which is NOT in NVIDIA's plugin library (it comes from third-party plugin builds used with DeepStream;
  engines need that library: ``--plugins``), plus ``ROIAlign_TRT`` version 2. TensorRT's ONNX parser maps
  an op of another domain to the registered plugin of that name, ``plugin_version`` and
  ``plugin_namespace``. No CPU runtime implements these plugins; ONNX Runtime cannot run such a graph.

NMS is per class (a box may be kept for several classes, like upstream ``non_max_suppression`` with
``multi_label=True`` as val.py uses it) unless ``class_agnostic`` (best class per box, one NMS).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from utils.qat.core.artifact import END2END_OUTPUTS, MASK_OUTPUT
from utils.qat.core.errors import QATError

__all__ = ["BACKENDS", "NMSOptions", "append_nms"]

BACKENDS = ("onnx", "trt")
TRT_DOMAIN = "TRT"
MIN_OPSET = 13  # per-channel Q/DQ and the axes-as-input ReduceSum
#: The largest K both NVIDIA statements allow: ITopKLayer "values up to 3840" (NvInfer.h), onnx-tensorrt's
#: operators.md "K input must be less than 3840".
MAX_TOPK = 3839
#: ROIAlign_TRT version 2 (IPluginV3), in TensorRT's plugin library since 10.1; version 1 is deprecated (10.12).
ROIALIGN_PLUGIN_VERSION = "2"


@dataclass
class NMSOptions:
    """The End2End settings (the export CLI's --topk-all, --iou-thres, ... flags)."""
    backend: str = "onnx"
    topk_all: int = 100
    iou_thres: float = 0.45
    conf_thres: float = 0.25
    class_agnostic: bool = False
    mask_resolution: int = 56
    pooler_scale: float = 0.25
    sampling_ratio: int = 0

    def check(self) -> "NMSOptions":
        if self.backend not in BACKENDS:
            raise QATError(f"unknown NMS back-end '{self.backend}'; choose one of {', '.join(BACKENDS)}.")
        if not 1 <= int(self.topk_all) <= MAX_TOPK:
            raise QATError(f"--topk-all must be between 1 and {MAX_TOPK} (TensorRT's TopK limit), got {self.topk_all}.")
        if self.backend == "trt" and not 0.0 < float(self.iou_thres) <= 1.0:
            raise QATError(f"--iou-thres must be above 0 and at most 1 with --nms trt (EfficientNMS_TRT rejects "
                           f"iou_threshold <= 0), got {self.iou_thres}.")
        if not 0.0 <= float(self.iou_thres) <= 1.0:
            raise QATError(f"--iou-thres must be between 0 and 1, got {self.iou_thres}.")
        if not 0.0 <= float(self.conf_thres) < 1.0:
            raise QATError(f"--conf-thres must be in [0, 1), got {self.conf_thres}.")
        if int(self.mask_resolution) < 1:
            raise QATError(f"--mask-resolution must be a positive number of pixels, got {self.mask_resolution}.")
        if float(self.pooler_scale) <= 0:
            raise QATError(f"--pooler-scale must be positive (prototype size / input size), got {self.pooler_scale}.")
        if int(self.sampling_ratio) < 0:
            raise QATError(f"--sampling-ratio must be 0 (adaptive) or positive, got {self.sampling_ratio}.")
        return self

    def to_dict(self) -> dict:
        return asdict(self)


class _Builder:
    """Appends uniquely named nodes and constants under the ``/end2end/`` scope."""

    def __init__(self, model: onnx.ModelProto, opset: int):
        self.graph = model.graph
        self.opset = opset
        self.n = 0

    def name(self, stem: str) -> str:
        self.n += 1
        return f"/end2end/{stem}_{self.n}"

    def const(self, value, dtype, stem: str = "const") -> str:
        name = self.name(stem)
        self.graph.initializer.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def i64(self, *values: int) -> str:
        return self.const(list(values), np.int64, "i64")

    def op(self, op_type: str, inputs, n_out: int = 1, outputs=None, domain: str = "", **attrs):
        node_name = self.name(op_type)
        outs = list(outputs) if outputs is not None else [f"{node_name}_out{i}" for i in range(n_out)]
        self.graph.node.append(helper.make_node(op_type, list(inputs), outs, name=node_name, domain=domain, **attrs))
        return outs[0] if len(outs) == 1 else outs

    # -- opset-dependent forms
    def reduce(self, op_type: str, x: str, axes: list[int], keepdims: int) -> str:
        axes_as_input = self.opset >= (13 if op_type == "ReduceSum" else 18)
        if axes_as_input:
            return self.op(op_type, [x, self.i64(*axes)], keepdims=keepdims)
        return self.op(op_type, [x], axes=axes, keepdims=keepdims)

    def slice(self, x: str, start: int, end: int, axis: int) -> str:
        return self.op("Slice", [x, self.i64(start), self.i64(end), self.i64(axis)])

    def unsqueeze(self, x: str, axis: int) -> str:
        return self.op("Unsqueeze", [x, self.i64(axis)])


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _output(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    for o in model.graph.output:
        if o.name == name:
            return o
    have = ", ".join(o.name for o in model.graph.output)
    raise QATError(f"the exported graph has no output '{name}' (it has {have}); End2End needs the plain export's "
                   f"output0 (and output1 for segmentation).")


def _dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in vi.type.tensor_type.shape.dim]


def append_nms(model: onnx.ModelProto, *, nc: int, task: str = "detect", options: NMSOptions | None = None,
               pred: str = "output0", protos: str = "output1") -> onnx.ModelProto:
    """Return a copy of ``model`` whose outputs are the End2End detections (see the module docstring).

    ``nc``: number of classes (the rows of ``pred`` after the 4 box rows; the rest are mask
    coefficients for ``task="segment"``).
    """
    opts = (options or NMSOptions()).check()
    if task not in ("detect", "segment"):
        raise QATError(f"End2End export needs a detection or segmentation model, but this is a {task} model; "
                       f"export it with --include onnx.")
    opset = _opset(model)
    if opset < MIN_OPSET:
        raise QATError(f"End2End export needs opset {MIN_OPSET} or newer, got {opset}; pass --opset 17.")
    if opts.backend == "onnx" and task == "segment" and opset < 16:
        raise QATError("End2End segmentation with --nms onnx needs opset 16 or newer (RoiAlign half_pixel); "
                       "pass --opset 17.")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    pred_vi = _output(out, pred)
    pred_dims = _dims(pred_vi)
    if len(pred_dims) != 3:
        raise QATError(f"output '{pred}' has shape {pred_dims}; expected B x (4 + classes) x anchors.")
    rows = pred_dims[1]
    nm = 0
    if task == "segment":
        proto_vi = _output(out, protos)
        pdims = _dims(proto_vi)
        nm = pdims[1] if len(pdims) == 4 and isinstance(pdims[1], int) else None
        if not nm:
            raise QATError(f"output '{protos}' has shape {pdims}; expected B x masks x H x W prototypes.")
    if isinstance(rows, int) and rows != 4 + nc + nm:
        raise QATError(f"output '{pred}' has {rows} rows but 4 + {nc} classes{f' + {nm} masks' if nm else ''} "
                       f"were expected; the class count in the checkpoint does not match its head.")

    b = _Builder(out, opset)
    k = int(opts.topk_all)
    x = b.op("Transpose", [pred], perm=[0, 2, 1])  # B, A, C
    boxes_xywh = b.slice(x, 0, 4, 2)  # B, A, 4
    scores = b.slice(x, 4, 4 + nc, 2)  # B, A, nc
    coeffs = b.slice(x, 4 + nc, 4 + nc + nm, 2) if nm else None  # B, A, nm

    if opts.backend == "trt":
        indices = _nms_trt(b, boxes_xywh, scores, opts, with_indices=bool(nm))
    else:
        indices = _nms_onnx(b, boxes_xywh, scores, opts, with_indices=bool(nm))

    types = ((TensorProto.INT32, ["batch", 1]), (TensorProto.FLOAT, ["batch", k, 4]), (TensorProto.FLOAT, ["batch", k]),
             (TensorProto.INT32, ["batch", k]))  # num_dets, det_boxes, det_scores, det_classes
    new_outputs = [helper.make_tensor_value_info(name, dtype, shape) for name, (dtype, shape) in zip(END2END_OUTPUTS, types)]
    if nm:
        _masks(b, protos, coeffs, indices, nm, opts)
        r = int(opts.mask_resolution)
        new_outputs.append(helper.make_tensor_value_info(MASK_OUTPUT, TensorProto.FLOAT, ["batch", k, r * r]))
    batch = pred_dims[0]
    if isinstance(batch, int):
        for vi in new_outputs:
            vi.type.tensor_type.shape.dim[0].dim_value = batch
    elif isinstance(batch, str):
        for vi in new_outputs:
            vi.type.tensor_type.shape.dim[0].dim_param = batch
    del out.graph.output[:]
    out.graph.output.extend(new_outputs)
    if opts.backend == "trt" and not any(o.domain == TRT_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(TRT_DOMAIN, 1))
    return out


def _nms_trt(b: _Builder, boxes_xywh: str, scores: str, opts: NMSOptions, with_indices: bool):
    """EfficientNMS_TRT (or EfficientNMSX_TRT, which adds the kept anchors' indices) on xywh boxes."""
    attrs = dict(background_class=-1, box_coding=1, iou_threshold=float(opts.iou_thres),
                 max_output_boxes=int(opts.topk_all), plugin_version="1", score_activation=0,
                 score_threshold=float(opts.conf_thres), class_agnostic=int(bool(opts.class_agnostic)))
    if with_indices:
        outs = b.op("EfficientNMSX_TRT", [boxes_xywh, scores], domain=TRT_DOMAIN,
                    outputs=[*END2END_OUTPUTS, "/end2end/det_indices"], **attrs)
        return outs[-1]  # (B, K) int32 anchor index of each detection
    b.op("EfficientNMS_TRT", [boxes_xywh, scores], domain=TRT_DOMAIN, outputs=list(END2END_OUTPUTS), **attrs)
    return None


def _nms_onnx(b: _Builder, boxes_xywh: str, scores: str, opts: NMSOptions, with_indices: bool):
    """NonMaxSuppression, then a fixed-size top-K per image built from standard ops.

    NonMaxSuppression returns the kept (batch, class, anchor) triples of the whole batch, N of them. Each
    image's row of a (B, N) score matrix holds the kept scores of that image and -1 elsewhere; K more
    columns of -1 make TopK(K) valid for any N (including 0). Entries with a score below 0 are padding.
    """
    k = int(opts.topk_all)
    xy = b.slice(boxes_xywh, 0, 2, 2)
    half_wh = b.op("Mul", [b.slice(boxes_xywh, 2, 4, 2), b.const(0.5, np.float32)])
    boxes = b.op("Concat", [b.op("Sub", [xy, half_wh]), b.op("Add", [xy, half_wh])], axis=2)  # B, A, 4 xyxy
    if opts.class_agnostic:
        best = b.reduce("ReduceMax", scores, [2], keepdims=1)  # B, A, 1
        nms_scores = b.op("Transpose", [best], perm=[0, 2, 1])  # B, 1, A
        best_class = b.op("ArgMax", [scores], axis=2, keepdims=0)  # B, A
    else:
        nms_scores = b.op("Transpose", [scores], perm=[0, 2, 1])  # B, nc, A
    selected = b.op("NonMaxSuppression", [boxes, nms_scores, b.i64(k), b.const([opts.iou_thres], np.float32),
                                          b.const([opts.conf_thres], np.float32)], center_point_box=0)  # N, 3
    sel_batch = b.op("Gather", [selected, b.const(0, np.int64)], axis=1)  # N
    sel_anchor_idx = b.op("Gather", [selected, b.i64(0, 2)], axis=1)  # N, 2 (batch, anchor)
    sel_scores = b.op("GatherND", [nms_scores, selected])  # N
    sel_boxes = b.op("GatherND", [boxes, sel_anchor_idx])  # N, 4
    if opts.class_agnostic:
        sel_classes = b.op("GatherND", [best_class, sel_anchor_idx])  # N
    else:
        sel_classes = b.op("Gather", [selected, b.const(1, np.int64)], axis=1)  # N

    # (B, N) matrix: the score where the detection belongs to the row's image, -1 elsewhere
    batch_size = b.op("Gather", [b.op("Shape", [boxes]), b.const(0, np.int64)], axis=0)
    rows = b.unsqueeze(b.op("Range", [b.const(0, np.int64), batch_size, b.const(1, np.int64)]), 1)  # B, 1
    mine = b.op("Equal", [rows, b.unsqueeze(sel_batch, 0)])  # B, N
    dense = b.op("Where", [mine, b.unsqueeze(sel_scores, 0), b.const(-1.0, np.float32)])
    dense = b.op("Pad", [dense, b.i64(0, 0, 0, k), b.const(-1.0, np.float32)], mode="constant")  # B, N + K
    top_scores, top_idx = b.op("TopK", [dense, b.i64(k)], n_out=2, axis=1, largest=1, sorted=1)  # B, K
    valid = b.op("Greater", [top_scores, b.const(-0.5, np.float32)])  # B, K

    num_dets, det_boxes, det_scores, det_classes = END2END_OUTPUTS
    b.op("Cast", [b.reduce("ReduceSum", b.op("Cast", [valid], to=TensorProto.FLOAT), [1], keepdims=1)],
         outputs=[num_dets], to=TensorProto.INT32)
    b.op("Where", [valid, top_scores, b.const(0.0, np.float32)], outputs=[det_scores])
    padded_boxes = b.op("Pad", [sel_boxes, b.i64(0, 0, k, 0), b.const(0.0, np.float32)], mode="constant")
    boxes_k = b.op("Gather", [padded_boxes, top_idx], axis=0)  # B, K, 4
    b.op("Where", [b.unsqueeze(valid, 2), boxes_k, b.const(0.0, np.float32)], outputs=[det_boxes])
    padded_classes = b.op("Pad", [b.op("Cast", [sel_classes], to=TensorProto.INT32), b.i64(0, k),
                                  b.const(0, np.int32)], mode="constant")
    classes_k = b.op("Gather", [padded_classes, top_idx], axis=0)  # B, K
    b.op("Where", [valid, classes_k, b.const(0, np.int32)], outputs=[det_classes])
    if not with_indices:
        return None
    sel_anchor = b.op("Gather", [selected, b.const(2, np.int64)], axis=1)  # N
    padded_anchor = b.op("Pad", [sel_anchor, b.i64(0, k), b.const(0, np.int64)], mode="constant")
    anchors_k = b.op("Gather", [padded_anchor, top_idx], axis=0)  # B, K
    return b.op("Where", [valid, anchors_k, b.const(0, np.int64)])


def _masks(b: _Builder, protos: str, coeffs: str, indices: str, nm: int, opts: NMSOptions) -> None:
    """det_masks: each detection's mask coefficients times the prototypes pooled inside its box."""
    k, r = int(opts.topk_all), int(opts.mask_resolution)
    num_dets, det_boxes = END2END_OUTPUTS[:2]
    idx = b.op("Cast", [indices], to=TensorProto.INT64)  # B, K
    batch_size = b.op("Gather", [b.op("Shape", [idx]), b.const(0, np.int64)], axis=0)
    rows = b.unsqueeze(b.op("Range", [b.const(0, np.int64), batch_size, b.const(1, np.int64)]), 1)  # B, 1
    batch_idx = b.op("Mul", [rows, b.op("ConstantOfShape", [b.op("Shape", [idx])],
                                        value=numpy_helper.from_array(np.ones(1, np.int64)))])  # B, K
    pairs = b.op("Concat", [b.unsqueeze(batch_idx, 2), b.unsqueeze(idx, 2)], axis=2)  # B, K, 2
    det_coeffs = b.op("Reshape", [b.op("GatherND", [coeffs, pairs]), b.i64(-1, 1, nm)])  # B*K, 1, nm
    rois = b.op("Reshape", [det_boxes, b.i64(-1, 4)])  # B*K, 4
    flat_batch = b.op("Reshape", [batch_idx, b.i64(-1)])  # B*K
    if opts.backend == "trt":
        pooled = b.op("ROIAlign_TRT", [protos, rois, b.op("Cast", [flat_batch], to=TensorProto.INT32)],
                      domain=TRT_DOMAIN, plugin_version=ROIALIGN_PLUGIN_VERSION, coordinate_transformation_mode=1,
                      mode=1, output_height=r, output_width=r, sampling_ratio=int(opts.sampling_ratio),
                      spatial_scale=float(opts.pooler_scale))
    else:
        pooled = b.op("RoiAlign", [protos, rois, flat_batch], coordinate_transformation_mode="half_pixel",
                      mode="avg", output_height=r, output_width=r, sampling_ratio=int(opts.sampling_ratio),
                      spatial_scale=float(opts.pooler_scale))  # B*K, nm, R, R
    pooled = b.op("Reshape", [pooled, b.i64(-1, nm, r * r)])
    masks = b.op("Sigmoid", [b.op("MatMul", [det_coeffs, pooled])])  # B*K, 1, R*R
    masks = b.op("Reshape", [masks, b.i64(-1, k, r * r)])  # B, K, R*R
    # rows past num_dets are 0, like the other outputs
    valid = b.op("Less", [b.unsqueeze(b.op("Range", [b.const(0, np.int64), b.const(k, np.int64),
                                                      b.const(1, np.int64)]), 0),
                          b.op("Cast", [num_dets], to=TensorProto.INT64)])  # B, K
    b.op("Where", [b.unsqueeze(valid, 2), masks, b.const(0.0, np.float32)], outputs=[MASK_OUTPUT])
