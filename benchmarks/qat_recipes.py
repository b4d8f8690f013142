"""QAT recipes side by side: one calibration, then each recipe fine-tunes its own copy of the PTQ model
and is evaluated after every epoch. This is how the default fine-tuning recipe was chosen; the table it
prints (and results.md) keeps the attempts that did not help beside the ones that did.

Run from the top of a patched YOLOv9 tree:

    python3 /path/to/yolov9-qat/benchmarks/qat_recipes.py --weights gelan-c.pt --data data/coco.yaml \\
        --out runs/recipes/gelan-c --recipes 'mse:lr=1e-5,optimizer=adam,warmup=0' 'head' 'head:lr=3e-5'

A recipe is ``OBJECTIVE[:key=value,...]`` with keys of ``QATConfig`` (lr, optimizer, weight_decay, warmup,
final_lr_ratio, supervision_stride, ema, amax_lr, bias_lr, box_gain, mask_gain; epochs and iters come from --epochs /
--iters unless given).

Segmentation models (``--task segment``) are ranked by mask mAP50-95, as ``segment/qat_seg.py`` ranks them;
each epoch keeps the box mAP50-95 beside it.

Besides mAP, each epoch reports the ``head`` distillation loss measured on the evaluation images
("held-out loss"): whether what fine-tuning learns on the training images carries over to the images
the model is scored on.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

from utils.qat.quantize.objectives import head_distillation, head_of  # noqa: E402
from utils.qat.quantize.model_quant import fused_copy  # noqa: E402
from utils.qat.quantize.config import CALIB_METHODS, DEFAULT_CALIB_METHODS, DEFAULT_HEAD_AMAX, HEAD_AMAX, QuantConfig  # noqa: E402
from utils.qat.quantize.finetune import QATConfig  # noqa: E402
from utils.qat.model import checkpoint  # noqa: E402
from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.evaluation.backends import TorchBackend  # noqa: E402
from utils.qat.evaluation.data import dataloader, hyp_argument, images_only, load_data_yaml  # noqa: E402
from utils.qat.core.device import select_device  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.evaluation.evaluate import evaluate  # noqa: E402
from utils.qat.run.pipeline import finetune_stage, ptq  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402


def parse_recipe(text: str, epochs: int, iters: int) -> QATConfig:
    objective, _, rest = text.partition(":")
    fields = {f.name: f.type for f in dataclasses.fields(QATConfig)}
    values: dict = {"objective": objective, "epochs": epochs, "iters": iters}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise QATError(f"recipe '{text}': unknown setting '{key}'; use one of {', '.join(fields)}.")
        values[key] = value if key in ("objective", "optimizer") else (int(value) if fields[key] == "int" else float(value))
    return QATConfig(**values)


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True)
    add_trust_flag(p)
    p.add_argument("--data", required=True)
    p.add_argument("--task", choices=("detect", "segment"), default="detect", help="segment: rank by mask mAP")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--calib-method", choices=CALIB_METHODS, default=None,
                   help="default: qat.py's for the task (detect: mse, segment: mse-image)")
    p.add_argument("--head-amax", choices=HEAD_AMAX, default=DEFAULT_HEAD_AMAX, help="the head's input scales (qat.py's flag)")
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--hyp", default=None,
                   help="augmentation during fine-tuning: an upstream hyp yaml or 'none' (default: qat.py's for the task)")
    p.add_argument("--recipes", nargs="+", required=True)
    p.add_argument("--seed", type=int, default=57)
    p.add_argument("--out", required=True)
    return p


HELDOUT = "heldout_loss"


@torch.no_grad()
def heldout_loss(student, teacher, loader, device) -> float:
    """The ``head`` objective (class + box terms) of ``student`` against ``teacher`` on ``loader``'s images."""
    head = head_of(student)
    total, batches = 0.0, 0
    student.train(), teacher.train()  # training form: the raw head maps the objective reads
    try:
        for images in images_only(loader, device):
            with torch.autocast(device.type, dtype=torch.float16, enabled=device.type == "cuda"):
                parts = head_distillation(student(images), teacher(images), head.reg_max, head.nc)
            total += float(parts["cls"] + parts["box"])
            batches += 1
    finally:
        student.eval(), teacher.eval()
    return total / max(batches, 1)


