"""Which quantizers of one layer cost the accuracy: calibrate once, then evaluate the PTQ model with one
group of that layer's quantizers switched off (floating point) at a time. ``qat.py sensitive`` answers
"which layer"; this answers "which part of it" (e.g. the detect head: box or class branch, which conv,
input or weight). Writes results.json and results.md into --out.

Run from the top of a patched YOLOv9 tree:

    python3 /path/to/yolov9-qat/benchmarks/quantizer_sensitivity.py --weights gelan-c.pt --data data/coco.yaml \\
        --layer -1 --out runs/quantizer-sensitivity/gelan-c

Quantizers are grouped across the head's levels by default (``cv2.0.1`` and ``cv2.2.1`` are one group,
``cv2.*.1``); ``--per-level`` evaluates each one on its own.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from utils.qat.core import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

from utils.qat.model import checkpoint  # noqa: E402
from utils.qat.core.atomic import write_text  # noqa: E402
from utils.qat.evaluation.data import load_data_yaml  # noqa: E402
from utils.qat.core.device import select_device  # noqa: E402
from utils.qat.run.pipeline import Evaluation, ptq  # noqa: E402
from utils.qat.core.errors import run_cli  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402
from utils.qat.quantize.config import DEFAULT_CALIB_METHOD, HEAD_AMAX, QuantConfig  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--weights", required=True)
    add_trust_flag(p)
    p.add_argument("--data", required=True)
    p.add_argument("--layer", type=int, default=-1, help="index of model.model to dissect (default: the head)")
    p.add_argument("--per-level", action="store_true", help="one group per quantizer, not per branch position")
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default="")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--calib-method", default=DEFAULT_CALIB_METHOD)
    p.add_argument("--calib-batches", type=int, default=25)
    p.add_argument("--head-amax", choices=HEAD_AMAX, default="calibrated",
                   help="the head's input scales (qat.py's flag); calibrated by default: the question is where "
                        "calibration's INT8 loss sits (benchmarks/results/quantizer-sensitivity-gelan-c-h100.md)")
    p.add_argument("--out", required=True)
    return p


def quantizer_groups(layer: torch.nn.Module, prefix: str, per_level: bool) -> dict[str, list]:
    """The layer's enabled quantizers by group name: ``all inputs``, ``all weights``, then one group per
    (branch position, input/weight) with the level index folded to ``*`` unless ``per_level``."""
    from utils.qat.quantize.state import enabled_quantizers
    enabled = {id(q) for q in enabled_quantizers(layer)}
    named = {f"{prefix}.{n}" if n else prefix: q for n, q in layer.named_modules() if id(q) in enabled}
    groups: dict[str, list] = {
        "all inputs": [q for n, q in named.items() if not n.endswith("weight_quantizer")],
        "all weights": [q for n, q in named.items() if n.endswith("weight_quantizer")],
    }
    for name, q in named.items():
        key = name if per_level else re.sub(r"\.(cv\d+)\.\d+\.", r".\1.*.", name)
        groups.setdefault(key.replace(".conv.", ".").removesuffix("_quantizer"), []).append(q)
    return {k: v for k, v in groups.items() if v}


def render(results: dict) -> str:
    lines = [f"# Quantizer sensitivity: {results['weights']}, layer {results['layer']} ({results['module']})", "",
             f"Origin {results['origin']:.4f}, all INT8 (PTQ {results['calib_method']}) {results['ptq']:.4f}; "
             f"{results['machine']}", "",
             "| in floating point | quantizers | mAP50-95 | mAP50 | gain over PTQ | share of the INT8 loss |",
             "|---|---|---|---|---|---|"]
    loss = results["origin"] - results["ptq"]
    for r in sorted(results["groups"], key=lambda r: -r["AP"]):
        share = f"{(r['AP'] - results['ptq']) / loss:.0%}" if loss > 0 else "-"
        lines.append(f"| `{r['group']}` | {r['quantizers']} | {r['AP']:.4f} | {r['AP50']:.4f} | "
                     f"{r['AP'] - results['ptq']:+.4f} | {share} |")
    return "\n".join(lines) + "\n"


def main(args) -> dict:
    from utils.qat.quantize.model_quant import fused_copy
    from utils.qat.quantize.state import quantizers_off
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = select_device(args.device)
    data = load_data_yaml(args.data, splits=("train", "val"))
    fp = checkpoint.load_fp(args.weights, trust=args.trust_weights)
    score = Evaluation(data, imgsz=args.imgsz, batch_size=args.batch_size, device=device, workers=args.workers)
    index = args.layer % len(fp.model)
    results: dict = {"weights": Path(args.weights).name, "layer": index, "module": type(fp.model[index]).__name__,
                     "calib_method": args.calib_method, "head_amax": args.head_amax, "groups": [],
                     "machine": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"}
    results["origin"] = score(fused_copy(fp, device), "Origin")[0].mAP50_95
    qmodel, _ = ptq(fp, data, QuantConfig(method=args.calib_method, head_amax=args.head_amax), imgsz=args.imgsz, batch_size=args.batch_size,
                    device=device, calib_batches=args.calib_batches, workers=args.workers)
    results["ptq"] = score(qmodel, "PTQ")[0].mAP50_95
    for name, qs in quantizer_groups(qmodel.model[index], f"model.{index}", args.per_level).items():
        with quantizers_off(qs):
            m, _ = score(qmodel, f"{name} FP")
        results["groups"].append({"group": name, "quantizers": len(qs), "AP": round(m.mAP50_95, 4),
                                  "AP50": round(m.mAP50, 4)})
        write_text(out / "results.json", json.dumps(results, indent=2))
        write_text(out / "results.md", render(results))
    print(render(results))
    return results


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
