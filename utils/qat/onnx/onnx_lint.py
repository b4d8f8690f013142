"""The Q/DQ lint: what would stop TensorRT from running a Q/DQ ONNX fully in INT8, read through
:class:`utils.qat.onnx.onnx_qdq.QDQGraph`.

- :func:`lint` reports what would stop TensorRT from running a Q/DQ ONNX fully in INT8
  (explicit quantization); :func:`format_lint` turns the report into a short text.
- :func:`qdq_summary` gives the numbers the export CLI prints (the lint's counts and
  :func:`utils.qat.onnx.onnx_qdq.graph_io`); :func:`conv_feeds` what feeds each Conv, literally.

Scales and zero points may be initializers or ``Constant`` nodes, weights ``Q -> DQ`` of a float
initializer or ``DQ`` of an int8 initializer, as in onnx_qdq.py. No torch here.
"""
from __future__ import annotations

import fnmatch
from collections import defaultdict
from typing import Iterable

import numpy as np
import onnx

from utils.qat.onnx.onnx_graph import attr
from utils.qat.onnx.onnx_qdq import DQ, Q, ModelLike, QDQGraph, as_model, qkey, graph_io

__all__ = ["FINDING_KINDS", "lint", "format_lint", "qdq_summary", "conv_feeds"]

#: Every finding kind :func:`lint` can report, in report order.
FINDING_KINDS = (
    "conv_input_not_quantized",
    "conv_weight_not_quantized",
    "weight_scale_not_per_channel",
    "nonzero_zero_point",
    "nonpositive_scale",
    "concat_scale_mismatch",
    "maxpool_scale_mismatch",
    "resize_scale_mismatch",
    "add_single_quantized_input",
    "orphan_qdq",
    "qdq_on_unquantized_consumer",
    "duplicate_qdq",
)

CONV_OPS = {"Conv", "ConvTranspose"}
#: Ops a DQ may feed for the quantized tensor to be used by an INT8 kernel (or re-quantized).
QUANTIZED_CONSUMERS = {"Conv", "ConvTranspose", "Concat", "MaxPool", "AveragePool", "GlobalAveragePool",
                       "Resize", "Upsample", "Add", "Mul", "MatMul", "Gemm", Q}
#: Data-movement ops TensorRT moves DQ across; the lint looks through them to the real consumer.
PASS_THROUGH = {"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Split", "Slice", "Identity",
                "Gather", "Expand", "Tile", "Pad"}
RTOL = 1e-6
#: Conv nodes matching these (case-insensitive fnmatch on the node name) may stay FP: YOLOv9's DFL conv.
DEFAULT_ALLOW_FP = ("*dfl*",)


