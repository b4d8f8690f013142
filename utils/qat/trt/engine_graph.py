"""Engine graphs and precision summaries from TensorRT layer information (``trtexec --exportLayerInfo``).

The layer JSON (``trtexec --exportLayerInfo``, or ``IEngineInspector.get_engine_information`` for engines
built by ``utils.qat.trt.trt_engine``) is ``{"Layers": [...], "Bindings": [...]}`` (TensorRT 10) or
``{"Layers": [...], "I/O Tensors": [{...}]}`` (TensorRT 11: "Migrating IEngineInspector Usage from
TensorRT 10.x to 11.x"). With ``--profilingVerbosity=detailed`` every layer is a dict with ``Name``,
``LayerType``, ``Inputs``/``Outputs`` (``Name``, ``Dimensions``, and the data type: one
``Format/Datatype`` string on 10, which the 11.0 migration overview announces is split in two; the split
layout is not spelled out field by field in NVIDIA's pages, so a separate ``DataType``/``Datatype`` is read
first, then ``Format/Datatype``, then ``Format``), and for convolutions ``Weights`` (``Type``, ``Count``);
with the default verbosity layers are bare names and only the layer count is known.

:func:`render_graph` draws the graph to SVG with TREx (``trex``, ``./install_dependencies.sh --trex``)
when it is importable and the JSON is TensorRT 10's (TREx reads ``Bindings`` and ``Format/Datatype`` only;
it was removed from TensorRT in 11.1, replaced by Nsight Deep Learning Designer), else as plain Graphviz
DOT written here (rendered with the ``dot`` binary when present, else the ``.dot`` is kept and the command
to render it is printed).
:func:`precision_summary` answers "how much runs in INT8": layers per output datatype, reformats.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from utils.qat.core.atomic import atomic_path, write_text
from utils.qat.core.errors import QATError, run_cli

PathLike = Union[str, "os.PathLike[str]"]
INSTALL_TREX = "./install_dependencies.sh --trex"
NSIGHT_DL_DESIGNER = "Nsight Deep Learning Designer (https://developer.nvidia.com/nsight-dl-designer)"
PRECISION_ORDER = ("INT8", "FP8", "INT4", "FP4", "FP16", "BF16", "FP32", "INT32", "INT64", "UINT8", "BOOL", "unknown")
COLORS = {"INT8": "#76b900", "FP8": "#a6d854", "INT4": "#b3de69", "FP4": "#b3de69", "FP16": "#6baed6",
          "BF16": "#9ecae1", "FP32": "#fb6a4a", "INT32": "#bdbdbd", "INT64": "#bdbdbd", "UINT8": "#bdbdbd",
          "BOOL": "#bdbdbd", "unknown": "#ffffff"}
_DTYPE = re.compile(r"\b(FP32|FP16|BF16|FP8|FP4|INT8|INT4|INT32|INT64|UINT8|BOOL|Float|Half|Int8|Int32|Int64)\b",
                    re.IGNORECASE)
_ALIASES = {"FLOAT": "FP32", "HALF": "FP16"}
_SKIP_TYPES = {"Constant", "NoOp"}


def load_layer_info(path: PathLike) -> dict[str, Any]:
    """Read an ``--exportLayerInfo`` JSON; a bare list of layers is accepted too."""
    p = Path(path)
    if not p.is_file():
        raise QATError(f"layer-info file {p} not found; build with scripts/generate_trt_engine.sh ONNX ENGINE "
                       f"--graph (trtexec --exportLayerInfo=... --profilingVerbosity=detailed).")
    try:
        doc = json.loads(p.read_text(errors="replace"))
    except ValueError as e:
        raise QATError(f"{p} is not valid JSON ({e}); re-export it with trtexec --exportLayerInfo.") from e
    if isinstance(doc, list):
        doc = {"Layers": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("Layers"), list):
        raise QATError(f"{p} has no 'Layers' list; it is not trtexec --exportLayerInfo output.")
    return doc


def datatype(fmt: str | None) -> str:
    """``"Thirty-two wide channel vectorized row major Int8 format."`` -> ``"INT8"``."""
    if not fmt:
        return "unknown"
    m = _DTYPE.search(fmt)
    if not m:
        return "unknown"
    t = m.group(1).upper()
    return _ALIASES.get(t, t)


def _tensors(layer: dict[str, Any], key: str) -> list[dict[str, Any]]:
    items = layer.get(key) or []
    return [t for t in items if isinstance(t, dict)]


def tensor_dtype(tensor: dict[str, Any]) -> str:
    """A layer tensor's data type: ``DataType``/``Datatype`` (TensorRT 11's split fields), else the
    ``Format/Datatype`` string (TensorRT 10), else the ``Format`` string."""
    for key in ("DataType", "Datatype", "Format/Datatype", "Format"):
        value = tensor.get(key)
        if value:
            found = datatype(str(value))
            if found != "unknown":
                return found
    return "unknown"


def layer_output_dtype(layer: dict[str, Any] | str) -> str:
    if not isinstance(layer, dict):
        return "unknown"
    outs = _tensors(layer, "Outputs")
    return tensor_dtype(outs[0]) if outs else "unknown"


def is_reformat(layer: dict[str, Any] | str) -> bool:
    if isinstance(layer, dict):
        return "Reformat" in (str(layer.get("LayerType", "")), str(layer.get("ParameterType", "")))
    return False


def _io_names(doc: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Engine inputs and outputs: TensorRT 11's "I/O Tensors", else TensorRT 10's "Bindings" classified by use."""
    io = doc.get("I/O Tensors")
    if isinstance(io, list):
        ins = [t["Name"] for t in io if isinstance(t, dict) and str(t.get("IOMode", "")).lower() == "input"]
        outs = [t["Name"] for t in io if isinstance(t, dict) and str(t.get("IOMode", "")).lower() == "output"]
        return ins, outs
    layers = [lay for lay in doc["Layers"] if isinstance(lay, dict)]
    produced = {t.get("Name") for lay in layers for t in _tensors(lay, "Outputs")}
    bindings = [b for b in doc.get("Bindings", []) if isinstance(b, str)]
    return [b for b in bindings if b not in produced], [b for b in bindings if b in produced]


