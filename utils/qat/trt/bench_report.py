"""Benchmark tables from parsed trtexec runs: the reference README's latency/throughput tables.

Per engine and batch: latency p99 (ms), throughput (qps), total inferences per second
(IPS = qps x batch); the INT8 vs FP16 change per batch (%); a PNG plot of IPS vs batch.
Pure Python (matplotlib only for the plot), so it runs and is tested without TensorRT.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping, Union

from utils.qat.core.atomic import atomic_path, write_text
from utils.qat.core.errors import QATError
from utils.qat.trt.trtexec import parse_trtexec_output

PathLike = Union[str, "os.PathLike[str]"]
LOG_NAME = re.compile(r"^(?P<label>.+)_b(?P<batch>\d+)\.log$")


def log_name(label: str, batch: int) -> str:
    return f"{label}_b{batch}.log"


def summarize(parsed: Mapping[str, Any], batch: int) -> dict[str, Any]:
    """The numbers the tables show, from one parsed trtexec run at ``batch``."""
    qps = float(parsed["throughput_qps"])
    lat = parsed["latency"]
    return {"batch": int(batch), "latency_p99_ms": lat.get("p99", lat.get("max")),
            "latency_median_ms": lat.get("median"), "throughput_qps": qps, "ips": qps * int(batch),
            "gpu_compute_p99_ms": (parsed.get("gpu_compute_time") or {}).get("p99")}


def _pct(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return 100.0 * (new - old) / old


def compare(base: Mapping[str, Any], other: Mapping[str, Any], *, base_label: str = "FP16",
            other_label: str = "INT8") -> dict[str, Any]:
    """% change of ``other`` vs ``base`` per batch both have (negative latency = faster)."""
    rows = {}
    for b, old in base["batches"].items():
        new = other["batches"].get(b)
        if new is None:
            continue
        rows[b] = {"latency_p99_pct": _pct(new["latency_p99_ms"], old["latency_p99_ms"]),
                   "throughput_pct": _pct(new["throughput_qps"], old["throughput_qps"]),
                   "ips_pct": _pct(new["ips"], old["ips"])}
    return {"base": base_label, "other": other_label, "batches": rows}


def build_results(runs: Mapping[str, Mapping[int, Mapping[str, Any]]], *, base: str = "FP16", other: str = "INT8",
                  sources: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``runs[label][batch] = parse_trtexec_output(...)`` -> the results document (results.json)."""
    if not runs:
        raise QATError("no benchmark runs to report; run scripts/benchmark_trt.py (or point --from-logs at its logs).")
    engines: dict[str, Any] = {}
    version = None
    device: dict[str, Any] = {}
    for label, by_batch in runs.items():
        batches = {}
        for b in sorted(by_batch):
            parsed = by_batch[b]
            version = version or parsed.get("tensorrt_version")
            device = device or dict(parsed.get("device") or {})
            batches[str(b)] = {**summarize(parsed, b), "warnings": list(parsed.get("warnings", []))}
        engines[label] = {"source": (sources or {}).get(label), "batches": batches}
    doc: dict[str, Any] = {"tensorrt_version": version, "device": device, "engines": engines}
    if base in engines and other in engines:
        doc["comparison"] = compare(engines[base], engines[other], base_label=base, other_label=other)
    return doc


def collect_logs(log_dir: PathLike) -> dict[str, dict[int, dict[str, Any]]]:
    """Parse every ``LABEL_bN.log`` in ``log_dir`` (what benchmark_trt.py saves)."""
    d = Path(log_dir)
    if not d.is_dir():
        raise QATError(f"log folder {d} not found; pass the logs/ folder benchmark_trt.py wrote.")
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for p in sorted(d.iterdir()):
        m = LOG_NAME.match(p.name)
        if not m or not p.is_file():
            continue
        try:
            parsed = parse_trtexec_output(p.read_text(errors="replace"))
        except QATError as e:
            raise QATError(f"{p}: {e}") from e
        runs.setdefault(m.group("label"), {})[int(m.group("batch"))] = parsed
    if not runs:
        raise QATError(f"no LABEL_bN.log files in {d}; pass the logs/ folder benchmark_trt.py wrote.")
    return runs


# ----------------------------------------------------------------------------- rendering
def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.3g} ms" if v < 10 else f"{v:.1f} ms"


def _signed(v: float | None) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def render_markdown(results: Mapping[str, Any]) -> str:
    """Device table, INT8 vs FP16 change table, per-engine latency/throughput table (markdown)."""
    out: list[str] = []
    dev = results.get("device") or {}
    out += ["### Device", "", "| GPU | |", "|---|---|"]
    if dev.get("name"):
        out.append(f"| Device | **{dev['name']}** |")
    for key, label in (("compute_capability", "Compute Capability"), ("sms", "SMs"),
                       ("global_memory", "Device Global Memory"), ("compute_clock", "Application Compute Clock Rate"),
                       ("memory_clock", "Application Memory Clock Rate")):
        if dev.get(key):
            out.append(f"| {label} | {dev[key]} |")
    out.append(f"| TensorRT | {results.get('tensorrt_version') or 'unknown'} |")
    header = ["| Model Name | Batch Size | Latency (99%) | Throughput (qps) | Total Inferences (IPS) |",
              "|---|---:|---:|---:|---:|"]
    cmp_ = results.get("comparison")
    if cmp_:
        out += ["", "### Latency/Throughput Comparison", "", *header,
                f"| **{cmp_['other']}** vs **{cmp_['base']}** | | | | |"]
        for b in sorted(cmp_["batches"], key=int):
            r = cmp_["batches"][b]
            out.append(f"| | {b} | {_signed(r['latency_p99_pct'])} | {_signed(r['throughput_pct'])} | "
                       f"{_signed(r['ips_pct'])} |")
    out += ["", "### Latency/Throughput", "", *header]
    for label, eng in results["engines"].items():
        first = True
        for b in sorted(eng["batches"], key=int):
            r = eng["batches"][b]
            name = f"**{label}**" if first else ""
            out.append(f"| {name} | {b} | {_ms(r['latency_p99_ms'])} | {r['throughput_qps']:.0f} | {r['ips']:.0f} |")
            first = False
    out += ["", "Latency (99%): 99th percentile of trtexec's Latency (H2D + GPU compute + D2H; transfers off); "
                "Throughput: queries (batches) per second; Total Inferences: Throughput x Batch Size (images/s)."]
    return "\n".join(out) + "\n"


def plot_ips(results: Mapping[str, Any], png_path: PathLike) -> Path:
    """IPS vs batch size, one line per engine (matplotlib, Agg backend)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for label, eng in results["engines"].items():
        bs = sorted(eng["batches"], key=int)
        ax.plot([int(b) for b in bs], [eng["batches"][b]["ips"] for b in bs], marker="o", label=label)
    ax.set_xlabel("batch size")
    ax.set_ylabel("inferences per second (IPS)")
    title = "TensorRT throughput"
    if (results.get("device") or {}).get("name"):
        title += f" on {results['device']['name']}"
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = Path(png_path)
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return png


def write_report(results: Mapping[str, Any], out_dir: PathLike) -> dict[str, Path]:
    """results.json, results.md and ips.png in ``out_dir``."""
    d = Path(out_dir)
    paths = {"json": write_text(d / "results.json", json.dumps(results, indent=2) + "\n"),
             "md": write_text(d / "results.md", render_markdown(results))}
    paths["png"] = plot_ips(results, d / "ips.png")
    return paths
