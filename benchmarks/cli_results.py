"""The published accuracy tables, from the commands users run, as users run them.

For each weights file and seed: `qat.py quantize`, `export_qat.py` of the best and of the last epoch (of the budget's
model, for a `--max-drop` run), and `val_trt.py --backend onnxruntime` of each exported graph, run as subprocesses in
a patched YOLOv9 tree, each with its exit status, wall time and log; the numbers are read back from the JSON files
those commands write (report.json, val_trt's results.json), nothing is evaluated here. Writes LABEL.json, LABEL.md
(per run: FP, PTQ, every epoch, best, last, selection-free, INT8 ONNX Runtime of best and last, times; then the
summary across seeds) and LABEL.png (AP per epoch per seed) into --out, the logs into --out/LABEL-logs/.

Run from this repository; --tree is a YOLOv9 tree, copied and patched with this checkout's overlay into --work
(--patched: run in --tree as it is). The YOLOv9-t headline runs (two seeds at once on one GPU; a tree with ELAN1 and
AConv, the data yaml's path: filled by --dataset-root):

    python3 benchmarks/cli_results.py --tree /path/to/yolov9 --weights ../shared/weights/yolov9-t-coco.pt \\
        --data ../shared/datasets/coco-qat.yaml --dataset-root ../shared/datasets --seeds 57 1 --jobs 2 \\
        --extra "--device 0 --workers 8" --out benchmarks/results --label yolov9-t-coco-h100

--jobs N runs N (weights, seed) pipelines at once (on one GPU: each its own run folder); their times are then
measured on a shared machine, and the outputs say so (``settings.concurrent``, times marked *). SIGTERM or Ctrl-C
stops the running commands (each saves what it has) and writes what was done. The result set names no path of this
machine: the commands, the JSON and the logs write $REPO, $YOLOV9_DIR, $SHARED and $WORK instead
(benchmarks/results/README.md).

`cli_results.py custom-model` makes the custom model the `custom-*` sets quantize (benchmarks/parts/custom_model.py:
upstream train.py fine-tunes the COCO YOLOv9-t on a few classes); `cli_results.py custom-model --help` gives its flags.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # benchmarks/parts/
from parts import portable  # noqa: E402

SCRIPTS = {"detect": "qat.py", "segment": "segment/qat_seg.py"}
EXPORT = "--include onnx --dynamic --simplify"  # README's Workflow step 3


class Refused(Exception):
    """A wrong flag or input, in one sentence: printed as ``error: ...`` with exit status 2, before any command."""


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C is (exit status 128 + the signal's number)."""
    signum = signal.SIGTERM


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", required=True, help="a YOLOv9 tree (copied into --work and patched, unless --patched)")
    p.add_argument("--patched", action="store_true", help="run in --tree as it is (already patched)")
    p.add_argument("--weights", nargs="+", required=True, help="FP checkpoints to quantize")
    p.add_argument("--data", required=True, help="dataset yaml; its path: absolute, or set by --dataset-root")
    p.add_argument("--dataset-root", default=None,
                   help="the folder the yaml's train / val are relative to: a copy of the yaml with this path: is "
                        "written into --work and used")
    p.add_argument("--seeds", nargs="+", type=int, default=[57], help="quantize --seed, one run each (default: 57)")
    p.add_argument("--task", choices=sorted(SCRIPTS), default="detect", help="qat.py or segment/qat_seg.py")
    p.add_argument("--extra", default="", help="more quantize flags, e.g. '--device 0 --workers 8'")
    p.add_argument("--export-flags", default=EXPORT,
                   help="export_qat.py flags besides --weights and --imgsz (quantize's) (default: %(default)s)")
    p.add_argument("--val-extra", default="--device cpu",
                   help="more val_trt.py flags (default: %(default)s: ONNX Runtime on the host CPU; the size, batch "
                        "and thresholds are quantize's)")
    p.add_argument("--jobs", type=int, default=1, help="pipelines run at once (default: 1)")
    p.add_argument("--out", required=True, help="folder of the result set (LABEL.json, .md, .png, LABEL-logs/)")
    p.add_argument("--label", default="cli-results", help="name of the result files and title")
    p.add_argument("--work", default=None,
                   help="folder for the tree copy, runs, checkpoints and graphs (default: runs/cli_results/LABEL)")
    p.add_argument("--python", default=sys.executable, help="interpreter of the commands (default: this one)")
    return p


