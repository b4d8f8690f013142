"""Results people can read: report.json, a markdown table, the console table and plots."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from utils.qat.core.atomic import PARTIAL, atomic_file, write_text

if TYPE_CHECKING:
    from utils.qat.evaluation.evaluate import Metrics

#: Report keys of the primary scores (``evaluate.Scores`` field -> key; the reference README's naming, which
#: report.json and results.json keep: AP is mAP50_95).
NOTHING_EVALUATED = ("No model was evaluated in this run (--no-eval-origin, --no-eval-ptq); score a checkpoint with "
                     "`qat.py eval --weights ...`.")
KEYS = {"mAP50_95": "AP", "mAP50": "AP50", "P": "Precision", "R": "Recall"}
#: Keys inside the Box / Mask groups of segmentation rows.
GROUP_KEYS = {"P": "P", "R": "R", "mAP50": "mAP50", "mAP50_95": "mAP50-95"}
COLUMNS = tuple(KEYS.values())
SEG_GROUPS = ("Box", "Mask")
SEG_COLUMNS = tuple(GROUP_KEYS.values())


def run_dir(project: str | Path, name: str, exist_ok: bool) -> Path:
    """``project/name``, incremented (name2, name3, ...) unless ``exist_ok``, as upstream does; created."""
    from utils.general import increment_path
    from utils.qat.core.errors import QATError
    path = Path(increment_path(Path(project) / name, exist_ok=exist_ok))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QATError(f"cannot create the results folder {path} ({e.strerror or e}); pass a writable --project.") from e
    return path


def previous_run(run_dir: Path, stem: str) -> list[Path]:
    """The files ``qat.py quantize`` of the weights ``stem`` wrote in ``run_dir``: its reports, checkpoints
    (``ptq_*``, ``qat_ep_*``, ``qat_best_*``), the accuracy budget's image lists, the FP model's per-image statistics
    (``resample.REFERENCE_FILE``) and any temporary file a killed run left behind."""
    run_dir, weights = Path(run_dir), Path(run_dir) / "weights"
    files = [run_dir / n for n in ("report.json", "report.md", "qat_ap.png", "holdout/fit.txt", "holdout/holdout.txt",
                                   "origin_images.npz")]
    for pattern in (f"ptq_ap_*_{stem}.pt", f"ptq_{stem}.pt", f"qat_ep_*_ap_*_{stem}.pt", f"qat_best_{stem}.pt",
                    PARTIAL):
        files += sorted(weights.glob(pattern))
    return [p for p in files + sorted(run_dir.glob(PARTIAL)) if p.is_file()]


def replace_previous_run(run_dir: Path, stem: str) -> None:
    """Remove what an earlier quantize of the same weights left in a reused run folder (``--exist-ok``), so
    that report.json and the checkpoints present always belong to one run."""
    old = previous_run(run_dir, stem)
    for p in old:
        p.unlink(missing_ok=True)
    if old:
        print(f"notice: {run_dir} held an earlier run of {stem} (--exist-ok): removed its {len(old)} files "
              f"({', '.join(p.name for p in old[:4])}{', ...' if len(old) > 4 else ''}).")


def entry(name: str, weights: str | Path | None, metrics: Metrics, seconds: float, **extra) -> dict:
    """One evaluated model: the primary scores under :data:`KEYS` (AP is mAP50_95, AP50 mAP50).

    Segmentation metrics (with ``mask``) add ``Box`` and ``Mask`` groups of P, R, mAP50 and mAP50-95;
    AP / AP50 / Precision / Recall are then the mask numbers, the ones that rank models."""
    row = {"name": name, "weights": str(weights) if weights else None,
           **{key: round(getattr(metrics.primary, f), 4) for f, key in KEYS.items()},
           "images": metrics.images, "seconds": round(seconds, 1)}
    if metrics.halves:
        row["halves"] = halves(metrics)
    if metrics.mask is not None:
        for group, scores in zip(SEG_GROUPS, (metrics.box, metrics.mask)):
            row[group] = {key: round(getattr(scores, f), 4) for f, key in GROUP_KEYS.items()}
    return {**row, **extra}


def halves(metrics: Metrics) -> dict[str, float]:
    """AP (the primary mAP50-95) of each half of the evaluated images (``evaluate.half_of``: sorted by path,
    alternately even and odd), from the evaluation's own per-image statistics."""
    return {h: round(m.mAP50_95, 4) for h, m in metrics.halves.items()}


def per_class(metrics: Metrics) -> dict:
    """mAP50_95 per class (``per_class``; segmentation: the mask's, and the box's in ``box_per_class``)."""
    out = {"per_class": metrics.primary.per_class}
    if metrics.mask is not None:
        out["box_per_class"] = metrics.box.per_class
    return out


def _cell(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value if value is not None else "")


