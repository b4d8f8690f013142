"""Pure ONNX graph tools for Q/DQ (QuantizeLinear / DequantizeLinear) models: the graph view and its rewriting.

- :class:`QDQGraph` indexes one graph (producers, consumers, constants, no-op casts, Q/DQ parameters);
  the Q/DQ lint (utils/qat/onnx/onnx_lint.py) reads graphs through it too.
- :func:`dedupe_qdq` merges the redundant Q/DQ the torch exporter leaves (one tensor quantized
  several times with identical parameters) without changing a single output bit.
- :func:`simplify` runs onnxslim and checks that every Q/DQ (and its scale) survives.
- :func:`graph_io` gives the opset and the graph's inputs / outputs the export CLI prints.

Scales and zero points may be initializers or ``Constant`` nodes (the torch exporter emits
``Constant`` nodes; onnxslim turns them into initializers); both are understood everywhere.
Weights may be quantized as ``Q -> DQ`` of a float initializer (modelopt's fake-quant export) or
as ``DQ`` of an int8 initializer. No torch here; onnxslim is imported only by :func:`simplify`.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
from onnx import numpy_helper

from utils.qat.onnx.onnx_graph import attr, constant_node_dtype, constant_node_value, tensor_types, toposort

__all__ = ["Q", "DQ", "ModelLike", "as_model", "QDQGraph", "qkey", "dedupe_qdq", "simplify", "graph_io"]

Q, DQ = "QuantizeLinear", "DequantizeLinear"

#: A model in memory or the path of an .onnx file.
ModelLike = Union[onnx.ModelProto, str, Path]


# ---------------------------------------------------------------------------------------------
# graph index
# ---------------------------------------------------------------------------------------------

def as_model(model: ModelLike) -> onnx.ModelProto:
    """The model itself, or the one loaded from the path."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (str, Path)):
        return onnx.load(str(model))
    raise TypeError(f"expected an onnx.ModelProto or a path, got {type(model).__name__}")


class QDQGraph:
    """Producer / consumer / constant index of one ONNX graph (the main graph only)."""

    def __init__(self, model: onnx.ModelProto):
        g = model.graph
        self.model = model
        self.nodes = list(g.node)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        self.init = {t.name: t for t in g.initializer}
        self.const_nodes: dict[str, onnx.NodeProto] = {}
        self.graph_outputs = {o.name for o in g.output}
        self._values: dict[str, np.ndarray | None] = {}
        self._types: dict[str, int] | None = None
        for n in self.nodes:
            for o in n.output:
                if o:
                    self.producer[o] = n
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
            if n.op_type == "Constant" and n.output:
                self.const_nodes[n.output[0]] = n
        self.constant = self._constant_tensors()

    def _constant_tensors(self) -> set[str]:
        """Tensors that do not depend on any graph input (initializers, Constant, and ops of those)."""
        const = set(self.init) | set(self.const_nodes)
        graph_inputs = {i.name for i in self.model.graph.input} - set(self.init)
        for n in self.nodes:  # exported graphs are topologically sorted
            if n.op_type == "Constant":
                continue
            ins = [i for i in n.input if i]
            if ins and all(i in const and i not in graph_inputs for i in ins) and not _has_subgraph(n):
                const.update(o for o in n.output if o)
        return const

    def value(self, name: str) -> np.ndarray | None:
        """The value of an initializer / Constant output (through Identity), else None."""
        if name in self._values:
            return self._values[name]
        v = None
        if name in self.init:
            v = numpy_helper.to_array(self.init[name])
        elif name in self.const_nodes:
            v = constant_node_value(self.const_nodes[name])
        else:
            p = self.producer.get(name)
            if p is not None and p.op_type == "Identity":
                v = self.value(p.input[0])
        self._values[name] = v
        return v

    def static_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of an initializer / Constant (through Identity) without decoding big initializers."""
        if name in self.init:
            return tuple(self.init[name].dims)
        v = self.value(name)
        return None if v is None else tuple(v.shape)

    def dtype(self, name: str) -> int | None:
        if name in self.init:
            return self.init[name].data_type
        if name in self.const_nodes:
            return constant_node_dtype(self.const_nodes[name])
        p = self.producer.get(name)
        if p is not None and p.op_type == "Identity":
            return self.dtype(p.input[0])
        return None

    def is_static(self, name: str) -> bool:
        """An initializer or Constant (possibly through Identity)."""
        if name in self.init or name in self.const_nodes:
            return True
        p = self.producer.get(name)
        return p is not None and p.op_type == "Identity" and self.is_static(p.input[0])

    # -- no-op casts: modelopt's INT8 export leaves Cast(to=FLOAT) of float tensors behind each
    #    input quantizer, and later quantizers of the same tensor read through a chain of them.
    def elem_type(self, name: str) -> int | None:
        if self._types is None:
            self._types = tensor_types(self.model)
        return self._types.get(name)

    def is_noop(self, node: onnx.NodeProto) -> bool:
        """Identity, or a Cast to the type its input already has."""
        if node.op_type == "Identity":
            return True
        if node.op_type != "Cast" or not node.input:
            return False
        to = attr(node, "to")
        src = self.producer.get(node.input[0])
        if src is not None and src.op_type == "Cast" and attr(src, "to") == to:
            return True
        return to is not None and self.elem_type(node.input[0]) == to

    def canon(self, name: str) -> str:
        """``name`` with Identity / no-op Cast producers looked through."""
        p = self.producer.get(name)
        while p is not None and self.is_noop(p):
            name = p.input[0]
            p = self.producer.get(name)
        return name

    def source(self, name: str) -> onnx.NodeProto | None:
        """The node producing ``name``, looking through Identity and no-op Cast."""
        return self.producer.get(self.canon(name))

    def dq_of(self, name: str) -> onnx.NodeProto | None:
        p = self.source(name)
        return p if p is not None and p.op_type == DQ else None

    def real_consumers(self, name: str) -> list[onnx.NodeProto]:
        """Consumers of ``name``, looking through Identity / no-op Cast (unless it makes a graph output)."""
        out = []
        for c in self.consumers.get(name, []):
            if self.is_noop(c) and c.output[0] not in self.graph_outputs:
                out.extend(self.real_consumers(c.output[0]))
            else:
                out.append(c)
        return out

    def qparams(self, node: onnx.NodeProto) -> tuple[np.ndarray | None, np.ndarray | None, int | None]:
        """(scale, zero point, zero-point dtype) of a Q/DQ node; None where absent or not constant."""
        scale = self.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if len(node.input) > 2 and node.input[2]:
            return scale, self.value(node.input[2]), self.dtype(node.input[2])
        return scale, None, None


def _has_subgraph(node: onnx.NodeProto) -> bool:
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def qkey(g: QDQGraph, node: onnx.NodeProto) -> tuple | None:
    """Exact identity of a Q/DQ's parameters (scale, zero point, attributes); None if not constant."""
    scale, zp, zp_type = g.qparams(node)
    if scale is None or (len(node.input) > 2 and node.input[2] and zp is None):
        return None
    parts = [node.op_type, node.domain or "", scale.dtype.str, scale.shape, scale.tobytes()]
    parts += [None] if zp is None else [zp_type, zp.dtype.str, zp.shape, zp.tobytes()]
    attrs = sorted((a.name, a.SerializeToString()) for a in node.attribute if a.name != "axis")
    if scale.size > 1:  # axis only matters for per-channel parameters
        parts.append(int(attr(node, "axis", 1)))
    parts.append(tuple(attrs))
    return tuple(parts)