# ---- inputs -----------------------------------------------------------------------------------------------

def check_inputs(args) -> None:
    """Every path made absolute (the commands run in the tree) and checked before anything runs."""
    import yaml
    if args.jobs < 1:
        raise Refused(f"--jobs {args.jobs} is out of range; pass 1 or more.")
    args.tree = Path(args.tree).resolve()
    if not (args.tree / "models" / "yolo.py").is_file():
        raise Refused(f"--tree {args.tree} is not a YOLOv9 tree (no models/yolo.py).")
    if args.patched and not (args.tree / SCRIPTS[args.task]).is_file():
        raise Refused(f"--patched: {args.tree} has no {SCRIPTS[args.task]}; patch it (./patch_yolov9.sh) or leave "
                      f"--patched out.")
    ours = {"--weights", "--data", "--seed", "--project", "--name", "--exist-ok"}
    taken = [f for f in shlex.split(args.extra) if f.split("=")[0] in ours]
    if taken:
        raise Refused(f"--extra {' '.join(taken)}: this script sets {', '.join(sorted(ours))} itself; use its own "
                      f"--weights, --data, --seeds and --work.")
    args.weights = [Path(w).resolve() for w in args.weights]
    for w in args.weights:
        if not w.is_file():
            raise Refused(f"--weights {w} not found.")
    stems = [w.stem for w in args.weights]
    if len(set(stems)) != len(stems):
        raise Refused("--weights: two files share a name; run folders are named after the weights, rename one.")
    data = Path(args.data).resolve()
    if not data.is_file():
        raise Refused(f"--data {data} not found.")
    args.data = data
    args.out = Path(args.out).resolve()
    args.work = Path(args.work or Path("runs") / "cli_results" / args.label).resolve()
    y = yaml.safe_load(data.read_text()) or {}
    if args.dataset_root:
        y["path"] = str(Path(args.dataset_root).resolve())
    elif y.get("path") and not Path(y["path"]).is_absolute():
        raise Refused(f"{data} has a relative path: ({y['path']}), which YOLOv9 takes from its own root; pass "
                      f"--dataset-root with the folder it means.")
    root = Path(y.get("path") or args.tree)  # without path:, YOLOv9 takes train / val from its root
    for split in ("train", "val"):
        if not y.get(split):
            raise Refused(f"{data} has no {split}: entry.")
        for entry in y[split] if isinstance(y[split], list) else [y[split]]:
            where = root / entry  # an absolute entry stays itself
            if not where.exists():
                raise Refused(f"{data}: the {split} images {where} do not exist; pass --dataset-root with the folder "
                              f"holding the dataset.")
    if args.dataset_root:
        args.work.mkdir(parents=True, exist_ok=True)
        args.data = args.work / data.name
        args.data.write_text(yaml.safe_dump(y, sort_keys=False))


