"""How much of a PTQ figure is the setting, and how much the draw: PTQ runs side by side per model and setting.

Reads the report.json of `qat.py quantize` runs (``--ptq-only`` or whole), groups them by model and calibration setting (method, head scales, ``--search-layers``),
and within each group sets side by side the runs that differ only in what should not matter: how many calibration
batches there are (``--calib-batches``) and how many of them the amax search scores on (``--head-batches``). Per
model and setting it writes every run's PTQ mAP50-95 (with its even and odd image halves), their mean and range.

    python3 benchmarks/diagnose.py ptq-spread runs/sweep/*/report.json --out runs/ptq-spread --label ptq-spread

Runs whose calibration came out identical to another of the same group (every searched factor, the search's losses
and the PTQ figures; e.g. ``--calib-batches 30`` where the data has 24 batches, as 25 gives) count once: the
duplicate is listed, not averaged in. Writes LABEL.json, LABEL.md and LABEL.png (each run's PTQ per setting and
model) into --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the library, from this checkout: no tree needed
from utils.qat.core.atomic import atomic_path, write_text  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402

from parts import portable  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reports", nargs="+", help="qat.py report.json files, or folders holding them (searched below)")
    p.add_argument("--out", required=True, help="folder of LABEL.json, LABEL.md and LABEL.png")
    p.add_argument("--label", default="ptq-spread", help="name of the result files (default: %(default)s)")
    return p


def report_files(paths: list[str]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.rglob("report*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise QATError(f"{p} not found: pass qat.py report.json files or folders holding them.")
    if not files:
        raise QATError(f"no report.json under {' '.join(paths)}: pass the run folders of qat.py quantize.")
    return files


def setting(a: dict) -> str:
    head = "head searched" if a.get("head_amax") == "search" else "head as calibrated"
    body = f", layers {a['search_layers']} searched" if a.get("search_layers") else ""
    return f"{a.get('calib_method')}, {head}{body}"


def read_run(path: Path) -> dict:
    """One report's PTQ run: model, setting, the perturbation, PTQ mAP50-95 and halves, the search's losses."""
    try:
        doc = json.loads(path.read_text())
        a = doc["arguments"]
    except (ValueError, KeyError, TypeError):
        raise QATError(f"{path} is not a qat.py report.json (no arguments); pass the report of a quantize run.")
    ptq = next((m for m in doc.get("models", []) if m.get("name") == "PTQ"), None)
    if ptq is None:
        raise QATError(f"{path} has no PTQ row (the run stopped before its PTQ evaluation); leave it out.")
    search = doc.get("head_search") or {}
    return {"report": str(path), "name": a.get("name"), "model": Path(a["weights"]).stem, "setting": setting(a),
            "calib_batches": a.get("calib_batches"), "head_batches": a.get("head_batches"), "AP": ptq["AP"],
            "halves": ptq.get("halves", {}), "loss_before": search.get("loss_before"),
            "loss_after": search.get("loss_after"), "factors": search.get("factors", {}),
            "calibration_s": doc.get("calibration_seconds")}


def _same(a: dict, b: dict) -> bool:
    keys = ("AP", "halves", "loss_before", "loss_after", "factors")
    return all(a[k] == b[k] for k in keys)


def spread(runs: list[dict]) -> dict:
    """{model: {setting: {"runs": [...], "duplicates": [...], "mean", "min", "max"}}}, runs in their given order."""
    out: dict = {}
    for r in runs:
        group = out.setdefault(r["model"], {}).setdefault(r["setting"], {"runs": [], "duplicates": []})
        twin = next((k for k in group["runs"] if _same(k, r)), None)
        if twin is not None:
            group["duplicates"].append({**r, "same_as": twin["name"]})
        else:
            group["runs"].append(r)
    for settings in out.values():
        for group in settings.values():
            aps = [r["AP"] for r in group["runs"]]
            group.update(mean=statistics.fmean(aps), min=min(aps), max=max(aps))
    return out


def perturbation(r: dict) -> str:
    return f"{r['calib_batches']} calib / {r['head_batches']} search batches"


def render(result: dict, label: str) -> str:
    lines = [f"# {label}: PTQ mAP50-95 per setting, over runs that differ in what should not matter", ""]
    for model, settings in result.items():
        lines += [f"## {model}", "", "| setting | runs | PTQ mAP50-95 of each run | mean | range |", "|---|---|---|---|---|"]
        for name, g in settings.items():
            each = ", ".join(f"{r['AP']:.4f} ({perturbation(r)})" for r in g["runs"])
            lines.append(f"| {name} | {len(g['runs'])} | {each} | {g['mean']:.4f} | {g['min']:.4f}-{g['max']:.4f} |")
        lines.append("")
        lines += ["| run | setting | calibration batches | search batches | PTQ | even half | odd half | search loss | "
                  "calibration s |", "|---|---|---|---|---|---|---|---|---|"]
        for name, g in settings.items():
            for r in g["runs"] + g["duplicates"]:
                loss = (f"{r['loss_before']:.4g} -> {r['loss_after']:.4g}" if r["loss_after"] is not None else "-")
                dup = f" (= {r['same_as']}, counted once)" if "same_as" in r else ""
                h = r["halves"]
                secs = f"{r['calibration_s']:.1f}" if r["calibration_s"] is not None else "-"
                lines.append(f"| {r['name']}{dup} | {name} | {r['calib_batches']} | {r['head_batches']} | "
                             f"{r['AP']:.4f} | {h.get('even', float('nan')):.4f} | {h.get('odd', float('nan')):.4f} | "
                             f"{loss} | {secs} |")
        lines.append("")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Each run's PTQ per setting, a panel per model, the mean as a line; written beside ``path``, then renamed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(result), figsize=(5 * len(result), 4), squeeze=False)
    for ax, (model, settings) in zip(axes[0], result.items()):
        for i, (name, g) in enumerate(settings.items()):
            aps = [r["AP"] for r in g["runs"]]
            ax.scatter([i] * len(aps), aps, alpha=0.7)
            ax.hlines(g["mean"], i - 0.2, i + 0.2, color="k")
        ax.set_xticks(range(len(settings)), [n.replace(", ", ",\n") for n in settings], fontsize=7)
        ax.set_title(model)
        ax.set_ylabel("PTQ mAP50-95 (line: mean)")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> dict:
    result = spread([read_run(f) for f in report_files(args.reports)])
    out = Path(args.out)
    write_text(out / f"{args.label}.json", portable.text(json.dumps(result, indent=1), work=out))
    text = render(result, args.label)
    write_text(out / f"{args.label}.md", text + "\n")
    plot(result, out / f"{args.label}.png")
    print(text)
    return result

