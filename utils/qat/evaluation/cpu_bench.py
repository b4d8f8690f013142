"""CPU latency and throughput of exported ONNX graphs: FP32 against INT8 of the same checkpoint, on ONNX Runtime
and OpenVINO (``scripts/benchmark_cpu.py``; ``benchmarks/cpu_deploy.py`` runs it from checkpoints).

For each model, runtime and batch size both graphs are opened for a static input (B x 3 x S x S; OpenVINO
compiles for it), with the same number of threads, warmed up, then timed in alternating rounds (FP32, INT8,
FP32, ...): on a machine shared with other work a busy moment slows both alike. A timing is one synchronous
inference of one batch of fixed random images (the input buffer is made once). Reported per case: the median
latency and its spread (10th-90th percentile, min, max), images per second (batch / median latency), and the
INT8 speed-up (FP32 median / INT8 median); per machine: the CPU, its cores, the instruction sets INT8 speed
depends on (AVX2; AVX512-VNNI / AVX-VNNI: 8-bit dot products; AMX: tile matrix units), the load average
before and after, and the runtimes' versions. OpenVINO runs what its INT8 kernels do not cover in FP32
(``INFERENCE_PRECISION_HINT`` f32: on AMX or AVX512-BF16 CPUs it would otherwise choose bf16, and the FP32
column would not be FP32). The baseline users run is OpenVINO's default precision, which OpenVINO is asked for
(not guessed from the CPU's flags): where it is not f32 (bf16 on AMX or AVX512-BF16 CPUs) the FP32 graph is timed
at it too (:data:`DEFAULT`), in the same rounds, and every row gives the INT8 speed-up over both (ONNX Runtime's
default is f32). A graph may be an OpenVINO IR (``.xml``, e.g. NNCF's), timed on OpenVINO only. For each
OpenVINO INT8 graph, a few profiled inferences add its execution graph:
the convolutions by the precision they ran in, those left in floating point by name with the reason read
from the ONNX graph, and the share of time spent in each precision.

    doc = measure({"gelan-c": {"FP32": "gelan-c.onnx", "INT8": "qat_best.onnx"}}, imgsz=640)
    write_report(doc, "runs/benchmark_cpu")
"""
from __future__ import annotations

import json
import os
import platform
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from utils.qat.core.atomic import atomic_path, write_text
from utils.qat.core.device import cpu_description, exact_int8_dot
from utils.qat.core.errors import QATError
from utils.qat.core.progress import progress
from utils.qat.evaluation.backends import ONNX_RUNTIMES, RUNTIMES, OpenVINOBackend, ORTBackend

#: What is compared; FP32 is the baseline.
PRECISIONS = ("FP32", "INT8")
#: The FP32 graph on OpenVINO at its default precision, timed too where that is not f32 (bf16 on CPUs with AMX-BF16
#: or AVX512-BF16): what a user who does not pin f32 gets from the FP32 graph there.
DEFAULT = "FP32 graph at the default precision"
LEGACY_BF16 = "FP32 graph in bf16"  # the same row as results.json files before 2026-12-04 name it
#: /proc/cpuinfo flags that decide INT8 (and bf16) speed on x86, as the report names them.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_vnni": "AVX512-VNNI", "avx_vnni": "AVX-VNNI",
             "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX", "amx_int8": "AMX-INT8", "amx_bf16": "AMX-BF16"}
#: What ``cpu_info()["exact_int8"]`` means for the INT8 numbers, as the table says it.
EXACT = {True: "exact (VNNI or AMX)",
         False: "saturating (no VNNI or AMX: OpenVINO's INT8 convolutions add 8-bit products into 16-bit sums that "
                "overflow; its INT8 timings are real, its INT8 outputs are not the graph's)",
         None: "not known (not x86, or no /proc/cpuinfo)"}
#: OpenVINO layer types that do the arithmetic INT8 is for.
COMPUTE_LAYERS = ("Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul")
#: Profiled inferences per INT8 graph (each layer's median: one busy moment does not move it).
PROFILED_RUNS = 5