def _scales_equal(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    if a.size != b.size:
        return False
    return bool(np.all(np.abs(a - b) <= RTOL * np.maximum(np.abs(a), np.abs(b))))


def _axis(node: onnx.NodeProto, rank: int) -> int:
    ax = int(attr(node, "axis", 1))
    return ax + rank if ax < 0 else ax



# ---------------------------------------------------------------------------------------------
# lint
# ---------------------------------------------------------------------------------------------

def _weight_dq(g: QDQGraph, name: str) -> onnx.NodeProto | None:
    """The DQ quantizing a constant weight: DQ(int8 constant) or DQ(Q(float constant)); else None."""
    dq = g.dq_of(name)
    if dq is None:
        return None
    if g.is_static(dq.input[0]):
        return dq
    q = g.source(dq.input[0])
    if q is not None and q.op_type == Q and g.is_static(q.input[0]):
        return dq
    return None


def _weight_shape(g: QDQGraph, dq: onnx.NodeProto) -> tuple[int, ...] | None:
    shape = g.static_shape(dq.input[0])
    if shape is None:
        q = g.source(dq.input[0])
        if q is not None and q.op_type == Q:
            shape = g.static_shape(q.input[0])
    return shape


def _allowed_fp(node: onnx.NodeProto, patterns: tuple[str, ...]) -> bool:
    name = (node.name or (node.output[0] if node.output else "")).lower()
    return any(fnmatch.fnmatchcase(name, p.lower()) for p in patterns)


def _name(node: onnx.NodeProto) -> str:
    return node.name or f"{node.op_type}({node.output[0] if node.output else '?'})"


def _output_qs(g: QDQGraph, tensor: str) -> list[onnx.NodeProto]:
    return [c for c in g.real_consumers(tensor) if c.op_type == Q]


def _reaches_quantized_consumer(g: QDQGraph, tensor: str, seen: set[str] | None = None) -> bool:
    seen = set() if seen is None else seen
    if tensor in seen:
        return False
    seen.add(tensor)
    for c in g.consumers.get(tensor, []):
        if c.op_type in QUANTIZED_CONSUMERS:
            return True
        if (c.op_type in PASS_THROUGH or g.is_noop(c)) and c.input and c.input[0] == tensor:
            if any(_reaches_quantized_consumer(g, o, seen) for o in c.output if o):
                return True
    return False


def _int_type(g: QDQGraph, node: onnx.NodeProto, depth: int = 0) -> int | None:
    """The integer type a Q produces / a DQ consumes (None when it cannot be told)."""
    if len(node.input) > 2 and node.input[2]:
        return g.dtype(node.input[2])
    if node.op_type == Q:
        return int(attr(node, "output_dtype", 0)) or onnx.TensorProto.UINT8
    if g.is_static(node.input[0]):
        return g.dtype(node.input[0])
    src = g.source(node.input[0])
    if src is not None and src.op_type == Q and depth < 4:
        return _int_type(g, src, depth + 1)
    return None


def lint(model: ModelLike, allow_fp: Iterable[str] = DEFAULT_ALLOW_FP) -> dict:
    """Report what would stop TensorRT from running ``model`` (a Q/DQ ONNX) fully in INT8.

    ``allow_fp``: fnmatch patterns (case-insensitive, on the node name) of Conv nodes that are meant
    to stay floating point and are therefore not reported as unquantized: by default YOLOv9's DFL
    conv (``*dfl*``); add the layers you excluded from quantization (e.g. ``/model.22/*``).

    Finding kinds (``FINDING_KINDS``) and the node each one names:

    - ``conv_input_not_quantized`` (Conv / ConvTranspose): data input not produced by a DQ;
    - ``conv_weight_not_quantized`` (Conv): weight not DQ(int8 constant) nor DQ(Q(float constant));
    - ``weight_scale_not_per_channel`` (the weight DQ): per-tensor scale, or axis / scale count not
      the output channels (axis 0; ConvTranspose axis 1), when there is more than one output channel;
    - ``nonzero_zero_point`` (Q / DQ): zero point not 0, not int8, or absent (ONNX's default is uint8);
    - ``nonpositive_scale`` (Q / DQ): a constant scale that is 0, negative or not finite (TensorRT's ONNX
      parser rejects it: "Scale coefficients must all be positive"; an FP16 scale can underflow to 0);
    - ``concat_scale_mismatch`` (Concat): its DQ inputs, and the Q of its output, differ in scale;
    - ``maxpool_scale_mismatch`` / ``resize_scale_mismatch`` (MaxPool / nearest Resize or Upsample):
      input DQ scale differs from output Q scale;
    - ``add_single_quantized_input`` (Add): one input from a DQ, the other from a non-constant op
      (not a graph input); Adds with a constant input (decoding) are never flagged;
    - ``orphan_qdq`` (Q / DQ): output feeds nothing, or a Q feeds something other than a DQ;
    - ``qdq_on_unquantized_consumer`` (DQ): no consumer that TensorRT can run in INT8 (Conv, Concat,
      pools, Resize, Add, Mul, MatMul, Gemm, Q), looking through data-movement ops;
    - ``duplicate_qdq`` (the redundant Q / DQ, not the first one): a tensor (de)quantized more than
      once with identical parameters (looking through Identity / no-op Cast); :func:`dedupe_qdq`
      removes them.

    Scales are compared with a relative tolerance of 1e-6; duplicates need exact equality.

    Returns ``{"findings": {kind: {"count": n, "nodes": [names]}}, "total": N, "stats": {...}}``
    where only kinds with at least one finding appear; JSON-serialisable. ``stats``:
    ``quantize_linear``, ``dequantize_linear``, ``conv``, ``quantized_conv`` (input and weight
    quantized), ``fp_conv_allowed`` (convs matched by ``allow_fp``).
    """
    m = as_model(model)
    g = QDQGraph(m)
    allow = tuple(allow_fp or ())
    found: dict[str, dict[str, None]] = defaultdict(dict)  # kind -> node names, ordered, unique

    def add(kind: str, node: onnx.NodeProto) -> None:
        found[kind][_name(node)] = None

    stats = {"quantize_linear": 0, "dequantize_linear": 0, "conv": 0, "quantized_conv": 0, "fp_conv_allowed": 0}

    for n in g.nodes:
        op = n.op_type
        if op == Q:
            stats["quantize_linear"] += 1
        elif op == DQ:
            stats["dequantize_linear"] += 1

        if op in CONV_OPS:
            stats["conv"] += 1
            in_dq = g.dq_of(n.input[0])
            w_dq = _weight_dq(g, n.input[1]) if len(n.input) > 1 else None
            if in_dq is not None and w_dq is not None:
                stats["quantized_conv"] += 1
            if in_dq is None and w_dq is None and _allowed_fp(n, allow):
                stats["fp_conv_allowed"] += 1
                continue
            if in_dq is None:
                add("conv_input_not_quantized", n)
            if w_dq is None:
                add("conv_weight_not_quantized", n)
            else:
                shape = _weight_shape(g, w_dq)
                scale, _, _ = g.qparams(w_dq)
                if shape is not None and len(shape) >= 2:
                    # per output channel: Conv weight [K, C/g, ...] -> axis 0;
                    # ConvTranspose weight [C, K/g, ...] -> axis 1 (axis 0 accepted too).
                    ok_axes = (0,) if op == "Conv" else (1, 0)
                    out_ch = shape[0] if op == "Conv" else shape[1] * int(attr(n, "group", 1))
                    per_channel = scale is not None and scale.size > 1 and any(
                        _axis(w_dq, len(shape)) == ax and scale.size == shape[ax] for ax in ok_axes)
                    if out_ch > 1 and not per_channel:
                        add("weight_scale_not_per_channel", w_dq)

        elif op in (Q, DQ):
            scale, zp, zp_type = g.qparams(n)
            if scale is not None and not np.all(np.isfinite(scale.astype(np.float64)) & (scale > 0)):
                add("nonpositive_scale", n)
            if len(n.input) > 2 and n.input[2]:
                if zp is None or zp_type != onnx.TensorProto.INT8 or np.any(zp != 0):
                    add("nonzero_zero_point", n)
            elif _int_type(g, n) not in (None, onnx.TensorProto.INT8):
                add("nonzero_zero_point", n)  # no zero point: the ONNX default type is uint8
            out = n.output[0]
            cons = g.real_consumers(out)
            if op == Q:
                if not cons or out in g.graph_outputs or any(c.op_type != DQ for c in cons):
                    add("orphan_qdq", n)
            else:
                if not cons and out not in g.graph_outputs:
                    add("orphan_qdq", n)
                elif not _reaches_quantized_consumer(g, out):
                    add("qdq_on_unquantized_consumer", n)

        elif op == "Concat":
            dqs = [g.dq_of(i) for i in n.input if i]
            scales = [g.qparams(d)[0] for d in dqs if d is not None]
            scales += [g.qparams(q)[0] for q in _output_qs(g, n.output[0])]
            if any(not _scales_equal(scales[0], s) for s in scales[1:]):
                add("concat_scale_mismatch", n)

        elif op in ("MaxPool", "Resize", "Upsample"):
            if op != "MaxPool":
                mode = attr(n, "mode", b"nearest")
                mode = mode.decode() if isinstance(mode, bytes) else str(mode)
                if mode != "nearest":
                    continue
            dq_in = g.dq_of(n.input[0])
            qs = _output_qs(g, n.output[0])
            if dq_in is not None and qs:
                s_in = g.qparams(dq_in)[0]
                if any(not _scales_equal(s_in, g.qparams(q)[0]) for q in qs):
                    add("maxpool_scale_mismatch" if op == "MaxPool" else "resize_scale_mismatch", n)

        elif op == "Add":
            ins = [i for i in n.input if i]
            if len(ins) == 2 and not any(i in g.constant for i in ins):
                from_dq = [g.dq_of(i) is not None for i in ins]
                if sum(from_dq) == 1:
                    other = ins[from_dq.index(False)]
                    if g.source(other) is not None:  # produced by a (non-constant) op, not a graph input
                        add("add_single_quantized_input", n)

    # duplicate Q (and DQ) nodes: one tensor (de)quantized several times with identical parameters
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.nodes:
        if n.op_type in (Q, DQ) and n.input and n.input[0]:
            key = qkey(g, n)
            if key is not None:
                groups[(g.canon(n.input[0]), key)].append(n)
    for nodes in groups.values():
        for dup in nodes[1:]:
            add("duplicate_qdq", dup)

    findings = {k: {"count": len(found[k]), "nodes": list(found[k])} for k in FINDING_KINDS if found.get(k)}
    return {"findings": findings, "total": sum(f["count"] for f in findings.values()), "stats": stats}


def format_lint(report: dict, max_nodes: int = 3) -> str:
    """One line when clean; otherwise a header line and a small table (kind, count, first nodes)."""
    s = report.get("stats", {})
    fp = f", {s['fp_conv_allowed']} FP by choice" if s.get("fp_conv_allowed") else ""
    head = (f"Q/DQ lint: {{}} (Q {s.get('quantize_linear', 0)}, DQ {s.get('dequantize_linear', 0)}, "
            f"quantized convs {s.get('quantized_conv', 0)}/{s.get('conv', 0)}{fp})")
    if not report.get("total"):
        return head.format("clean")
    rows = []
    for kind, f in report["findings"].items():
        nodes = f["nodes"][:max_nodes]
        more = len(f["nodes"]) - len(nodes)
        rows.append((kind, str(f["count"]), ", ".join(nodes) + (f" (+{more} more)" if more > 0 else "")))
    w0 = max(len("kind"), *(len(r[0]) for r in rows))
    w1 = max(len("count"), *(len(r[1]) for r in rows))
    lines = [head.format(f"{report['total']} finding{'s' if report['total'] != 1 else ''}"),
             f"  {'kind':<{w0}}  {'count':>{w1}}  nodes"]
    lines += [f"  {k:<{w0}}  {c:>{w1}}  {n}" for k, c, n in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------

def qdq_summary(model: ModelLike, lint_report: dict | None = None) -> dict:
    """Numbers for the export printout: Q/DQ pairs, Q and DQ nodes, quantized / all convs, and
    :func:`graph_io`. ``lint_report``: :func:`lint` of this same graph when the caller has it (its
    counts do not depend on ``allow_fp``); otherwise the counts are linted here. JSON-serialisable."""
    m = as_model(model)
    g = QDQGraph(m)
    stats = (lint_report if lint_report is not None else lint(m, allow_fp=()))["stats"]
    pairs = sum(1 for n in g.nodes if n.op_type == DQ and (s := g.source(n.input[0])) is not None
                and s.op_type == Q)
    return {
        "qdq_pairs": pairs,
        "quantize_linear": stats["quantize_linear"],
        "dequantize_linear": stats["dequantize_linear"],
        "quantized_conv": stats["quantized_conv"],
        "conv": stats["conv"],
        **graph_io(m),
    }


def conv_feeds(model: ModelLike) -> dict[str, dict[str, int]]:
    """What feeds each Conv, literally (no look-through): ``{"input": {pattern: count}, "weight": {...}}`` with
    patterns such as ``"DequantizeLinear -> Conv"`` or ``"DequantizeLinear -> Cast(FLOAT16) -> Conv"`` (the chain
    of Casts between the producer and the Conv is spelled out; ``initializer`` / ``graph input`` when no node
    produces the tensor). TensorRT fuses DQ -> Conv into an INT8 convolution; a Cast in between is what
    ModelOpt removes "for optimal TRT fusion"."""
    m = as_model(model)
    producer = {o: n for n in m.graph.node for o in n.output}
    inits = {t.name for t in m.graph.initializer}

    def chain(name: str) -> str:
        links = []
        n = producer.get(name)
        while n is not None and n.op_type == "Cast":
            to = int(attr(n, "to", 0))
            links.append(f"Cast({onnx.TensorProto.DataType.Name(to) if to else '?'})")
            n = producer.get(n.input[0])
        head = n.op_type if n is not None else ("initializer" if name in inits else "graph input")
        return " -> ".join([head, *reversed(links), "Conv"])

    feeds: dict[str, dict[str, int]] = {"input": defaultdict(int), "weight": defaultdict(int)}
    for n in m.graph.node:
        if n.op_type == "Conv":
            feeds["input"][chain(n.input[0])] += 1
            if len(n.input) > 1:
                feeds["weight"][chain(n.input[1])] += 1
    return {k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in feeds.items()}