def prepare_tree(args, log: Path) -> Path:
    """The tree the commands run in: --tree (--patched), or a fresh copy patched with this checkout's overlay."""
    if args.patched:
        return args.tree
    tree = args.work / "yolov9"
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(args.tree, tree, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__", "runs"))
    for folder, _, _ in os.walk(tree):  # stand-in trees come with read-only folders
        os.chmod(folder, os.stat(folder).st_mode | 0o200)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        r = subprocess.run(["bash", str(REPO / "patch_yolov9.sh"), str(tree)], stdout=f, stderr=subprocess.STDOUT)
    if r.returncode:
        raise Refused(f"patch_yolov9.sh failed on the copy of {args.tree} (exit {r.returncode}); see {log}.")
    return tree


# ---- running ------------------------------------------------------------------------------------------------

class Runner:
    """Runs commands in ``tree``, each logged to ``logs/<run>/<step>.log``. ``stop()`` (Ctrl-C, SIGTERM) ends the
    running ones with SIGTERM (each saves what it has, as on Ctrl-C) and launches no more."""

    def __init__(self, tree: Path, python: str, logs: Path, clean=lambda text: text):
        self.tree, self.python, self.logs, self.clean = tree, python, logs, clean
        self.stopped = threading.Event()
        self.running: set[subprocess.Popen] = set()

    def __call__(self, run: str, step: str, argv: list[str]) -> dict:
        cmd = [self.python, *argv]
        log = self.logs / run / f"{step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        # as users type it, from the top of the tree (the interpreter is this run's --python)
        record = {"step": step, "command": shlex.join(["python3", *argv]), "log": str(log.relative_to(self.logs.parent))}
        if self.stopped.is_set():
            return {**record, "returncode": None, "seconds": None, "skipped": "stopped before it started"}
        print(f"[{run}] {step}: {shlex.join(cmd)}", flush=True)
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, cwd=self.tree, stdout=f, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            self.running.add(proc)
            try:
                rc = proc.wait()
            finally:
                self.running.discard(proc)
        seconds = round(time.monotonic() - start, 1)
        log.write_text(self.clean(log.read_text(errors="replace")))  # no path of this machine in the result set
        print(f"[{run}] {step}: exit {rc}, {seconds} s", flush=True)
        return {**record, "returncode": rc, "seconds": seconds}

    def stop(self) -> None:
        self.stopped.set()
        for proc in list(self.running):
            proc.terminate()


def new_record(args, weights: Path, seed: int) -> dict:
    name = f"{weights.stem}-s{seed}"
    return {"name": name, "weights": str(weights), "seed": seed, "run_dir": str(args.work / "runs" / name),
            "commands": [], "report": None, "onnxruntime": {}, "errors": []}


def pipeline(args, runner: Runner, rec: dict, on_change) -> None:
    """quantize, export best (and last, when another epoch), val_trt of each graph, filling the run's record
    ``rec`` (:func:`new_record`) as they go; ``on_change()`` after each command."""
    name, weights, seed = rec["name"], Path(rec["weights"]), rec["seed"]
    runs = args.work / "runs"
    run_dir = runs / name

    def step(label: str, argv: list[str]) -> bool:
        c = runner(name, label, argv)
        rec["commands"].append(c)
        if c["returncode"] != 0:
            rec["errors"].append(f"{label}: " + (c.get("skipped") or f"exit {c['returncode']}, see {c['log']}"))
        on_change()
        return c["returncode"] == 0

    (run_dir / "report.json").unlink(missing_ok=True)  # an earlier invocation's, never read as this run's
    ok = step("quantize", [SCRIPTS[args.task], "quantize", "--weights", str(weights), "--data", str(args.data),
                           "--seed", str(seed), "--project", str(runs), "--name", name, "--exist-ok",
                           *shlex.split(args.extra)])
    if not (run_dir / "report.json").is_file():
        return
    report = json.loads((run_dir / "report.json").read_text())
    rec["report"] = {k: report.get(k) for k in ("models", "epochs", "selection", "calibration_seconds", "provenance",
                                                "world_size", "budget")}
    rec["report"]["arguments"] = {k: report["arguments"].get(k) for k in
                                  ("imgsz", "batch_size", "epochs", "iters", "calib_method", "hyp", "workers", "device")}
    on_change()
    budget = (report.get("budget") or {}).get("met") is not None  # --max-drop: qat_best is the budget's model
    if not ok or not (report.get("epochs") or budget):
        return
    arguments = report["arguments"]
    best = run_dir / "weights" / f"qat_best_{weights.stem}.pt"
    if budget:
        graphs = {"budget": (best, None)}
    else:
        sel = report.get("selection") or {}
        qat_row = next((m for m in report["models"] if m["name"] == "QAT"), {})
        best_epoch = (sel.get("best") or {}).get("epoch", qat_row.get("epoch"))
        last_epoch = report["epochs"][-1]["epoch"]
        graphs = {"best": (best, best_epoch)}
        if best_epoch != last_epoch:
            graphs["last"] = (Path(report["epochs"][-1]["weights"]), last_epoch)
    for pick, (pt, epoch) in graphs.items():
        if not step(f"export-{pick}", ["export_qat.py", "--weights", str(pt), "--imgsz", str(arguments["imgsz"]),
                                       *shlex.split(args.export_flags)]):
            continue
        onnx = pt.with_suffix(".onnx")
        val = args.work / "val_trt" / name
        if step(f"val_trt-{pick}", ["val_trt.py", "--onnx", str(onnx), "--backend", "onnxruntime", "--data",
                                    str(args.data), "--imgsz", str(arguments["imgsz"]), "--batch-size",
                                    str(arguments["batch_size"]), "--conf-thres", str(arguments["conf_thres"]),
                                    "--iou-thres", str(arguments["iou_thres"]), "--project", str(val), "--name", pick,
                                    "--exist-ok", *shlex.split(args.val_extra)]):
            result = json.loads((val / pick / "results.json").read_text())
            rec["onnxruntime"][pick] = {"epoch": epoch, "onnx": str(onnx),
                                        **{k: result.get(k) for k in ("AP", "AP50", "halves", "Box", "Mask", "images",
                                                                      "seconds")}}
    if "best" in graphs and "last" not in graphs and "best" in rec["onnxruntime"]:
        rec["onnxruntime"]["last"] = {**rec["onnxruntime"]["best"], "same_as": "best"}
    on_change()


def machine() -> dict:
    def version(package):
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return None
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
            **{p: version(p) for p in ("torch", "nvidia-modelopt", "onnxruntime", "onnxruntime-gpu")}}
    if shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["gpu"] = r.stdout.strip().splitlines() if r.returncode == 0 else None
    return info