def precision_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """Layer counts per output datatype (all layers, and compute layers: no reformats/constants)."""
    layers = doc["Layers"]
    detailed = any(isinstance(lay, dict) for lay in layers)
    by_dtype: Counter[str] = Counter(layer_output_dtype(lay) for lay in layers)
    compute = [lay for lay in layers if isinstance(lay, dict) and not is_reformat(lay)
               and str(lay.get("LayerType", "")) not in _SKIP_TYPES]
    compute_by: Counter[str] = Counter(layer_output_dtype(lay) for lay in compute)
    conv_weights: Counter[str] = Counter(
        datatype(str(lay["Weights"].get("Type"))) for lay in compute
        if isinstance(lay.get("Weights"), dict) and lay["Weights"].get("Type"))
    n_compute = len(compute)
    ins, outs = _io_names(doc)

    def ordered(c: Counter[str]) -> dict[str, int]:
        return {k: c[k] for k in sorted(c, key=lambda k: PRECISION_ORDER.index(k) if k in PRECISION_ORDER else 99)}

    return {
        "detailed": detailed,
        "layers": len(layers),
        "reformat_layers": sum(1 for lay in layers if is_reformat(lay)),
        "by_output_dtype": ordered(by_dtype),
        "compute_layers": n_compute,
        "compute_by_output_dtype": ordered(compute_by),
        "weights_by_dtype": ordered(conv_weights),
        "int8_share": (compute_by["INT8"] / n_compute) if n_compute else 0.0,
        "inputs": ins,
        "outputs": outs,
    }