# ----------------------------------------------------------------------------------------------- the machine
def usable_cpus() -> int:
    """The cores this process may run on (its affinity; all of them where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_info() -> dict[str, Any]:
    """The CPU: ``model``, ``cpus`` (usable by this process), ``isa`` (each of :data:`ISA_FLAGS`: present or
    not; None off Linux, where /proc/cpuinfo does not say), ``exact_int8`` (``utils.qat.core.device.exact_int8_dot``:
    False where OpenVINO's INT8 convolutions saturate), ``load`` (1-minute load average)."""
    model, flags = cpu_description()
    return {"model": model, "cpus": usable_cpus(), "logical_cpus": os.cpu_count(),
            "isa": None if flags is None else {name: flag in flags for flag, name in ISA_FLAGS.items()},
            "exact_int8": exact_int8_dot(), "load": _load()}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def versions(runtimes: Sequence[str]) -> dict[str, str | None]:
    """The installed version of each runtime."""
    from importlib import metadata
    out: dict[str, str | None] = {}
    for runtime in runtimes:
        try:
            out[runtime] = metadata.version(runtime)
        except metadata.PackageNotFoundError:
            out[runtime] = None
    return out


# ----------------------------------------------------------------------------------------------- measuring
def open_graph(runtime: str, path: str | os.PathLike, *, batch: int, imgsz: int, threads: int,
               profile: bool = False, precision: str | None = "f32") -> ORTBackend | OpenVINOBackend:
    """``path`` opened on ``runtime`` with ``threads`` threads for a batch x 3 x imgsz x imgsz input
    (OpenVINO: what is not INT8 in ``precision``, None for OpenVINO's default)."""
    if runtime != "openvino" and Path(path).suffix.lower() == ".xml":
        raise QATError(f"{path} is an OpenVINO IR, which {RUNTIMES.get(runtime, runtime)} cannot run; pass "
                       f"--runtime openvino, or the ONNX graph.")
    if runtime == "openvino":
        return OpenVINOBackend(path, threads=threads, shape=(batch, 3, imgsz, imgsz), profile=profile,
                               precision=precision)
    if runtime == "onnxruntime":
        backend = ORTBackend(path, threads=threads, arithmetic="float")  # the file as it is deployed
        fixed = (backend.batch_size, *(backend.imgsz or ()))
        want = (batch, imgsz, imgsz)
        if any(f is not None and f != w for f, w in zip(fixed, want)):
            raise QATError(f"{path} has a fixed input of batch {backend.batch_size} at {backend.imgsz}, not batch "
                           f"{batch} at {imgsz}: export it with --dynamic, or benchmark its own size.")
        return backend
    raise QATError(f"unknown runtime {runtime!r}; pass one of {', '.join(ONNX_RUNTIMES)}.")


def graph_stride(path: str | os.PathLike) -> int:
    """The stride an exported graph records (``utils.qat.core.artifact``; 32 with a warning without one). An
    OpenVINO IR is read for its ONNX metadata where it kept it (NNCF keeps the source graph's ``framework`` info)."""
    from utils.qat.core import yolov9
    from utils.qat.core.artifact import ArtifactMeta, read_props
    if Path(path).suffix.lower() == ".xml":
        from utils.qat.evaluation.openvino_core import shared_core
        model = shared_core().read_model(str(path))
        framework = model.get_rt_info()["framework"] if model.has_rt_info("framework") else {}
        fields = {k: model.get_rt_info(["framework", k]).astype(str) for k in framework}
    else:
        import onnx
        fields = read_props(onnx.load(str(path), load_external_data=False))
    return yolov9.artifact_stride(ArtifactMeta.read(fields).stride, path, f"the metadata of {path}")


def stats(times_ms: Sequence[float], batch: int) -> dict[str, Any]:
    """Median and spread of one case's latencies, and its images per second."""
    t = np.asarray(times_ms, dtype=np.float64)
    median = float(np.median(t))
    return {"median_ms": round(median, 3), "p10_ms": round(float(np.percentile(t, 10)), 3),
            "p90_ms": round(float(np.percentile(t, 90)), 3), "min_ms": round(float(t.min()), 3),
            "max_ms": round(float(t.max()), 3), "images_per_s": round(1000.0 * batch / median, 2),
            "times_ms": [round(float(x), 3) for x in t]}


def _timed(backend, x: np.ndarray) -> float:
    start = time.perf_counter()
    backend.run(x)
    return (time.perf_counter() - start) * 1000.0


def time_pair(graphs: Mapping[str, Any], x: np.ndarray, *, warmup: int, runs: int) -> dict[str, list[float]]:
    """Latencies in ms of each opened graph on ``x``: ``warmup`` untimed rounds, then ``runs`` timed rounds,
    each running every graph once in turn."""
    for _ in range(warmup):
        for backend in graphs.values():
            backend.run(x)
    times: dict[str, list[float]] = {label: [] for label in graphs}
    for _ in range(runs):
        for label, backend in graphs.items():
            times[label].append(_timed(backend, x))
    return times


def _onnx_conv_inputs(path: str | os.PathLike) -> dict[str, tuple[bool, bool]]:
    """Each ONNX Conv by name: (its input comes from a DequantizeLinear, its weight does)."""
    import onnx
    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    return {n.name: (producer.get(n.input[0]) == "DequantizeLinear",
                     len(n.input) > 1 and producer.get(n.input[1]) == "DequantizeLinear")
            for n in graph.node if n.op_type == "Conv"}


def float_layers(backend: OpenVINOBackend, onnx_path: str | os.PathLike, x: np.ndarray) -> dict[str, Any]:
    """What an OpenVINO INT8 graph (opened with ``profile=True``) runs in which precision, over
    :data:`PROFILED_RUNS` inferences of ``x`` (each layer's median time): ``compute`` (convolution-like layers by precision), ``float_compute`` (those not in 8 bits: name,
    kernel, time, and why, from the ONNX graph), ``time_share`` (fraction of the inference per precision) and
    ``top_float`` (the slowest layers not in 8 bits)."""
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(PROFILED_RUNS):
        backend.run(x)
        for node, us in backend.layer_times().items():
            samples[node].append(us)
    times = {node: float(np.median(v)) for node, v in samples.items()}
    layers = backend.layers()
    convs = _onnx_conv_inputs(onnx_path)
    compute: dict[str, int] = defaultdict(int)
    share: dict[str, float] = defaultdict(float)
    floats, slow = [], []
    total = sum(times.values()) or 1.0
    for layer in layers:
        precision = layer["precision"] or "?"
        us = times.get(layer["name"], 0.0)
        share[precision] += us / total
        low = precision in ("i8", "u8")
        if layer["type"] in COMPUTE_LAYERS:
            compute[precision] += 1
            if not low:
                onnx_conv = next((n for n in layer["fused"] if n in convs), None)
                if onnx_conv is None:
                    why = "not an ONNX Conv"
                elif not convs[onnx_conv][0]:
                    why = "no Q/DQ on its input in the graph (kept floating point by the export)"
                elif not convs[onnx_conv][1]:
                    why = "its weight has no Q/DQ in the graph"
                else:
                    why = "quantized in the graph, but OpenVINO did not run it in INT8"
                floats.append({"name": onnx_conv or layer["name"], "primitive": layer["primitive"],
                               "us": round(us, 1), "why": why})
        if not low and us > 0:
            slow.append({"name": layer["name"], "type": layer["type"], "precision": precision,
                         "primitive": layer["primitive"], "us": round(us, 1)})
    slow.sort(key=lambda r: -r["us"])
    return {"compute": dict(compute), "float_compute": floats,
            "time_share": {k: round(v, 3) for k, v in sorted(share.items(), key=lambda kv: -kv[1])},
            "top_float": slow[:8], "profiled_ms": round(total / 1000.0, 2)}


def measure(models: Mapping[str, Mapping[str, str | os.PathLike]], *, runtimes: Sequence[str] = ONNX_RUNTIMES,
            batches: Sequence[int] = (1, 8), imgsz: int = 640, threads: int | None = None, warmup: int = 3,
            runs: int = 10, seed: int = 0, layers: bool = True) -> dict[str, Any]:
    """The benchmark: ``models[name] = {"FP32": onnx, "INT8": onnx}``, each pair on every runtime and batch with
    ``threads`` threads (None: every usable core). ``layers``: add OpenVINO's execution graph of each INT8
    graph (:func:`float_layers`). Returns the results document (results.json)."""
    from utils.qat.core.validate import check_imgsz
    threads = threads or usable_cpus()
    for name, pair in models.items():
        for precision in PRECISIONS:
            if precision not in pair or not Path(pair[precision]).is_file():
                raise QATError(f"model {name}: the {precision} graph {pair.get(precision)} was not found; export "
                               f"it with export_qat.py (an FP checkpoint gives FP32, a qat.py checkpoint INT8).")
    for runtime in runtimes:
        if runtime not in ONNX_RUNTIMES:
            raise QATError(f"unknown runtime {runtime!r}; pass one of {', '.join(ONNX_RUNTIMES)}.")
    imgsz = check_imgsz(imgsz, max(graph_stride(p) for pair in models.values() for p in pair.values()))
    doc: dict[str, Any] = {"machine": {**cpu_info(), "platform": platform.platform(),
                                       "python": platform.python_version()},
                           "versions": versions(runtimes),
                           "settings": {"imgsz": imgsz, "batches": list(batches), "threads": threads,
                                        "warmup": warmup, "runs": runs, "openvino_precision": "f32",
                                        "input": f"uniform random [0, 1), seed {seed}"},
                           "models": {}}
    if "openvino" in runtimes:  # whether OpenVINO's INT8 outputs here are the graph's: asked of a probe graph
        from utils.qat.evaluation.openvino_probe import openvino_int8_error
        doc["machine"]["openvino_int8_error"] = openvino_int8_error()
    rng = np.random.default_rng(seed)
    cases = [(name, runtime, b) for name in models for runtime in runtimes for b in batches]
    bar = progress(cases, desc="CPU benchmark", unit="case")
    for name, runtime, b in bar:
        x = rng.random((b, 3, imgsz, imgsz), dtype=np.float32)
        graphs = {p: open_graph(runtime, models[name][p], batch=b, imgsz=imgsz, threads=threads) for p in PRECISIONS}
        default = "f32"  # ONNX Runtime's CPU provider computes float graphs in f32
        if runtime == "openvino":  # what OpenVINO does with the FP32 graph by default on this CPU
            as_users_run = open_graph(runtime, models[name]["FP32"], batch=b, imgsz=imgsz, threads=threads,
                                      precision=None)
            default = as_users_run.precision
            if default != "f32":
                graphs[DEFAULT] = as_users_run
        times = time_pair(graphs, x, warmup=warmup, runs=runs)
        row = {"runtime": runtime, "batch": b, **{p: stats(times[p], b) for p in graphs}}
        row["speedup"] = round(row["FP32"]["median_ms"] / row["INT8"]["median_ms"], 3)
        row["default_precision"] = default
        baseline = row[DEFAULT] if DEFAULT in row else row["FP32"]
        row["speedup_vs_default"] = round(baseline["median_ms"] / row["INT8"]["median_ms"], 3)
        entry = doc["models"].setdefault(name, {"graphs": {p: str(models[name][p]) for p in PRECISIONS},
                                                "runs": []})
        entry["runs"].append(row)
        del graphs
    if layers and "openvino" in runtimes:
        for name in models:
            x = rng.random((1, 3, imgsz, imgsz), dtype=np.float32)
            backend = open_graph("openvino", models[name]["INT8"], batch=1, imgsz=imgsz, threads=threads, profile=True)
            doc["models"][name]["openvino_int8_layers"] = float_layers(backend, models[name]["INT8"], x)
    doc["machine"]["load_after"] = _load()
    return doc


# ----------------------------------------------------------------------------------------------- reporting
def _spread(s: Mapping[str, Any]) -> str:
    return f"{s['p10_ms']:.1f}-{s['p90_ms']:.1f}"


def _as_written(error: float) -> str:
    """The table's sentence for OpenVINO's probe error (``utils.qat.evaluation.openvino_probe``)."""
    from utils.qat.evaluation.openvino_probe import EXACT_TOLERANCE
    if error <= EXACT_TOLERANCE:
        return f"yes (a probe graph within {error:.1g} of its exact result)"
    return (f"no for graphs as export_qat.py writes them for TensorRT: a quantized Concat feeding a convolution came out "
            f"{error:.1%} off its exact result (utils/qat/evaluation/openvino_probe.py); their INT8 timings are real, "
            f"their INT8 outputs are not the graph's (a graph export_qat.py --openvino-avx2 writes is exempt: "
            f"it ran as written on the CPUs seen failing the probe: AVX2 alone, and an AMD EPYC Zen 4)")


def _current(row: Mapping[str, Any]) -> Mapping[str, Any]:
    """A row of results.json in today's form (an older file timed a bf16 default under :data:`LEGACY_BF16`)."""
    if LEGACY_BF16 in row and DEFAULT not in row:
        return {**row, DEFAULT: row[LEGACY_BF16], "default_precision": "bf16",
                "speedup_vs_default": row["speedup_vs_bf16"]}
    return row


def render_markdown(doc: Mapping[str, Any]) -> str:
    """The machine, then one table row per model, runtime and batch: FP32 and INT8 latency (median, 10th-90th
    percentile), images per second, and the INT8 speed-up; then OpenVINO's INT8 execution graph per model."""
    m, s = doc["machine"], doc["settings"]
    isa = m.get("isa")
    flags = ("not known (no /proc/cpuinfo)" if isa is None
             else ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in isa.items()))
    vers = ", ".join(f"{RUNTIMES.get(k, k)} {v or 'not installed'}" for k, v in doc["versions"].items())
    out = ["### Machine", "", "| | |", "|---|---|", f"| CPU | {m['model']} |",
           f"| cores used | {s['threads']} threads of {m['cpus']} usable cores ({m['logical_cpus']} logical) |",
           f"| instruction sets | {flags} |", f"| 8-bit dot products | {EXACT.get(m.get('exact_int8'))} |",
           *([f"| OpenVINO INT8 as written | {_as_written(m['openvino_int8_error'])} |"]
             if m.get("openvino_int8_error") is not None else []),
           f"| runtimes | {vers} |",
           f"| load average (1 min) | {m.get('load')} before, {m.get('load_after')} after |",
           f"| settings | {s['imgsz']} px, {s['warmup']} warm-up + {s['runs']} timed rounds per case (FP32 and "
           f"INT8 alternating), {s['input']}; OpenVINO non-INT8 parts in {s['openvino_precision']} |",
           "", "### FP32 vs INT8", "",
           "| model | runtime | batch | FP32 ms (p10-p90) | INT8 ms (p10-p90) | FP32 img/s | INT8 img/s | "
           "INT8 vs FP32 in f32 | INT8 vs FP32 at the default precision |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    runs = [(name, _current(r)) for name, entry in doc["models"].items() for r in entry["runs"]]
    for name, r in runs:
        f, i = r["FP32"], r["INT8"]
        out.append(f"| {name} | {RUNTIMES.get(r['runtime'], r['runtime'])} | {r['batch']} | "
                   f"{f['median_ms']:.1f} ({_spread(f)}) | {i['median_ms']:.1f} ({_spread(i)}) | "
                   f"{f['images_per_s']:.1f} | {i['images_per_s']:.1f} | {r['speedup']:.2f}x | "
                   f"**{r.get('speedup_vs_default', r['speedup']):.2f}x** ({r.get('default_precision', 'f32')}) |")
    out += ["", "Latency: median of the timed rounds (one synchronous inference of one batch); img/s: batch / "
                "median latency; speed-up: FP32 median / INT8 median (above 1: INT8 is faster). The default "
                "precision is what the runtime computes an FP32 graph in when not told otherwise, as users run it "
                "(OpenVINO: bf16 on CPUs with AMX or AVX512-BF16, f32 elsewhere, as it reports; ONNX Runtime: f32)."]
    default_rows = [(name, r) for name, r in runs if DEFAULT in r]
    if default_rows:
        out += ["", "OpenVINO's default precision on this CPU is not f32; the FP32 graph timed at it, in the same "
                    "rounds:", "",
                "| model | batch | precision | FP32 graph, ms (p10-p90) | img/s | INT8 speed-up over it |",
                "|---|---:|---|---:|---:|---:|"]
        for name, r in default_rows:
            d = r[DEFAULT]
            out.append(f"| {name} | {r['batch']} | {r['default_precision']} | {d['median_ms']:.1f} ({_spread(d)}) | "
                       f"{d['images_per_s']:.1f} | **{r['speedup_vs_default']:.2f}x** |")
    for name, entry in doc["models"].items():
        lay = entry.get("openvino_int8_layers")
        if not lay:
            continue
        compute = ", ".join(f"{n} in {p}" for p, n in sorted(lay["compute"].items(), key=lambda kv: -kv[1]))
        shares = ", ".join(f"{p} {100 * v:.0f}%" for p, v in lay["time_share"].items())
        out += ["", f"### {name}: OpenVINO INT8 execution graph", "",
                f"Convolution-like layers: {compute}. Time by precision (median of {PROFILED_RUNS} profiled "
                f"inferences at batch 1, {lay['profiled_ms']} ms in all): {shares}."]
        if lay["float_compute"]:
            out += ["", "| not in INT8 | kernel | µs | why |", "|---|---|---:|---|"]
            out += [f"| `{r['name']}` | {r['primitive']} | {r['us']:.0f} | {r['why']} |" for r in lay["float_compute"]]
        if lay["top_float"]:
            out += ["", "Slowest layers outside INT8: " + "; ".join(
                f"`{r['name']}` ({r['type']}, {r['precision']}, {r['us']:.0f} µs)" for r in lay["top_float"][:5]) + "."]
    return "\n".join(out) + "\n"


def plot(doc: Mapping[str, Any], png_path: str | os.PathLike) -> Path:
    """Images per second, FP32 and INT8 side by side for each model and runtime, one panel per batch size."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = doc["settings"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), dpi=120, squeeze=False)
    for ax, b in zip(axes[0], batches):
        rows = [(name, r) for name, e in doc["models"].items() for r in e["runs"] if r["batch"] == b]
        xs = np.arange(len(rows))
        for k, precision in enumerate(PRECISIONS):
            ax.bar(xs + (k - 0.5) * 0.4, [r[precision]["images_per_s"] for _, r in rows], 0.4, label=precision)
        for x, (_, r) in zip(xs, rows):
            ax.annotate(f"{r['speedup']:.2f}x", (x, max(r["FP32"]["images_per_s"], r["INT8"]["images_per_s"])),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(xs, [f"{n}\n{RUNTIMES.get(r['runtime'], r['runtime'])}" for n, r in rows], fontsize=8)
        ax.set_ylabel("images per second")
        ax.set_title(f"batch {b}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    s, m = doc["settings"], doc["machine"]
    fig.suptitle(f"{m['model']}, {s['threads']} threads, {s['imgsz']} px", fontsize=10)
    fig.tight_layout()
    png = Path(png_path)
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return png


def write_report(doc: Mapping[str, Any], out_dir: str | os.PathLike, stem: str = "results") -> dict[str, Path]:
    """``stem``.json, ``stem``.md and ``stem``.png in ``out_dir``."""
    d = Path(out_dir)
    return {"json": write_text(d / f"{stem}.json", json.dumps(doc, indent=2) + "\n"),
            "md": write_text(d / f"{stem}.md", render_markdown(doc)),
            "png": plot(doc, d / f"{stem}.png")}