# ---- the result set -------------------------------------------------------------------------------------------

def s_per_step(epochs: list[dict]) -> float | None:
    """Seconds per QAT step over the run's epochs (each epoch's training time over its steps: loading included)."""
    steps = sum(e.get("steps") or 0 for e in epochs)
    return round(sum(e.get("train_seconds") or 0 for e in epochs) / steps, 4) if steps else None


#: The summary's time figures (seconds): flagged when the runs shared the machine.
TIMES = {"calibration s": ".1f", "s per QAT step": ".3f", "quantize command s": ".0f"}


def figures(rec: dict) -> dict:
    """The numbers of one run the summary compares (None where the run did not get that far): APs on all images;
    the selection-free pick's, the mean of its two half scores, compared with FP's and PTQ's means on the same
    halves (a mean of half-set APs is not comparable with an all-image AP); times."""
    report, ort = rec.get("report") or {}, rec.get("onnxruntime", {})
    models = {m["name"]: m for m in report.get("models") or []}
    sel = report.get("selection") or {}
    free = (sel.get("selection_free") or {}).get("mean") or {}
    quantize = next((c for c in rec["commands"] if c["step"] == "quantize"), {})
    fp = models.get("Origin", {}).get("AP")

    def minus(a, b):
        return None if a is None or b is None else round(a - b, 4)
    aps = {"FP": fp, "PTQ": models.get("PTQ", {}).get("AP"), "best": (sel.get("best") or {}).get("AP"),
           "last": (sel.get("last") or {}).get("AP"), "INT8 ORT best": ort.get("best", {}).get("AP"),
           "INT8 ORT last": ort.get("last", {}).get("AP"), "budget": models.get("Budget", {}).get("AP"),
           "INT8 ORT budget": ort.get("budget", {}).get("AP")}
    budget = report.get("budget") or {}
    held = {"budget held-out - FP": minus(budget.get("holdout_AP"), budget.get("fp_holdout_AP")),
            "budget INT8 conv share": budget.get("int8_share"), "budget met (held-out)": budget.get("met")}
    return {**aps, **{f"{k} - FP": minus(v, fp) for k, v in aps.items() if k != "FP"}, **held,
            "selection-free - FP (halves)": minus(free.get("AP"), free.get("Origin")),
            "selection-free - PTQ (halves)": minus(free.get("AP"), free.get("PTQ")),
            "best epoch": (sel.get("best") or {}).get("epoch"),
            "calibration s": report.get("calibration_seconds"), "s per QAT step": s_per_step(report.get("epochs") or []),
            "quantize command s": quantize.get("seconds")}


def summary(runs: list[dict]) -> dict:
    """Per weights file: each figure's mean, min, max and count over its seeds."""
    out: dict = {}
    for weights in dict.fromkeys(r["weights"] for r in runs):
        rows = [figures(r) for r in runs if r["weights"] == weights]
        out[weights] = {}
        for key in rows[0]:
            values = [row[key] for row in rows if row[key] is not None]
            out[weights][key] = ({"mean": round(statistics.fmean(values), 4), "min": round(min(values), 4),
                                  "max": round(max(values), 4), "n": len(values)} if values else None)
    return out


