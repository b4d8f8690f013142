"""How far histograms built from a sample of each image's activations (``qat.py quantize --calib-sample``) move the
calibrated scales, and what they save: one calibration pass in which every activation histogram is kept both from
every value and, beside it, from each per-image budget given.

    python3 /path/to/yolov9-qat/benchmarks/diagnose.py calib-sample --weights yolov9-t-coco.pt --data coco.yaml \\
        --sample 4096 16384 65536 --out runs/calib-sample --label yolov9-t-2core

Run in a patched YOLOv9 tree. The calibration images are `qat.py quantize`'s (the first ``--calib-batches`` batches
of the train split, letterboxed, unaugmented); nothing is scored. Per budget: the MSE amax of every activation
quantizer (modelopt's histogram calibrators, before shared scales are tied) against the one from every value, as
|log ratio| (median, 90th percentile, largest) and the mean signed log ratio (a bias), and the seconds its
histograms took against every value's. Writes OUT/LABEL.json and OUT/LABEL.md.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402
compat.apply()
from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.errors import QATError  # noqa: E402

from parts import portable  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True, type=Path, help="the FP checkpoint (.pt)")
    p.add_argument("--data", required=True, help="dataset yaml: its train split calibrates")
    p.add_argument("--sample", type=int, nargs="+", default=[4096, 16384, 65536],
                   help="values per image to compare with every value (default: %(default)s)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--device", default="cpu", help="cpu (default) or a GPU")
    p.add_argument("--workers", type=int, default=2, help="dataloader workers")
    p.add_argument("--out", required=True, type=Path, help="folder of LABEL.json and LABEL.md")
    p.add_argument("--label", default="calib-sample", help="name of the result files (default: %(default)s)")
    return p


class FanOut:
    """Every modelopt histogram calibrator's ``collect``, while installed: the calibrator counts every value as
    modelopt does, and a copy of it per budget counts that budget's sample (``calib.collect_sample``); the seconds
    each took are summed."""

    def __init__(self, budgets: list[int]):
        from modelopt.torch.quantization.calib import HistogramCalibrator
        self.cls, self.budgets = HistogramCalibrator, budgets
        self.copies: dict[int, tuple[object, dict[int, object]]] = {}
        self.seconds = {0: 0.0, **{b: 0.0 for b in budgets}}

    def __enter__(self) -> FanOut:
        from utils.qat.quantize.calib import collect_sample
        whole = self.original = self.cls.collect

        def collect(calibrator, x) -> None:
            _, copies = self.copies.setdefault(id(calibrator), (calibrator, {b: copy.deepcopy(calibrator)
                                                                               for b in self.budgets}))
            for b, c in copies.items():
                start = time.perf_counter()
                if x[0].numel() <= b:  # the whole tensor: modelopt's own (collect_sample would call this patch)
                    whole(c, x)
                else:
                    collect_sample(c, b, x)
                self.seconds[b] += time.perf_counter() - start
            start = time.perf_counter()
            whole(calibrator, x)
            self.seconds[0] += time.perf_counter() - start
        self.cls.collect = collect
        return self

    def __exit__(self, *exc) -> None:
        self.cls.collect = self.original


def compare(fan: FanOut, names: dict[int, str]) -> list[dict]:
    from utils.qat.quantize.calib import histogram_amax

    def amax_of(c) -> float:  # the amax calibration gives a histogram (--calib-method mse)
        return float(histogram_amax(c, "mse", 0.0))
    rows = []
    for b in fan.budgets:
        ratios = []
        for key, (whole, copies) in fan.copies.items():
            if key in names and whole._calib_hist is not None:
                full, sampled = amax_of(whole), amax_of(copies[b])
                ratios.append((math.log(sampled / full), names[key], full, sampled))
        size = sorted(abs(r[0]) for r in ratios)
        worst = max(ratios, key=lambda r: abs(r[0]))
        rows.append({"per_image": b, "quantizers": len(ratios), "median": statistics.median(size),
                     "p90": size[int(0.9 * (len(size) - 1))], "max": size[-1],
                     "mean_signed": statistics.fmean(r[0] for r in ratios),
                     "worst": {"name": worst[1], "every_value": worst[2], "sampled": worst[3]},
                     "seconds": fan.seconds[b]})
    return rows


def render(doc: dict) -> str:
    lines = [f"# {doc['label']}: activation histograms from a sample of each image", "",
             f"Made by `{doc['command']}` ({doc['date']}; {doc['machine']}). {doc['weights']}, calibrated on "
             f"{doc['images']} train images at {doc['imgsz']} px ({doc['batches']} batches of {doc['batch_size']}); "
             f"nothing scored. Each row: the MSE amax of each of the {doc['rows'][0]['quantizers']} activation "
             "quantizers from the sampled histograms against the one from every value (before shared scales are "
             "tied), as |log ratio| (0.01: 1%), and the seconds the histograms took, every value's "
             f"{doc['every_value_seconds']:.1f} s.", "",
             "| values per image | median | 90th percentile | largest | mean signed (bias) | histogram s |",
             "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['per_image']} | {r['median']:.4f} | {r['p90']:.4f} | {r['max']:.4f} | "
                     f"{r['mean_signed']:+.4f} | {r['seconds']:.1f} |")
    lines += ["", "The largest move per row (quantizer: amax from every value -> sampled):", ""]
    lines += [f"- {r['per_image']}: {r['worst']['name']}: {r['worst']['every_value']:.3f} -> {r['worst']['sampled']:.3f}"
              for r in doc["rows"]]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> dict:
    import torch
    from utils.qat.core.device import cpu_description, keep_freed_memory, select_device
    from utils.qat.evaluation.data import label_files, load_data_yaml
    from utils.qat.model import checkpoint
    from utils.qat.quantize.config import QuantConfig
    from utils.qat.run.pipeline import ptq
    if any(b < 1 for b in args.sample):
        raise QATError(f"--sample {' '.join(map(str, args.sample))}: give numbers of values per image, 1 or more.")
    keep_freed_memory()
    device = select_device(args.device)
    fp = checkpoint.load_fp(args.weights)
    data = load_data_yaml(args.data, splits=("train",))
    with FanOut(sorted(set(args.sample))) as fan:
        start = time.perf_counter()
        qmodel, _ = ptq(fp, data, QuantConfig(method="mse", head_amax="calibrated"), imgsz=args.imgsz,
                        batch_size=args.batch_size, device=device, calib_batches=args.calib_batches,
                        workers=args.workers)
        seconds = time.perf_counter() - start
    names = {id(m._calibrator): n for n, m in qmodel.named_modules() if hasattr(m, "_calibrator")}
    images = min(len(label_files(data, "train")), args.calib_batches * args.batch_size)
    doc = {"label": args.label, "command": portable.command(work=args.out),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{cpu_description()[0]}, {len(os.sched_getaffinity(0))} CPUs usable, torch {torch.__version__}"
           if device.type == "cpu" else torch.cuda.get_device_name(device),
           "weights": args.weights.name, "imgsz": args.imgsz, "batch_size": args.batch_size,
           "batches": -(-images // args.batch_size), "images": images,
           "calibration_seconds": seconds, "every_value_seconds": fan.seconds[0], "rows": compare(fan, names)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_text(args.out / f"{args.label}.json", json.dumps(doc, indent=1))
    text = render(doc)
    write_text(args.out / f"{args.label}.md", text)
    print(text)
    return doc