def summary_markdown(summary: dict[str, Any], title: str = "Engine precision") -> str:
    lines = [f"### {title}", ""]
    if not summary["detailed"]:
        lines += [f"{summary['layers']} layers; datatypes unknown: rebuild with --profilingVerbosity=detailed "
                  f"(scripts/generate_trt_engine.sh ... --graph).", ""]
        return "\n".join(lines)
    n = summary["compute_layers"] or 1
    lines += ["| Output datatype | Compute layers | Share |", "|---|---:|---:|"]
    for k, v in summary["compute_by_output_dtype"].items():
        lines.append(f"| {k} | {v} | {100 * v / n:.1f}% |")
    lines += ["", f"- layers in the engine: {summary['layers']} (reformat layers: {summary['reformat_layers']})"]
    if summary["weights_by_dtype"]:
        w = ", ".join(f"{k} {v}" for k, v in summary["weights_by_dtype"].items())
        lines.append(f"- layers with weights, by weight type: {w}")
    lines.append(f"- INT8 share of compute layers: {100 * summary['int8_share']:.1f}%")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- DOT
def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _short(name: str, limit: int = 60) -> str:
    return name if len(name) <= limit else name[:limit - 3] + "..."


def to_dot(doc: dict[str, Any], title: str = "engine") -> str:
    """Plain Graphviz DOT of the engine: layers colored by output datatype, edges labeled with the
    tensor's datatype and dimensions, engine inputs/outputs as gray ellipses."""
    layers = doc["Layers"]
    ins, outs = _io_names(doc)
    lines = [f"digraph {_q(title)} {{", "  rankdir=TB;", '  node [shape=box, style="rounded,filled", fontsize=10];',
             "  edge [fontsize=8];"]
    for i, name in enumerate(ins):
        lines.append(f"  in{i} [label={_q(name)}, shape=ellipse, fillcolor=\"#d9d9d9\"];")
    for i, name in enumerate(outs):
        lines.append(f"  out{i} [label={_q(name)}, shape=ellipse, fillcolor=\"#d9d9d9\"];")
    producer: dict[str, str] = {name: f"in{i}" for i, name in enumerate(ins)}
    for i, lay in enumerate(layers):
        if isinstance(lay, dict):
            for t in _tensors(lay, "Outputs"):
                producer[str(t.get("Name"))] = f"L{i}"
    for i, lay in enumerate(layers):
        if not isinstance(lay, dict):
            lines.append(f"  L{i} [label={_q(_short(str(lay)))}];")
            continue
        prec = layer_output_dtype(lay)
        kind = str(lay.get("LayerType") or lay.get("ParameterType") or "")
        label = f"{kind} {prec}\n{_short(str(lay.get('Name', f'layer {i}')))}"
        style = ', style="rounded,filled,dashed"' if is_reformat(lay) else ""
        lines.append(f"  L{i} [label={_q(label)}, fillcolor={_q(COLORS.get(prec, '#ffffff'))}{style}];")
        for t in _tensors(lay, "Inputs"):
            src = producer.get(str(t.get("Name")))
            if src is not None:
                dims = "x".join(str(d) for d in t.get("Dimensions", []))
                edge = f"{tensor_dtype(t)} {dims}".strip()
                lines.append(f"  {src} -> L{i} [label={_q(edge)}];")
    for i, name in enumerate(outs):
        src = producer.get(name)
        if src is not None:
            lines.append(f"  {src} -> out{i};")
    lines.append("}")
    return "\n".join(lines) + "\n"


@dataclass
class GraphResult:
    svg: Path | None
    dot: Path | None
    renderer: str  # "trex", "graphviz" (our DOT through `dot`) or "none" (DOT text only)
    message: str