def _f(v, signed: bool = False) -> str:
    if v is None:
        return ""
    return f"{v:+.4f}" if signed else f"{v:.4f}" if isinstance(v, float) else str(v)


def run_markdown(rec: dict, concurrent: bool) -> list[str]:
    report, ort = rec.get("report") or {}, rec.get("onnxruntime", {})
    lines = [f"## {Path(rec['weights']).name}, seed {rec['seed']}", ""]
    if rec["errors"]:
        lines += ["**Failed**: " + "; ".join(rec["errors"]), ""]
    models = {m["name"]: m for m in report.get("models") or []}
    origin, ptq = models.get("Origin"), models.get("PTQ")
    fp = origin["AP"] if origin else None
    stages = [("FP (Origin)", origin), ("PTQ", ptq)] + [(f"QAT epoch {e['epoch']}", e) for e in report.get("epochs") or []]
    lines += ["| Stage | AP | AP even half | AP odd half | vs FP | loss | steps | train s |", "|" + "---|" * 8]
    for label, s in stages:
        if s is None:
            continue
        h = s.get("halves") or {}
        lines.append(f"| {label} | {_f(s['AP'])} | {_f(h.get('even'))} | {_f(h.get('odd'))} | "
                     f"{_f(None if fp is None or label.startswith('FP') else s['AP'] - fp, True)} | "
                     f"{_f(s.get('loss'))} | {s.get('steps', '')} | {s.get('train_seconds', '')} |")
    sel = report.get("selection")
    if sel:
        free = sel.get("selection_free") or {}
        picks = [("best (`qat_best`, chosen on all images)", "all images", sel["best"]),
                 ("last", "all images", sel["last"])]
        picks += [(f"selection-free: chosen on the {p['chosen_on']} half", f"{p['scored_on']} half", p)
                  for p in (free.get("even_to_odd"), free.get("odd_to_even")) if p]
        if free.get("mean"):
            picks.append(("selection-free, mean of both", "both halves", {"stage": "", **free["mean"]}))
        for pick in ("best", "last"):
            if pick in ort:
                o = ort[pick]
                picks.append((f"INT8 ONNX Runtime, {pick}", "all images",
                              {"stage": f"epoch {o['epoch']}" + (" (the best graph)" if o.get("same_as") else ""),
                               "AP": o["AP"], "Origin": fp, "PTQ": ptq["AP"] if ptq else None}))
        lines += ["", "| Pick | scored on | stage | AP | FP there | PTQ there | vs FP | vs PTQ |", "|" + "---|" * 8]
        for label, where, p in picks:
            vs = [None if p.get(k) is None or p.get("AP") is None else p["AP"] - p[k] for k in ("Origin", "PTQ")]
            lines.append(f"| {label} | {where} | {p.get('stage', '')} | {_f(p.get('AP'))} | {_f(p.get('Origin'))} | "
                         f"{_f(p.get('PTQ'))} | {_f(vs[0], True)} | {_f(vs[1], True)} |")
    lines += budget_markdown(report.get("budget"), ort.get("budget"), fp)
    step_s = s_per_step(report.get("epochs") or [])
    flag = " (runs concurrent: shared machine)" if concurrent else ""
    qat_s = f"; QAT {step_s} s per step (epoch time over steps, data loading included)" if step_s else ""
    lines += ["", f"Calibration {report.get('calibration_seconds')} s{qat_s}{flag}.", "",
              "| Command | exit | seconds | log |", "|---|---|---|---|"]
    for c in rec["commands"]:
        lines.append(f"| `{c['step']}` | {c['returncode']} | {c['seconds']}{' *' if concurrent else ''} | {c['log']} |")
    lines += ["", "<details><summary>command lines</summary>", ""]
    lines += [f"    {c['command']}" for c in rec["commands"]] + ["", "</details>", ""]
    return lines


