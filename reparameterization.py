"""Reparameterize a YOLOv9 training checkpoint (auxiliary branch, DualDDetect) into its GELAN inference model.

    python3 reparameterization.py --weights runs/train/exp/weights/best.pt --model c
    python3 reparameterization.py --cfg models/detect/gelan-c.yaml --weights best.pt --model c \\
        --device cuda:0 --classes_num 80 --save yolov9-c-converted.pt

The output is an upstream checkpoint ({'model': DetectionModel in FP16, ...}, names and nc set),
loadable by val.py, detect.py and qat.py. The layer correspondence is derived from the two model
graphs (utils/qat/model/reparam.py); the converted model is checked against the checkpoint's main branch
before anything is written. --classes_num is accepted for the reference's command line and ignored: the
converted model keeps the checkpoint's classes (a different number is reported).
"""
from utils.qat.core import compat

compat.apply()

import argparse  # noqa: E402

from utils.qat.core.errors import run_cli  # noqa: E402
from utils.qat.model.reparam import SIZES  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Convert a YOLOv9 training checkpoint (yolov9-*.yaml, auxiliary branch) "
                                            "into its GELAN inference model.")
    p.add_argument("--cfg", default=None,
                   help="inference yaml to convert into (default: models/detect/gelan-{model}.yaml, "
                        "models/segment/gelan-{model}-dseg.yaml for segmentation checkpoints)")
    p.add_argument("--model", required=True, choices=SIZES, help="model size of the checkpoint")
    p.add_argument("--weights", required=True, help="training checkpoint (train_dual.py best.pt / last.pt)")
    add_trust_flag(p)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:0 or 0")
    p.add_argument("--classes_num", type=int, default=None,
                   help="ignored: the converted model keeps the checkpoint's classes (accepted for the reference's "
                        "command line; a different number is reported)")
    p.add_argument("--save", default=None, help="output checkpoint (default: ./yolov9-{model}-converted.pt)")
    return p


def main(args: argparse.Namespace) -> None:
    from utils.qat.model.reparam import reparameterize
    from utils.qat.core.validate import check_args
    check_args(args)
    reparameterize(weights=args.weights, model=args.model, save=args.save, cfg=args.cfg,
                   classes_num=args.classes_num, device=args.device, trust=args.trust_weights)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