def table(rows: list[dict], columns=COLUMNS, first: str = "Model") -> str:
    """A markdown table of ``rows`` (dicts with ``name`` and the columns). Segmentation rows (with Box and
    Mask groups) get the two-level layout: a Box / Mask header over P, R, mAP50, mAP50-95 each."""
    if rows and columns == COLUMNS and all("Box" in r for r in rows):
        return seg_table(rows, first)
    lines = [f"| {first} | " + " | ".join(columns) + " |", "|" + "---|" * (len(columns) + 1)]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(_cell(r.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def seg_table(rows: list[dict], first: str = "Model") -> str:
    n = len(SEG_COLUMNS)
    lines = [f"| {first} | " + " | ".join(" | ".join([g] + [""] * (n - 1)) for g in SEG_GROUPS) + " |",
             "|" + "---|" * (n * len(SEG_GROUPS) + 1),
             "| | " + " | ".join(list(SEG_COLUMNS) * len(SEG_GROUPS)) + " |"]
    for r in rows:
        cells = [_cell(r[g].get(c)) for g in SEG_GROUPS for c in SEG_COLUMNS]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


INTERVAL_NOTE = ("[low, high] beside an AP difference: its 95% paired-bootstrap interval (the evaluation images drawn "
                 "again with replacement, both models scored on each draw). A difference whose interval holds 0 is a "
                 "tie: these images cannot tell the two models apart.")


def deltas(rows: list[dict], reference: str = "Origin") -> list[dict]:
    """Rows 'X vs Origin' with signed differences, as in the reference README's comparison table."""
    base = next((r for r in rows if r["name"] == reference), None)
    if base is None:
        return []
    out = []
    for r in rows:
        if r is base:
            continue
        label = r["name"] if r["name"].startswith("INT8") else f"INT8 {r['name']}"
        d = {"name": f"{label} vs {reference}"}
        for c in COLUMNS:
            d[c] = f"{r[c] - base[c]:+.4f}"
        interval = (r.get("vs_origin") or {}).get("interval") if reference == "Origin" else None
        if interval:  # the published form: the difference and its 95% paired-bootstrap interval
            d["AP"] += f" [{interval[0]:+.4f}, {interval[1]:+.4f}]"
        for g in SEG_GROUPS:
            if g in r and g in base:
                d[g] = {c: f"{r[g][c] - base[g][c]:+.4f}" for c in SEG_COLUMNS}
        out.append(d)
    return out


def comparison_markdown(rows: list[dict], title: str, selection: dict | None = None, budget: dict | None = None,
                        stopped: dict | None = None) -> str:
    """report.md; ``stopped``: report.json's ``finetuning_stopped`` (fine-tuning diverged: its sentence comes first)."""
    parts = [f"# {title}"]
    if stopped:
        parts += ["", "## Fine-tuning diverged", "", stopped["sentence"][:1].upper() + stopped["sentence"][1:]]
    parts += ["", "## Evaluation results", "", table(rows) if rows else NOTHING_EVALUATED]
    diff = deltas(rows)
    if diff:
        parts += ["", "## Evaluation comparison", "", table(diff, first="Comparison")]
        if any("[" in str(d.get("AP")) for d in diff):
            parts += ["", INTERVAL_NOTE]
    if selection:
        parts += ["", "## Selection", "", SELECTION_NOTE, "", selection_table(selection)]
    if budget:
        parts += ["", "## Accuracy budget", "", BUDGET_NOTE, "", budget_table(budget)]
    return "\n".join(parts) + "\n"


BUDGET_NOTE = ("Every step was decided on the held-out training images alone; the evaluation images were scored for "
               "this report only, on the steps kept.")


def _spread(budget: dict) -> str:
    """`` (+/- s against FP)``: the bootstrap spread of the evaluation images' difference from FP, where measured."""
    spread = budget.get("evaluation_spread")
    return "" if spread is None else f" (+/- {spread:.4f} against FP: the spread over bootstrap draws of its images)"


def budget_table(budget: dict) -> str:
    """report.md's table of the accuracy budget's steps (``utils/qat/run/budget.py``), then its outcome."""
    fp, confidence = budget["fp_holdout_AP"], budget.get("confidence", 0.5)
    lines = [f"Budget: mAP50-95 at most {budget['max_drop']:g} below FP ({fp:.4f}) on "
             f"{budget['holdout']['holdout_images']} held-out training images, at {confidence:.0%} confidence (the "
             f"bound: the difference from FP that {confidence:.0%} of bootstrap draws over those images stay "
             "above).", "",
             "| Step | kind | tried | held-out AP | vs FP | bound | kept | evaluation AP |", "|" + "---|" * 8]
    for s in budget["steps"]:
        kept = "met" if s.get("met") else "yes" if s["kept"] else "no"
        lines.append(f"| {s['step']} | {s['kind']} | {s['tried']} | {s['holdout_AP']:.4f} | {-s['drop']:+.4f} "
                     f"| {-s['drop_bound']:+.4f} | {kept} | {_cell(s.get('evaluation_AP'))} |")
    if "met" in budget:
        layers = ", ".join(map(str, budget["fp_layers"])) or "none"
        lines += ["", f"{'Met' if budget['met'] else 'Not met'}: held-out {budget['holdout_AP']:.4f} "
                      f"({-budget['drop']:+.4f}, bound {-budget['drop_bound']:+.4f}); evaluation "
                      f"{_cell(budget.get('evaluation_AP'))}{_spread(budget)}; calibration "
                      f"{budget['calibration']}; layers in FP: {layers}; {budget['int8_convs']} of {budget['convs']} "
                      f"convolutions INT8 ({budget['int8_share']:.1%}); {budget['seconds']:.0f} s."]
    return "\n".join(lines)


#: How the evaluation images are halved (``evaluate.half_of``), as report.json's ``selection`` states it.
HALVES_RULE = ("the evaluated images sorted by file path, alternately: positions 0, 2, 4, ... form the even half, "
               "1, 3, 5, ... the odd half")
SELECTION_NOTE = ("best is the stage `qat_best` holds: the highest AP on the evaluation images themselves, so its "
                  "score is optimistic. Selection-free: the stage (PTQ or an epoch) with the highest AP on one half "
                  "of those images, scored on the other half, beside Origin and PTQ on that same half; the halves "
                  "are " + HALVES_RULE + ".")


def selection(rows: list[dict], epochs: list[dict], best_epoch: int) -> dict | None:
    """report.json's ``selection``: which stage ``qat_best`` holds (``best``: epoch ``best_epoch``, 0 for the PTQ
    model, chosen on the full evaluation set, the one it is scored on), the ``last`` epoch, and ``selection_free``:
    the stage (PTQ, when it was evaluated, or an epoch) with the highest AP on one half of the evaluation images,
    scored on the other half, both ways and their mean, each beside Origin's and PTQ's AP on the same images
    (None where not evaluated). Ties go to the earlier stage, as for ``qat_best``. None before the first epoch."""
    if not epochs:
        return None
    named = {r["name"]: r for r in rows}
    origin, ptq = named.get("Origin"), named.get("PTQ")
    stages = [{"stage": "PTQ", "epoch": 0, "AP": ptq["AP"], "halves": ptq.get("halves")}] if ptq else []
    stages += [{"stage": f"QAT epoch {e['epoch']}", "epoch": e["epoch"], "AP": e["AP"], "halves": e.get("halves")}
               for e in epochs]

    def pick(stage: dict, chosen_on: str, scored_on: str) -> dict:
        def ap(r):
            return None if r is None else r["AP"] if scored_on == "all" else (r.get("halves") or {}).get(scored_on)
        return {"chosen_on": chosen_on, "scored_on": scored_on, "stage": stage["stage"], "epoch": stage["epoch"],
                "AP": ap(stage), "Origin": ap(origin), "PTQ": ap(ptq)}

    best = next((s for s in stages if s["epoch"] == best_epoch), stages[-1])
    out = {"halves": HALVES_RULE,
           "best": {**pick(best, "all", "all"), "note": "qat_best: chosen on the evaluation images it is scored on"},
           "last": pick(stages[-1], "none", "all")}
    if all(s["halves"] for s in stages):
        free = {}
        for chosen, scored in (("even", "odd"), ("odd", "even")):
            top = max(stages, key=lambda s: s["halves"][chosen])  # the first of equals: the earlier stage
            free[f"{chosen}_to_{scored}"] = pick(top, chosen, scored)
        pair = list(free.values())
        free["mean"] = {key: None if any(p[key] is None for p in pair) else round(sum(p[key] for p in pair) / 2, 4)
                        for key in ("AP", "Origin", "PTQ")}
        out["selection_free"] = free
    return out


def selection_table(sel: dict) -> str:
    """report.md's table of :func:`selection`: each pick's AP and its difference from Origin and PTQ on the same
    images."""
    def diff(a, b):
        return "" if a is None or b is None else f"{a - b:+.4f}"

    picks = [("best (`qat_best`)", sel["best"]), ("last", sel["last"])]
    free = sel.get("selection_free", {})
    picks += [("selection-free", free[k]) for k in ("even_to_odd", "odd_to_even") if k in free]
    if "mean" in free:
        picks.append(("selection-free, mean", {"chosen_on": "", "scored_on": "both halves", "stage": "", **free["mean"]}))
    lines = ["| Pick | chosen on | scored on | stage | AP | Origin | PTQ | vs Origin | vs PTQ |", "|" + "---|" * 9]
    for name, p in picks:
        where = {"all": "all images", "even": "even half", "odd": "odd half", "none": "- (the last epoch)"}
        lines.append(f"| {name} | {where.get(p['chosen_on'], p['chosen_on'])} | {where.get(p['scored_on'], p['scored_on'])} "
                     f"| {p['stage']} | {_cell(p['AP'])} | {_cell(p['Origin'])} | {_cell(p['PTQ'])} "
                     f"| {diff(p['AP'], p['Origin'])} | {diff(p['AP'], p['PTQ'])} |")
    return "\n".join(lines)


def write_report(run_dir: Path, rows: list[dict], epochs: list[dict], title: str, **meta) -> None:
    """report.json + report.md (+ qat_ap.png when there are epochs), each written atomically. ``meta``
    (e.g. world_size, calibration_seconds, ``selection``) goes into report.json beside the models and epochs."""
    run_dir = Path(run_dir)
    write_text(run_dir / "report.json", json.dumps({"title": title, **meta, "models": rows, "epochs": epochs}, indent=2))
    write_text(run_dir / "report.md", comparison_markdown(rows, title, meta.get("selection"), meta.get("budget"),
                                                          meta.get("finetuning_stopped")))
    if epochs:
        plot_epochs(run_dir / "qat_ap.png", epochs, rows)


def vs_reference(report_json: str | Path, metrics: Metrics) -> dict:
    """``{"vs_origin": ...}`` for an evaluation added to a run's report: its difference from that run's FP model with
    the paired-bootstrap interval, from the FP per-image statistics the run kept beside report.json; nothing where
    the run kept none, or scored other images (then a notice says why)."""
    from utils.qat.evaluation import resample
    kept = Path(report_json).parent / resample.REFERENCE_FILE
    if not kept.is_file():
        return {}
    try:
        paired = resample.PairedBootstrap(resample.load_images(kept))(metrics)
    except (ValueError, KeyError, OSError) as e:
        print(f"notice: no interval against FP for this row ({e}).")
        return {}
    return {"vs_origin": resample.record(paired)}


def add_row(report_json: str | Path, row: dict) -> None:
    """Add (or replace, by name) one evaluated model in a qat.py report and re-render its report.md."""
    report_json = Path(report_json)
    report = json.loads(report_json.read_text())
    models = [r for r in report.pop("models") if r["name"] != row["name"]] + [row]
    epochs, title = report.pop("epochs"), report.pop("title", "yolov9-qat")
    write_report(report_json.parent, models, epochs, title, **report)


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_epochs(path: Path, epochs: list[dict], rows: list[dict]) -> None:
    """AP per QAT epoch, with the Origin and PTQ levels as lines."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    seg = any("box_AP" in e for e in epochs)
    shown = [e for e in epochs if e.get("AP") is not None]
    ax.plot([e["epoch"] for e in shown], [e["AP"] for e in shown], "o-", color="tab:blue",
            label="QAT (mask)" if seg else "QAT")
    if seg:
        ax.plot([e["epoch"] for e in shown], [e["box_AP"] for e in shown], "s-", color="tab:green", label="QAT (box)")
    for r in rows:
        if r["name"] in ("Origin", "PTQ"):
            style = {"linestyle": "--" if r["name"] == "Origin" else ":",
                     "color": "gray" if r["name"] == "Origin" else "tab:orange"}
            ax.axhline(r["AP"], label=f"{r['name']} (mask)" if seg else r["name"], **style)
            if seg and "Box" in r:
                ax.axhline(r["Box"]["mAP50-95"], alpha=0.5, **style)
    ax.set_xlabel("epoch")
    ax.set_ylabel("mAP50-95 (box and mask)" if seg else "mAP50-95")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)


def plot_sensitivity(path: Path, layers: list[dict], baseline: float | None, top: int = 20) -> None:
    """Bar chart: AP with each layer kept in FP (the higher, the more that layer hurts when quantized)."""
    plt = _pyplot()
    shown = layers[:top]
    fig, ax = plt.subplots(figsize=(max(6, 0.4 * len(shown)), 3.8), dpi=120)
    ax.bar([str(l["layer"]) for l in shown], [l["AP"] for l in shown], color="tab:blue")
    if baseline is not None:
        ax.axhline(baseline, color="tab:orange", linestyle=":", label="all layers INT8 (PTQ)")
        ax.legend()
    lo = min([l["AP"] for l in shown] + ([baseline] if baseline is not None else []))
    hi = max([l["AP"] for l in shown] + ([baseline] if baseline is not None else []))
    ax.set_ylim(max(0.0, lo - 0.02), hi + 0.01)
    ax.set_xlabel("layer kept in FP (model.model index)")
    ax.set_ylabel("mAP50-95")
    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