# ---------------------------------------------------------------------------------------------
# dedupe
# ---------------------------------------------------------------------------------------------

def _rename_inputs(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename node inputs (also inside subgraphs, which may reference outer tensors)."""
    for n in graph.node:
        for k, i in enumerate(n.input):
            if i in mapping:
                n.input[k] = mapping[i]
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                _rename_inputs(a.g, mapping)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sg in a.graphs:
                    _rename_inputs(sg, mapping)


def _merge_once(model: onnx.ModelProto, op: str) -> int:
    """Merge ``op`` nodes that read the same tensor with identical parameters; return how many went."""
    g = QDQGraph(model)
    groups: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    for n in g.nodes:
        if n.op_type == op and n.input and n.input[0]:
            key = qkey(g, n)
            if key is not None:
                groups[(g.canon(n.input[0]), key)].append(n)
    mapping: dict[str, str] = {}
    drop: set[int] = set()
    for nodes in groups.values():
        keep = next((x for x in nodes if x.output[0] in g.graph_outputs), nodes[0])
        for dup in nodes:
            if dup is keep or dup.output[0] in g.graph_outputs:
                continue
            mapping[dup.output[0]] = keep.output[0]
            drop.add(id(dup))
    if not drop:
        return 0
    graph = model.graph
    kept = [n for n in graph.node if id(n) not in drop]
    # keep topological order: a kept node that came after a dropped duplicate may now feed the
    # duplicate's consumers, which could precede it; re-sort.
    del graph.node[:]
    graph.node.extend(kept)
    _rename_inputs(graph, mapping)
    toposort(graph)
    return len(drop)


def _prune_unused_constants(model: onnx.ModelProto, candidates: set[str]) -> None:
    graph = model.graph
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    used |= _subgraph_inputs(graph)
    keep = [n for n in graph.node
            if not (n.op_type == "Constant" and n.output[0] in candidates and n.output[0] not in used)]
    if len(keep) != len(graph.node):
        del graph.node[:]
        graph.node.extend(keep)
    keep_init = [t for t in graph.initializer if not (t.name in candidates and t.name not in used)]
    if len(keep_init) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep_init)


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    names = set()
    for n in graph.node:
        for a in n.attribute:
            subs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sg in subs:
                names |= {i for sn in sg.node for i in sn.input} | _subgraph_inputs(sg)
    return names


def dedupe_qdq(model: ModelLike) -> tuple[onnx.ModelProto, int]:
    """Merge redundant Q/DQ: a tensor quantized by several Q nodes with identical scale / zero point /
    axis keeps one Q (consumers rewired to it), then DQ nodes reading one tensor with identical
    parameters collapse to one. Outputs are unchanged bit for bit. Returns (new model, nodes removed).
    The input model is not modified.
    """
    src = as_model(model)
    out = onnx.ModelProto()
    out.CopyFrom(src)
    candidates = {i for n in out.graph.node if n.op_type in (Q, DQ) for i in n.input[1:] if i}
    dead_before = _dead_nodes(out.graph)
    removed = 0
    while True:
        step = _merge_once(out, Q) + _merge_once(out, DQ)
        if not step:
            break
        removed += step
    if removed:
        _prune_unused_constants(out, candidates)
        _prune_dead(out.graph, keep=dead_before)
    return out, removed


_PRUNABLE = {"Cast", "Identity", "Constant"}


def _dead_nodes(graph: onnx.GraphProto) -> set[str]:
    """Names of output tensors of prunable nodes nobody reads."""
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output} | _subgraph_inputs(graph)
    return {n.output[0] for n in graph.node if n.op_type in _PRUNABLE and n.output
            and not any(o in used for o in n.output)}


def _prune_dead(graph: onnx.GraphProto, keep: set[str]) -> None:
    """Drop the Cast / Identity / Constant nodes the merge left without readers (those that were
    already dead before, ``keep``, stay: dedupe only removes what it made redundant)."""
    while True:
        dead = _dead_nodes(graph) - keep
        if not dead:
            return
        kept = [n for n in graph.node if not (n.op_type in _PRUNABLE and n.output and n.output[0] in dead)]
        del graph.node[:]
        graph.node.extend(kept)


# ---------------------------------------------------------------------------------------------
# simplify
# ---------------------------------------------------------------------------------------------

def _qdq_signature(model: onnx.ModelProto) -> dict:
    g = QDQGraph(model)
    sig: dict[str, list] = {Q: [], DQ: []}
    for n in g.nodes:
        if n.op_type in sig:
            scale, zp, zp_type = g.qparams(n)
            sig[n.op_type].append((
                None if scale is None else (scale.dtype.str, scale.shape, scale.tobytes()),
                None if zp is None else (zp_type, zp.shape, zp.tobytes()),
                int(attr(n, "axis", 1)) if scale is not None and scale.size > 1 else None))
    return {k: sorted(v, key=repr) for k, v in sig.items()}


def simplify(model: ModelLike, **slim_kwargs: Any) -> onnx.ModelProto:
    """onnxslim the model, keeping every Q/DQ: redundant Q/DQ are merged first (:func:`dedupe_qdq`,
    which onnxslim's common-subexpression pass would otherwise do behind the check's back), then the
    number of QuantizeLinear / DequantizeLinear nodes and their scales / zero points / axes are
    checked to be unchanged by onnxslim. ``slim_kwargs`` go to ``onnxslim.slim``. (onnxslim 0.1.98 never constant-folds Q/DQ — its folder lists
    them as non-foldable; should a later version fold them, the slim is retried without constant
    folding.) Raises ``RuntimeError`` when onnxslim fails or Q/DQ would be lost; the caller decides.
    """
    import onnxslim  # type: ignore[import-untyped]  # heavy, optional: only here

    base, _ = dedupe_qdq(model)
    want = _qdq_signature(base)
    attempts = [dict(slim_kwargs),
                {**slim_kwargs, "skip_optimizations": sorted(set(slim_kwargs.get("skip_optimizations") or [])
                                                              | {"constant_folding"})}]
    problem = ""
    for kwargs in attempts:
        work = onnx.ModelProto()
        work.CopyFrom(base)
        try:
            slim = onnxslim.slim(work, **kwargs)
        except Exception as e:  # onnxslim raises many types
            raise RuntimeError(f"onnxslim failed: {type(e).__name__}: {e}") from e
        if slim is None:
            raise RuntimeError("onnxslim returned no model (its output check failed)")
        got = _qdq_signature(slim)
        if got == want:
            return slim
        problem = (f"Q {len(want[Q])}->{len(got[Q])}, DQ {len(want[DQ])}->{len(got[DQ])}"
                   + ("" if len(got[Q]) != len(want[Q]) or len(got[DQ]) != len(want[DQ]) else ", scales changed"))
    raise RuntimeError(f"onnxslim changed the Q/DQ nodes ({problem}); export without simplification")


# ---------------------------------------------------------------------------------------------
# graph inputs / outputs
# ---------------------------------------------------------------------------------------------

def _value_info(v: onnx.ValueInfoProto) -> dict:
    t = v.type.tensor_type
    shape = None
    if t.HasField("shape"):
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
    dtype = onnx.TensorProto.DataType.Name(t.elem_type).lower() if t.elem_type else None
    return {"name": v.name, "shape": shape, "dtype": dtype}


def graph_io(model: ModelLike) -> dict:
    """Opset and inputs / outputs (name, dims as ints, symbolic names or None when unknown, dtype) of a
    graph. JSON-serialisable."""
    m = as_model(model)
    inits = {t.name for t in m.graph.initializer}
    return {
        "opset": next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), None),
        "inputs": [_value_info(v) for v in m.graph.input if v.name not in inits],
        "outputs": [_value_info(v) for v in m.graph.output],
    }