def render(results: dict) -> str:
    origin, ptq = results.get("origin"), results.get("ptq")
    metric = "mask mAP50-95" if results.get("task") == "segment" else "mAP50-95"
    lines = [f"# QAT recipes: {results['weights']} (AP: {metric})", "",
             f"Origin {origin:.4f}, PTQ ({results['calib_method']}, {results.get('calib_batches', 25)} batches, head amax "
             f"{results.get('head_amax', 'calibrated')}) "
             f"{ptq:.4f} (held-out loss "
             f"{results.get(HELDOUT, float('nan')):.4g}); augmentation during fine-tuning: "
             f"{results.get('hyp') or 'none'}; {results['machine']}", "",
             "| recipe | best AP | vs PTQ | vs Origin | best epoch | AP per epoch | loss first -> last | "
             "held-out loss per epoch | s / epoch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results["recipes"]:
        aps = [e["AP"] for e in r["epochs"]]
        best = max(aps) if aps else float("nan")
        boxes = [e["box_AP"] for e in r["epochs"] if "box_AP" in e] if results.get("task") == "segment" else []
        lines.append(f"| `{r['recipe']}` | {best:.4f} | {best - ptq:+.4f} | {best - origin:+.4f} | "
                     f"{aps.index(best) + 1 if aps else '-'} | {' '.join(f'{a:.4f}' for a in aps)}"
                     f"{' (box ' + ' '.join(f'{a:.4f}' for a in boxes) + ')' if boxes else ''} | "
                     f"{r['epochs'][0]['loss']:.4g} -> {r['epochs'][-1]['loss']:.4g} | "
                     f"{' '.join(f'{e[HELDOUT]:.4g}' for e in r['epochs'] if HELDOUT in e) or '-'} | "
                     f"{sum(e['seconds'] for e in r['epochs']) / max(len(aps), 1):.1f} |")
    return "\n".join(lines) + "\n"


def main(args) -> dict:
    calib_method = args.calib_method or DEFAULT_CALIB_METHODS[args.task]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipes = [(text, parse_recipe(text, args.epochs, args.iters)) for text in args.recipes]
    device = select_device(args.device)
    data = load_data_yaml(args.data, splits=("train", "val"))
    args.hyp, hyp = hyp_argument(args.hyp, args.task)
    fp = checkpoint.load_fp(args.weights, task=args.task, trust=args.trust_weights)
    stride = int(fp.stride.max())
    common = dict(imgsz=args.imgsz, batch_size=args.batch_size, workers=args.workers)
    scored = dict(common, task=args.task)
    backend = lambda model: TorchBackend(model, device, task=args.task)  # noqa: E731
    results: dict = {"weights": Path(args.weights).name, "task": args.task, "calib_method": calib_method, "calib_batches": args.calib_batches, "head_amax": args.head_amax, "hyp": args.hyp, "recipes": [],
                     "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    save = lambda: (write_text(out / "results.json", json.dumps(results, indent=2)),  # noqa: E731
                    write_text(out / "results.md", render(results)))
    results["origin"] = evaluate(backend(fused_copy(fp, device)), data, desc="Origin", **scored).mAP50_95
    qmodel, info = ptq(fp, data, QuantConfig(method=calib_method, head_amax=args.head_amax), calib_batches=args.calib_batches, device=device,
                       **common)
    results["ptq"] = evaluate(backend(qmodel), data, desc="PTQ", **scored).mAP50_95
    teacher = fused_copy(fp, device)
    val, _ = dataloader(data, "val", args.imgsz, args.batch_size, stride, workers=args.workers, prefix="held-out: ")
    results[HELDOUT] = heldout_loss(qmodel, teacher, val, device)
    save()
    for text, config in recipes:
        torch.manual_seed(args.seed)
        student = copy.deepcopy(qmodel)
        record: dict = {"recipe": text, "config": dataclasses.asdict(config), "epochs": []}
        results["recipes"].append(record)

        def epoch_end(result, student=student, record=record):
            m = evaluate(backend(student), data, desc=f"{text} epoch {result.epoch + 1}", **scored)
            record["epochs"].append({"epoch": result.epoch + 1, "AP": round(m.mAP50_95, 4), "AP50": round(m.mAP50, 4),
                                     "box_AP": round(m.box.mAP50_95, 4),
                                     "loss": result.loss, "terms": result.terms, "seconds": round(result.seconds, 1),
                                     HELDOUT: heldout_loss(student, teacher, val, device), "amax": result.amax})
            save()

        start = time.time()
        finetune_stage(student, fp, info, data, config, device=device, hyp=hyp, seed=args.seed, on_epoch_end=epoch_end,
                       **scored)
        record["seconds"] = round(time.time() - start, 1)
        save()
        del student
        torch.cuda.empty_cache() if device.type == "cuda" else None
    print(render(results))
    return results


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
