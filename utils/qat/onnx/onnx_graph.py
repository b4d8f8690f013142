"""Small ONNX graph helpers shared by the exporter, the Q/DQ tools and the TensorRT side.

- :func:`toposort` puts a graph's nodes back in dependency order after an edit.
- :func:`constant_node_value` / :func:`constant_node_dtype` read a ``Constant`` node (every ``value*``
  attribute form); :func:`constant_value` finds a tensor's value among initializers and ``Constant`` nodes.
- :func:`tensor_types` maps tensor names to ONNX element types (declared, initializer, ``Constant``,
  ``Cast``, or shape-inferred).
- :func:`graph_inputs` and :func:`input_dims` read the real inputs of a graph (initializers left out).

No torch here; nothing is modified except by :func:`toposort`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["attr", "toposort", "constant_node_value", "constant_node_dtype", "constant_value", "tensor_types",
           "graph_inputs", "input_dims"]


def attr(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    """The value of a node attribute, or ``default`` when the node does not set it."""
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def toposort(graph: onnx.GraphProto) -> None:
    """Reorder ``graph.node`` in place so that every node comes after the producers of its inputs.

    Nodes whose inputs never become available (a name from an outer scope, or a cycle) keep their
    original relative order at the end."""
    nodes = list(graph.node)
    available = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    order: list[onnx.NodeProto] = []
    pending = list(range(len(nodes)))
    while pending:
        progressed, rest = False, []
        for k in pending:
            n = nodes[k]
            if all(i in available for i in n.input):
                order.append(n)
                available.update(n.output)
                progressed = True
            else:
                rest.append(k)
        if not progressed:
            order.extend(nodes[k] for k in rest)
            break
        pending = rest
    del graph.node[:]
    graph.node.extend(order)


def constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The tensor a ``Constant`` node holds (``value``, ``value_float(s)``, ``value_int(s)``), else None."""
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None


def constant_node_dtype(node: onnx.NodeProto) -> int | None:
    """The ONNX element type of a ``Constant`` node's output, else None."""
    for a in node.attribute:
        if a.name == "value":
            return a.t.data_type
        if a.name in ("value_float", "value_floats"):
            return onnx.TensorProto.FLOAT
        if a.name in ("value_int", "value_ints"):
            return onnx.TensorProto.INT64
    return None


def constant_value(graph: onnx.GraphProto, name: str,
                   inits: dict[str, onnx.TensorProto] | None = None) -> np.ndarray | None:
    """The value of tensor ``name`` when it is an initializer or a ``Constant`` output, else None.
    ``inits``: the graph's initializers by name, when the caller already has them."""
    inits = {t.name: t for t in graph.initializer} if inits is None else inits
    if name in inits:
        return numpy_helper.to_array(inits[name])
    for n in graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] == name:
            return constant_node_value(n)
    return None


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor onnx can tell (declared, Constant, Cast, or shape-inferred)."""
    g = model.graph
    types: dict[str, int] = {}
    for v in list(g.input) + list(g.output) + list(g.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    types.update({t.name: t.data_type for t in g.initializer})
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        for v in inferred.graph.value_info:
            if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
                types.setdefault(v.name, v.type.tensor_type.elem_type)
    except Exception:  # > 2 GB protos, unknown custom ops: fall back to what is declared
        pass
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            t = constant_node_dtype(n)
            if t:
                types.setdefault(n.output[0], t)
        elif n.op_type == "Cast" and n.output:
            types.setdefault(n.output[0], int(attr(n, "to", 0)))
    return types


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller feeds (old exporters list initializers among the graph inputs too)."""
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def input_dims(value: onnx.ValueInfoProto) -> list[int | None]:
    """The dims of a graph input or output; None for a dynamic (symbolic or unset) dim."""
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
            for d in value.type.tensor_type.shape.dim]