def budget_markdown(budget: dict | None, ort: dict | None, fp: float | None) -> list[str]:
    """A --max-drop run's steps: each one's held-out AP (what it was decided on) beside its evaluation AP (kept
    steps only, for this table), then the exported graph of the model it ended with on ONNX Runtime."""
    if not budget:
        return []
    fp_held = budget["fp_holdout_AP"]
    confidence = budget.get("confidence", 0.5)
    lines = ["", f"Budget --max-drop {budget['max_drop']:g} at {confidence:.0%} confidence: "
             f"{budget['holdout']['holdout_images']} held-out training images (FP {fp_held:.4f} there), evaluation "
             f"images FP {_f(fp)}.", "",
             f"| Step | kind | tried | held-out AP | vs FP held-out | {confidence:.0%} bound | kept | evaluation AP "
             "| vs FP evaluation |", "|" + "---|" * 9]
    for st in budget.get("steps") or []:
        ev = st.get("evaluation_AP")
        kept = "met" if st.get("met") else "yes" if st["kept"] else "no"
        bound = st.get("drop_bound")
        lines.append(f"| {st['step']} | {st['kind']} | {st['tried']} | {_f(st['holdout_AP'])} | "
                     f"{_f(-st['drop'], True)} | {_f(None if bound is None else -bound, True)} | "
                     f"{kept} | {_f(ev)} | {_f(None if ev is None or fp is None else ev - fp, True)} |")
    if "met" in budget:
        layers = ", ".join(map(str, budget.get("fp_layers") or [])) or "none"
        bound = budget.get("drop_bound")
        sure = "" if bound is None else f", {-bound:+.4f} or better at {confidence:.0%} confidence"
        lines += ["", f"{'Met' if budget['met'] else 'Not met'} on the held-out images ({-budget['drop']:+.4f}{sure}); "
                  f"layers in FP: {layers}; {budget['int8_convs']} of {budget['convs']} convolutions INT8; "
                  f"{budget['seconds']:.0f} s of budget steps."]
    if budget.get("evaluation_spread") is not None:
        lines += [f"On the evaluation images: {_f(budget['evaluation_AP'])}, "
                  f"{_f(None if fp is None else budget['evaluation_AP'] - fp, True)} against FP, +/- "
                  f"{budget['evaluation_spread']:.4f} over bootstrap draws of those images."]
    if ort:
        lines += [f"The exported graph on ONNX Runtime: {_f(ort['AP'])} on the evaluation images "
                  f"({_f(None if fp is None else ort['AP'] - fp, True)} against FP)."]
    return lines


