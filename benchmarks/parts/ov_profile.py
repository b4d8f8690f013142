"""An INT8 graph against its FP graph at OpenVINO's default precision, convolution by convolution: where INT8 loses
time on this CPU, and whether leaving those convolutions in floating point wins it back.

    python3 /path/to/yolov9-qat/benchmarks/diagnose.py ov-profile --fp yolov9-t.onnx --int8 ptq_yolov9-t.onnx \\
        --out runs/ov-profile --label yolov9-t-16core

On CPUs with AMX or AVX512-BF16 OpenVINO computes a floating-point graph in bf16 unless told otherwise, and that is
what an INT8 graph has to beat (README's CPU table). This script profiles both graphs at batch 1 (OpenVINO's
per-layer counters, the median of ``--profile-runs`` inferences): time by layer type and by precision, and for each
convolution its input and output channels, its INT8 time and kernel, and the FP graph's at the default precision
(none where the FP graph names it otherwise, e.g. an unfused RepConv's two branches).
It then writes mixed graphs, the INT8 graph with the input Q/DQ of some convolutions bypassed so that OpenVINO runs
them in floating point (``--variants``: ``slower``, those that took longer in INT8 than in the FP graph;
``first``, layer 0; ``cin32``, those with at most 32 input channels), and times every graph in alternating rounds
at each ``--batch``: the FP graph at the default precision and at f32, the INT8 graph at the default precision and
with its floating point in f32, and the mixed graphs. A mixed graph's weights keep their INT8-rounded values; it is
for timing, not for shipping.

Writes OUT/LABEL.json (everything, the execution graphs included), OUT/LABEL.md and the mixed graphs in
OUT/LABEL-graphs/.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402

from parts import portable  # noqa: E402

VARIANTS = ("slower", "first", "cin32")


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fp", required=True, type=Path, help="the FP32 ONNX graph")
    p.add_argument("--int8", required=True, type=Path, help="its Q/DQ INT8 graph (export_qat.py)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="timed batches (default: 1 8)")
    p.add_argument("--variants", nargs="*", choices=VARIANTS, default=list(VARIANTS),
                   help="mixed graphs to time (default: all)")
    p.add_argument("--profile-runs", type=int, default=7, help="profiled inferences per graph at batch 1")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--runs", type=int, default=15, help="timed rounds at batch 1 (half as many, at least 5, above)")
    p.add_argument("--out", type=Path, default=Path("runs/ov-profile"))
    p.add_argument("--label", default="ov-profile")
    return p


def conv_channels(path: Path) -> dict[str, tuple[int, int]]:
    """Each Conv node's (input channels per group, output channels), from its weight's shape, by node name."""
    import onnx
    graph = onnx.load(str(path)).graph
    shapes = {i.name: list(i.dims) for i in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    out = {}
    for node in graph.node:
        if node.op_type != "Conv":
            continue
        w = node.input[1]
        while w not in shapes and w in producer:  # through the weight's DequantizeLinear
            w = producer[w].input[0]
        if w in shapes:
            out[node.name] = (shapes[w][1], shapes[w][0])
    return out


def bypass_input_qdq(src: Path, dst: Path, convs: set[str]) -> list[str]:
    """Writes ``src`` with the QuantizeLinear -> DequantizeLinear pair in front of each of ``convs`` bypassed (the
    convolution reads the float tensor; the pair stays for its other consumers). Returns the convolutions changed."""
    import onnx
    model = onnx.load(str(src))
    producer = {o: n for n in model.graph.node for o in n.output}
    changed = []
    for node in model.graph.node:
        if node.op_type != "Conv" or node.name not in convs:
            continue
        dq = producer.get(node.input[0])
        q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if q is not None and q.op_type == "QuantizeLinear":
            node.input[0] = q.input[0]
            changed.append(node.name)
    onnx.checker.check_model(model)
    dst.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dst))
    return changed


def profile(backend, x: np.ndarray, runs: int) -> tuple[list[dict], dict[str, dict]]:
    """The execution graph with each node's median time over ``runs`` inferences (``us``), and its convolutions by
    the ONNX Conv they run: time, precision and kernel."""
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(runs):
        backend.run(x)
        for node, us in backend.layer_times().items():
            samples[node].append(us)
    rows, convs = [], {}
    for layer in backend.layers():
        us = float(np.median(samples[layer["name"]])) if samples.get(layer["name"]) else 0.0
        rows.append({**layer, "us": round(us, 1)})
        if layer["type"] in ("Convolution", "GroupConvolution"):
            for onnx_name in layer["fused"]:
                if onnx_name.endswith("Conv"):
                    convs[onnx_name] = {"us": us, "precision": layer["precision"], "kernel": layer["primitive"]}
    return rows, convs


def totals(rows: list[dict], key: str) -> dict[str, float]:
    """Milliseconds per ``key`` ('type' or 'precision'), largest first."""
    out: dict[str, float] = defaultdict(float)
    for r in rows:
        out[r[key] or "?"] += r["us"] / 1000.0
    return {k: round(v, 3) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def timed(graphs: dict, x: np.ndarray, warmup: int, runs: int) -> dict[str, float]:
    """Median milliseconds per graph, the graphs taking turns each round (a host's drift hits all alike)."""
    from utils.qat.core.progress import progress
    for _ in range(warmup):
        for g in graphs.values():
            g.run(x)
    times: dict[str, list[float]] = {k: [] for k in graphs}
    for _ in progress(range(runs), desc=f"timing batch {x.shape[0]}"):
        for k, g in graphs.items():
            start = time.perf_counter()
            g.run(x)
            times[k].append((time.perf_counter() - start) * 1000.0)
    return {k: round(float(np.median(v)), 2) for k, v in times.items()}


def measure(args: argparse.Namespace) -> dict:
    from utils.qat.evaluation.backends import OpenVINOBackend
    from utils.qat.evaluation.cpu_bench import cpu_info, versions
    shape = (1, 3, args.imgsz, args.imgsz)
    x1 = np.random.default_rng(0).random(shape, dtype=np.float32)
    fp = OpenVINOBackend(args.fp, shape=shape, precision=None, profile=True)
    fp_rows, fp_convs = profile(fp, x1, args.profile_runs)
    q_rows, q_convs = profile(OpenVINOBackend(args.int8, shape=shape, precision=None, profile=True), x1,
                              args.profile_runs)
    q32_rows, _ = profile(OpenVINOBackend(args.int8, shape=shape, precision="f32", profile=True), x1,
                          args.profile_runs)
    channels = conv_channels(args.int8)
    convs = []
    for name, c in q_convs.items():
        f = fp_convs.get(name, {})
        convs.append({"conv": name, "channels": channels.get(name), "int8_us": round(c["us"], 1),
                      "int8_precision": c["precision"], "int8_kernel": c["kernel"],
                      "fp_us": round(f["us"], 1) if f else None, "fp_kernel": f.get("kernel")})
    chosen = {"slower": {c["conv"] for c in convs if c["fp_us"] is not None and c["int8_us"] > c["fp_us"]},
              "first": {n for n in channels if n.startswith("/model/model.0/")},
              "cin32": {n for n, (cin, _) in channels.items() if cin <= 32}}
    graph_dir = args.out / f"{args.label}-graphs"
    paths = {"INT8": args.int8}
    variants = {}
    for name in args.variants:
        path = graph_dir / f"int8-{name}.onnx"
        variants[name] = bypass_input_qdq(args.int8, path, chosen[name])
        paths[f"INT8, {name} in float"] = path
    timing = {}
    rng = np.random.default_rng(1)
    for b in args.batch:
        shape_b = (b, 3, args.imgsz, args.imgsz)
        x = rng.random(shape_b, dtype=np.float32)
        graphs = {"FP32 graph, default precision": OpenVINOBackend(args.fp, shape=shape_b, precision=None),
                  "FP32 graph, f32": OpenVINOBackend(args.fp, shape=shape_b, precision="f32"),
                  "INT8, its float in f32": OpenVINOBackend(args.int8, shape=shape_b, precision="f32")}
        graphs.update({k: OpenVINOBackend(p, shape=shape_b, precision=None) for k, p in paths.items()})
        timing[str(b)] = timed(graphs, x, args.warmup, args.runs if b == 1 else max(5, args.runs // 2))
    return {"label": args.label, "command": portable.command(work=args.out),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": cpu_info(),
            "versions": versions(["openvino"]), "imgsz": args.imgsz, "default_precision": fp.precision,
            "by_type_ms": {"FP": totals(fp_rows, "type"), "INT8": totals(q_rows, "type"),
                           "INT8, its float in f32": totals(q32_rows, "type")},
            "by_precision_ms": {"FP": totals(fp_rows, "precision"), "INT8": totals(q_rows, "precision"),
                                "INT8, its float in f32": totals(q32_rows, "precision")},
            "convs": convs, "variants": {k: sorted(v) for k, v in variants.items()}, "timing_ms": timing,
            "execution_graphs": {"FP": fp_rows, "INT8": q_rows}}


def markdown(doc: dict, top: int = 20) -> str:
    convs = doc["convs"]
    paired = [c for c in convs if c["fp_us"] is not None]
    slower = [c for c in paired if c["int8_us"] > c["fp_us"]]
    default = doc["default_precision"]
    lines = [f"# {doc['label']}: INT8 against OpenVINO's default precision ({default}), convolution by convolution",
             "", f"Made by `{doc['command']}` ({doc['date']}). Machine: {doc['machine']['model']}, "
             f"{doc['machine']['cpus']} CPUs usable; OpenVINO {doc['versions']['openvino']}; {doc['imgsz']} px. "
             "Times are medians in milliseconds, the graphs taking turns in each round.", "",
             "| graph | " + " | ".join(f"batch {b} ms" for b in doc["timing_ms"]) + " | "
             + " | ".join(f"vs FP default, batch {b}" for b in doc["timing_ms"]) + " |",
             "|---|" + "---|" * (2 * len(doc["timing_ms"]))]
    names = list(next(iter(doc["timing_ms"].values())))
    for name in names:
        ms = [t[name] for t in doc["timing_ms"].values()]
        ratio = [t["FP32 graph, default precision"] / t[name] for t in doc["timing_ms"].values()]
        lines.append(f"| {name} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
                     + " | ".join(f"{r:.2f}x" for r in ratio) + " |")
    lines += ["", "`vs FP default`: the FP32 graph's time at OpenVINO's default precision over this graph's (above 1: "
              "faster). Mixed graphs (`in float`) bypass the input Q/DQ of the convolutions named in the JSON "
              f"({', '.join(f'{k}: {len(v)}' for k, v in doc['variants'].items()) or 'none'}).", "",
              "Profiled at batch 1 (OpenVINO's per-layer counters), milliseconds by layer type and by precision:", "",
              "| graph | by layer type | by precision |", "|---|---|---|"]
    for g in doc["by_type_ms"]:
        lines.append(f"| {g} | " + ", ".join(f"{k} {v:.2f}" for k, v in list(doc["by_type_ms"][g].items())[:6])
                     + " | " + ", ".join(f"{k} {v:.2f}" for k, v in doc["by_precision_ms"][g].items()) + " |")
    i8 = sum(c["int8_us"] for c in paired) / 1000.0
    fp = sum(c["fp_us"] for c in paired) / 1000.0
    lines += ["", f"Convolutions: {len(paired)} in both graphs, {i8:.2f} ms in INT8 against {fp:.2f} ms in the FP "
              f"graph at {default}; {len(slower)} take longer in INT8. By input channels (INT8 / FP ms, slower "
              "ones):", "", "| input channels | convolutions | INT8 ms | FP ms | slower in INT8 |",
              "|---|---|---|---|---|"]
    bins = ((0, 16), (17, 32), (33, 64), (65, 128), (129, 10 ** 9))
    for lo, hi in bins:
        group = [c for c in paired if c["channels"] and lo <= c["channels"][0] <= hi]
        if group:
            label = f"{lo}-{hi}" if hi < 10 ** 9 else f"over {lo - 1}"
            lines.append(f"| {label} | {len(group)} | {sum(c['int8_us'] for c in group) / 1000:.2f} | "
                         f"{sum(c['fp_us'] for c in group) / 1000:.2f} | "
                         f"{sum(1 for c in group if c['int8_us'] > c['fp_us'])} |")
    lines += ["", f"The {top} convolutions INT8 loses most time on:", "",
              "| convolution | in, out channels | INT8 us | INT8 kernel | FP us | FP kernel |",
              "|---|---|---|---|---|---|"]
    for c in sorted(paired, key=lambda c: c["fp_us"] - c["int8_us"])[:top]:
        ch = ", ".join(map(str, c["channels"])) if c["channels"] else "?"
        lines.append(f"| {c['conv']} | {ch} | {c['int8_us']:.0f} | {c['int8_kernel']} | {c['fp_us']:.0f} | "
                     f"{c['fp_kernel']} |")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> dict:
    for path in (args.fp, args.int8):
        if not path.is_file():
            raise QATError(f"{path} does not exist; pass the FP32 graph and its INT8 graph (export_qat.py).")
    if min(args.batch) < 1 or args.runs < 1 or args.profile_runs < 1 or args.imgsz < 32 or args.warmup < 0:
        raise QATError("--batch, --runs and --profile-runs must be at least 1, --imgsz at least 32 and --warmup at "
                       "least 0; pass sizes like the defaults.")
    doc = measure(args)
    write_text(args.out / f"{args.label}.json", json.dumps(doc, indent=1))
    write_text(args.out / f"{args.label}.md", markdown(doc))
    print(markdown(doc))
    return doc