def _render_with_dot(dot_path: Path, svg_path: Path) -> str | None:
    """Run Graphviz; None on success, else the reason."""
    exe = shutil.which("dot")
    if exe is None:
        return "Graphviz `dot` is not installed"
    with atomic_path(svg_path) as tmp:
        r = subprocess.run([exe, "-Tsvg", str(dot_path), "-o", str(tmp)], capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            raise QATError(f"Graphviz failed to render {dot_path} ({r.stderr.strip()[:200]}); check the DOT file.")
    return None


def _trex_graphing(trex: Any) -> Any:
    """Where TREx keeps ``to_dot``, ``render_dot`` and ``layer_type_formatter``: ``trex.graphing`` since TREx 0.1.8
    (its ``__init__`` no longer imports the graphing module), the top-level package before."""
    try:
        import trex.graphing as graphing
        return graphing
    except ImportError:
        return trex


def _try_trex(layer_json: Path, profile_json: Path | None, svg_path: Path, doc: dict[str, Any]) -> tuple[Path | None, str]:
    """Render with TREx; (svg or None, message)."""
    if "I/O Tensors" in doc or "Bindings" not in doc:
        return None, (f"TREx reads TensorRT 10 layer information only (it was removed from TensorRT in 11.1; "
                      f"{NSIGHT_DL_DESIGNER} shows TensorRT 11 engines)")
    try:
        import trex
    except ImportError:
        return None, f"TREx is not installed (install with {INSTALL_TREX})"
    if shutil.which("dot") is None:
        return None, f"TREx needs Graphviz's `dot` binary, which is not installed (install with {INSTALL_TREX})"
    try:
        graphing = _trex_graphing(trex)
        plan = trex.EnginePlan(str(layer_json), str(profile_json) if profile_json else None)
        graph = graphing.to_dot(plan, graphing.layer_type_formatter, display_regions=True, expand_layer_details=False)
        out = graphing.render_dot(graph, str(svg_path.with_suffix("")), "svg")
        return Path(out), "rendered with TREx"
    except Exception as e:  # TREx is experimental and tied to TensorRT's JSON schema: fall back, say why
        return None, f"TREx could not render this plan ({type(e).__name__}: {e})"


def render_graph(layer_json: PathLike, out_svg: PathLike | None = None, profile_json: PathLike | None = None,
                 *, use_trex: bool = True) -> GraphResult:
    """Render the engine graph of ``layer_json`` to ``out_svg`` (default: beside it, ``X.svg``)."""
    layer_json = Path(layer_json)
    doc = load_layer_info(layer_json)
    stem = layer_json.name[:-len(".layer.json")] if layer_json.name.endswith(".layer.json") else layer_json.stem
    svg = Path(out_svg) if out_svg is not None else layer_json.with_name(stem + ".svg")
    profile = Path(profile_json) if profile_json is not None else None
    if profile is not None and not profile.is_file():
        profile = None
    note = ""
    if use_trex:
        done, note = _try_trex(layer_json, profile, svg, doc)
        if done is not None:
            return GraphResult(done, None, "trex", f"wrote {done} ({note})")
    dot_path = svg.with_suffix(".dot")
    write_text(dot_path, to_dot(doc, title=stem))
    why = _render_with_dot(dot_path, svg)
    prefix = f"{note}; " if note else ""
    if why is None:
        return GraphResult(svg, dot_path, "graphviz", f"{prefix}wrote {svg} (plain Graphviz rendering)")
    return GraphResult(None, dot_path, "none",
                       f"{prefix}{why}: wrote {dot_path}; render it with `dot -Tsvg {dot_path} -o {svg}` "
                       f"(apt-get install graphviz, or {INSTALL_TREX})")


def get_args_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 -m utils.qat.trt.engine_graph",
                                 description="Draw a TensorRT engine graph (SVG) and count layers per precision.")
    ap.add_argument("layer_json", help="trtexec --exportLayerInfo output (X.engine.layer.json)")
    ap.add_argument("--profile", default=None, help="trtexec --exportProfile output (X.engine.profile.json)")
    ap.add_argument("--out", default=None, help="SVG path (default: X.engine.svg beside the layer JSON)")
    ap.add_argument("--no-trex", action="store_true", help="use the plain renderer even if TREx is installed")
    ap.add_argument("--summary-only", action="store_true", help="print the precision summary, draw nothing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    return ap


def main(args: argparse.Namespace) -> None:
    doc = load_layer_info(args.layer_json)
    summary = precision_summary(doc)
    print(json.dumps(summary, indent=2) if args.json else summary_markdown(summary))
    if not args.summary_only:
        res = render_graph(args.layer_json, args.out, args.profile, use_trex=not args.no_trex)
        print(res.message, file=sys.stderr if res.svg is None else sys.stdout)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
