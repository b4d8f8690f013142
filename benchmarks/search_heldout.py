"""Does the amax search's choice hold on images it was not chosen on? The search (``--head-amax search``,
``--search-layers``) picks each scale by the head distillation loss on the first ``--head-batches`` calibration
batches. This calibrates the model once per setting, as ``qat.py quantize`` does, and scores each PTQ model three
ways: that loss on the search's own batches, the same loss on the calibration batches after them (held out from the
search; calibration's statistics saw them), and mAP50-95 on the val split. Settings: every scale as calibrated, the
head's searched (the default), and the head's and those of ``--search-layers`` searched.

Run from the top of a patched YOLOv9 tree:

    python3 /path/to/yolov9-qat/benchmarks/search_heldout.py --weights gelan-c.pt --data coco-qat.yaml \\
        --search-layers 0-5 --out runs/search-heldout/gelan-c

Writes results.json and results.md into ``--out``. If the held-out loss ranks the settings as mAP50-95 does where
the search's own loss does not, a guard on it could decide per model whether a search is kept.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.core.device import select_device  # noqa: E402
from utils.qat.core.errors import run_cli  # noqa: E402
from utils.qat.evaluation.data import dataloader, images_only, load_data_yaml  # noqa: E402
from utils.qat.model import checkpoint  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402
from utils.qat.quantize.config import DEFAULT_HEAD_BATCHES, QuantConfig, parse_layers  # noqa: E402
from utils.qat.run.pipeline import Evaluation, ptq  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True)
    add_trust_flag(p)
    p.add_argument("--data", required=True)
    p.add_argument("--search-layers", default="0-5", help="the body layers of the third setting (qat.py's flag)")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--head-batches", type=int, default=DEFAULT_HEAD_BATCHES)
    p.add_argument("--out", required=True)
    return p


@torch.no_grad()
def head_loss(qmodel: torch.nn.Module, batches: list[torch.Tensor]) -> float:
    """The search's objective over ``batches``: the ``head`` distillation loss of the quantized model against
    itself with every quantizer off (the fused FP model), on the head's raw maps; the mean over the batches."""
    from utils.qat.quantize.objectives import head_distillation
    from utils.qat.quantize.state import enabled_quantizers, quantizers_off
    detect = qmodel.model[-1]
    training = qmodel.training
    qmodel.eval()
    detect.train()  # the raw maps, as the search reads them
    quantizers = enabled_quantizers(qmodel)
    losses = []
    try:
        for images in batches:
            with quantizers_off(quantizers):
                target = qmodel(images)
            losses.append(float(sum(head_distillation(qmodel(images), target, detect.reg_max, detect.nc).values())))
    finally:
        qmodel.train(training)
        qmodel.eval()
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> None:
    args = get_args_parser().parse_args(argv)
    device = select_device(args.device)
    data = load_data_yaml(args.data, ("train", "val"))
    fp = checkpoint.load_fp(args.weights, trust=args.trust_weights)
    score = Evaluation(data, imgsz=args.imgsz, batch_size=args.batch_size, device=device, workers=args.workers)
    origin, _ = score(fp, "Origin")  # as qat.py quantize: the FP model evaluated first
    loader, _ = dataloader(data, "train", args.imgsz, args.batch_size, int(fp.stride.max()), workers=args.workers,
                           rect=False, prefix="calibration images: ")
    batches = []
    for images in images_only(loader, device):
        batches.append(images)
        if len(batches) >= args.calib_batches:
            break
    own, held = batches[:args.head_batches], batches[args.head_batches:]
    layers = parse_layers(args.search_layers)
    hb = args.head_batches
    settings = {"calibrated": QuantConfig(head_amax="calibrated", head_batches=hb),
                "head searched (default)": QuantConfig(head_batches=hb),
                f"head and layers {args.search_layers} searched": QuantConfig(head_batches=hb, search_layers=layers)}
    rows = []
    for name, config in settings.items():
        start = time.time()
        qmodel, info = ptq(fp, data, config, imgsz=args.imgsz, batch_size=args.batch_size, device=device,
                           calib_batches=args.calib_batches, workers=args.workers)
        calibrated = time.time() - start
        metrics, _ = score(qmodel, name)
        rows.append({"setting": name, "AP": metrics.mAP50_95,
                     "AP_halves": {h: m.mAP50_95 for h, m in metrics.halves.items()},
                     "loss_search_batches": head_loss(qmodel, own), "loss_held_out": head_loss(qmodel, held),
                     "search": info.head_search, "calibration_s": calibrated})
        print(f"{name}: AP {metrics.mAP50_95:.4f}, head loss {rows[-1]['loss_search_batches']:.4g} on the search's "
              f"{len(own)} batches, {rows[-1]['loss_held_out']:.4g} on {len(held)} others", flush=True)
        del qmodel
    out = Path(args.out)
    result = {"weights": str(args.weights), "FP": origin.mAP50_95, "search_batches": len(own),
              "held_out_batches": len(held), "settings": rows, "args": vars(args)}
    write_text(out / "results.json", json.dumps(result, indent=1, default=str))
    lines = [f"# The amax search on held-out calibration batches: {Path(args.weights).name}", "",
             f"FP {origin.mAP50_95:.4f}; the search scores on {len(own)} calibration batches, held out: the next "
             f"{len(held)}.", "",
             "| setting | PTQ AP | vs FP | head loss, search's batches | head loss, held out |", "|---|---|---|---|---|"]
    lines += [f"| {r['setting']} | {r['AP']:.4f} | {r['AP'] - origin.mAP50_95:+.4f} | {r['loss_search_batches']:.4g} "
              f"| {r['loss_held_out']:.4g} |" for r in rows]
    write_text(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    run_cli(main)