def render(result: dict) -> str:
    concurrent = result["settings"]["concurrent"]
    halves = next((r["report"]["selection"]["halves"] for r in result["runs"]
                   if (r.get("report") or {}).get("selection")), "sorted by path, alternately")
    lines = [f"# {result['label']}: the CLI's own numbers", "",
             f"Made by `{result['command']}` ({result['created']}); every figure is read from the report.json / "
             "results.json the commands below wrote. AP is mAP50-95 (the mask's for segmentation). `best` is chosen "
             "on the evaluation images it is scored on; selection-free is chosen on one half of them and scored on "
             f"the other ({halves}).", ""]
    if concurrent:
        lines += [f"**Timing**: {result['settings']['timing']}; every time (marked *) was measured while other runs "
                  "shared the machine, and is not a single run's time.", ""]
    lines += ["## Summary across seeds", "", "| weights | figure | mean | min | max | runs |", "|---|---|---|---|---|---|"]
    for weights, figs in result["summary"].items():
        for key, v in figs.items():
            if v is None:
                continue
            spec = TIMES.get(key, "+.4f" if " - " in key else "g" if key == "best epoch" else ".4f")
            mark = " *" if concurrent and key in TIMES else ""
            lines.append(f"| {Path(weights).name} | {key}{mark} | " + " | ".join(format(v[k], spec) for k in
                                                                               ("mean", "min", "max")) + f" | {v['n']} |")
    lines.append("")
    for rec in result["runs"]:
        lines += run_markdown(rec, concurrent)
    m = result["machine"]
    lines += ["## Machine", "", ", ".join(f"{k} {v}" for k, v in m.items() if v is not None), ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """AP per epoch (epoch 0: PTQ) per seed, one panel per weights file; FP dashed, the best epoch starred, INT8 ONNX
    Runtime of best and last as crosses. A --max-drop set draws its budget's steps instead (:func:`plot_budget`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    budgets = [r for r in result["runs"] if ((r.get("report") or {}).get("budget") or {}).get("steps")]
    if budgets:
        fig, axes = plt.subplots(1, len(budgets), figsize=(7 * len(budgets), 4.2), dpi=120, squeeze=False)
        for ax, rec in zip(axes[0], budgets):
            plot_budget(ax, rec)
        fig.tight_layout()
        _replace(path, lambda tmp: fig.savefig(tmp, format="png"))
        plt.close(fig)
        return
    weights = list(dict.fromkeys(r["weights"] for r in result["runs"] if r.get("report")))
    fig, axes = plt.subplots(1, len(weights), figsize=(6 * len(weights), 3.8), dpi=120, squeeze=False)
    for ax, w in zip(axes[0], weights):
        for i, rec in enumerate(r for r in result["runs"] if r["weights"] == w):
            report = rec.get("report") or {}
            models = {m["name"]: m for m in report.get("models") or []}
            color = f"C{i}"
            points = ([(0, models["PTQ"]["AP"])] if "PTQ" in models else []) + \
                [(e["epoch"], e["AP"]) for e in report.get("epochs") or []]
            if points:
                ax.plot(*zip(*points), "o-", ms=3, color=color, label=f"seed {rec['seed']}")
            if "Origin" in models:
                ax.axhline(models["Origin"]["AP"], color=color, linestyle="--", linewidth=0.8)
            best = (report.get("selection") or {}).get("best")
            if best:
                ax.plot([best["epoch"]], [best["AP"]], "*", ms=11, color=color)
            for o in rec.get("onnxruntime", {}).values():
                if o.get("epoch") is not None:  # a --max-drop run's graph has no epoch
                    ax.plot([o["epoch"]], [o["AP"]], "x", ms=7, color=color)
        ax.set_title(Path(w).name, fontsize=9)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("QAT epoch (0: PTQ)")
        ax.set_ylabel("mAP50-95")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="-- FP, * best, x INT8 ORT", title_fontsize=7)
    fig.tight_layout()
    _replace(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def plot_budget(ax, rec: dict) -> None:
    """One --max-drop run: each step in the order tried, its held-out difference from FP (filled: kept) with a line
    down to its bound, the evaluation images' difference for the kept steps, the exported graph's at the end, and
    the budget."""
    budget = rec["report"]["budget"]
    steps = budget["steps"]
    x = range(1, len(steps) + 1)
    for i, st in zip(x, steps):
        ax.plot([i, i], [-st["drop"], -st.get("drop_bound", st["drop"])], color="C0", linewidth=1)
        ax.plot([i], [-st["drop"]], "o", ms=5, color="C0", fillstyle="full" if st["kept"] else "none")
    fp = next((m["AP"] for m in rec["report"].get("models") or [] if m["name"] == "Origin"), None)
    if fp is not None:
        kept = [(i, st["evaluation_AP"] - fp) for i, st in zip(x, steps) if st.get("evaluation_AP") is not None]
        if kept:
            ax.plot(*zip(*kept), "s", ms=5, color="C1", label="evaluation images (kept steps)")
        graph = (rec.get("onnxruntime") or {}).get("budget")
        if graph:
            ax.plot([len(steps) + 1], [graph["AP"] - fp], "x", ms=8, color="C2", label="INT8 graph, ONNX Runtime")
    ax.axhline(-budget["max_drop"], color="C3", linestyle="--", linewidth=1, label=f"budget {-budget['max_drop'] + 0.0:g}")
    ax.axhline(0, color="grey", linewidth=0.6)
    ax.plot([], [], "o-", ms=5, color="C0", label=f"held-out, line to the {budget.get('confidence', 0.5):.0%} bound "
            "(filled: kept)")
    ax.set_xticks(list(x), [f"{st['step']}" for st in steps])
    ax.set_xlabel("step (1 calibration, 2 other calibrations, 3 FP layer, 4 epoch), in the order tried")
    ax.set_ylabel("mAP50-95 minus FP")
    ax.set_title(f"{Path(rec['weights']).name}, seed {rec['seed']}: --max-drop {budget['max_drop']:g}, "
                 f"{'met' if budget.get('met') else 'not met'}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _replace(path: Path, write) -> None:
    """Write ``path`` whole: into a hidden file beside it, renamed into place."""
    tmp = path.with_name(f".{path.name}.part")
    write(tmp)
    os.replace(tmp, path)


def cleaner(settings: dict):
    """What writes a text of this result set without this machine's paths (``portable.text``)."""
    trees = [settings["tree"], settings["patched_copy"]]
    return lambda text: portable.text(text, work=settings.get("work"), tree=[t for t in trees if t])


def save(result: dict, out: Path, with_plot: bool) -> None:
    result["summary"] = summary(result["runs"])
    label, clean = result["label"], cleaner(result["settings"])
    _replace(out / f"{label}.json", lambda tmp: tmp.write_text(clean(json.dumps(result, indent=2))))
    _replace(out / f"{label}.md", lambda tmp: tmp.write_text(clean(render(result))))
    if with_plot and any(r.get("report") for r in result["runs"]):
        plot(result, out / f"{label}.png")


def main(args) -> dict:
    check_inputs(args)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / f"{args.label}-logs"
    tree = prepare_tree(args, logs / "patch.log")
    runs = len(args.weights) * len(args.seeds)
    concurrent = min(args.jobs, runs) > 1
    print(f"tree: {tree}\nruns: {args.work / 'runs'}\nresults: {args.out}/{args.label}.{{json,md,png}}", flush=True)
    result = {"label": args.label, "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "command": portable.command() if __name__ == "__main__" else "(in-process)",
              "machine": machine(),
              "settings": {"tree": str(args.tree), "patched_copy": None if args.patched else str(tree),
                           "work": str(args.work),
                           "weights": [str(w) for w in args.weights], "data": str(args.data),
                           "dataset_root": args.dataset_root, "seeds": args.seeds, "task": args.task,
                           "extra": args.extra, "export_flags": args.export_flags,
                           "val_extra": args.val_extra, "jobs": args.jobs, "concurrent": concurrent,
                           "timing": f"{min(args.jobs, runs)} runs at once: times measured on a shared machine"
                           if concurrent else "one command at a time"},
              "runs": []}
    lock = threading.Lock()
    records: dict = {(w, s): None for w in args.weights for s in args.seeds}  # in order, filled as runs start

    def on_change(with_plot: bool = False):  # after every command; the plot after every run
        with lock:
            result["runs"] = [r for r in records.values() if r is not None]
            save(result, args.out, with_plot)

    runner = Runner(tree, args.python, logs, cleaner(result["settings"]))

    def terminate(signum, frame):
        raise Stopped
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = [pool.submit(_run_one, args, runner, records, key, on_change) for key in records]
            try:
                for f in futures:
                    f.result()
            except KeyboardInterrupt:
                if main_thread:
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one changes nothing
                print("stopping: the running commands get SIGTERM, no more start", flush=True)
                runner.stop()
                raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        result["failed"] = [f"{r['name']}: {e}" for r in records.values() if r is not None for e in r["errors"]]
        on_change(with_plot=True)
    failed = result["failed"]
    print(f"\nresults: {args.out / (args.label + '.md')}" + (f"; {len(failed)} failed: " + "; ".join(failed) if failed else ""))
    return result


def _run_one(args, runner: Runner, records: dict, key, on_change) -> None:
    rec = records[key] = new_record(args, *key)
    try:
        pipeline(args, runner, rec, on_change)
    except Exception as e:  # a report or results file unlike what the commands write: recorded, the others go on
        rec["errors"].append(f"{type(e).__name__}: {e}")
    on_change(with_plot=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["custom-model"]:
        from parts import custom_model
        parser = custom_model.get_args_parser()
        parser.prog = f"{Path(sys.argv[0]).name} custom-model"
        try:
            custom_model.main(parser.parse_args(sys.argv[2:]))
        except custom_model.Refused as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    try:
        outcome = main(get_args_parser().parse_args())
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"error: stopped by {signal.Signals(signum).name}; what was done is in the result set.", file=sys.stderr)
        sys.exit(128 + signum)
    sys.exit(1 if outcome["failed"] else 0)
