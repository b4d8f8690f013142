"""``benchmarks/cli_results.py custom-model``: a custom model made the way users make theirs, upstream train.py
fine-tuning a COCO model on a few classes (the model the ``custom-*`` result sets quantize).

The data: the images of --train-set (default coco369, COCO train2017) and --eval-set (default coco334, val2017)
that hold at least one of --classes, their labels kept for those classes alone and renumbered 0..n-1. The model:
upstream `train.py` in a patched YOLOv9 tree, from --weights (default ../shared/weights/yolov9-t-coco.pt) with the
class count changed (the head's class outputs start anew, everything else from the COCO weights), trained on the
train images only (`--noval`: no epoch is chosen by any image, the last epoch is the model). Then `qat.py eval
--allow-fp` scores it on the eval images. Writes into --out: `data/` (the two image lists' folders of symlinks and
labels, `custom.yaml` with an absolute path), `custom-<classes>.pt` (the last epoch, upstream's format, without the optimizer),
`custom_model.json` (classes, image counts, the command lines, the FP score, the weights' sha256) and the logs.

    python3 benchmarks/cli_results.py custom-model --tree /path/to/patched/yolov9 --shared ../shared \\
        --out runs/custom --classes person car dog --epochs 60 --device 0

Upstream's train.py on today's stack needs three things the toolkit's commands do without, all set for its process
alone: the toolkit's compatibility shims (np.trapz, pkg_resources), torch.load of the trusted --weights with its full
pickle (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1: the file is checked against its sha256 first), and a font file where
upstream's check_font looks, so that it downloads nothing (matplotlib's DejaVuSans; --noplots draws no figure).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from parts import portable

# sha256 of the shared COCO YOLOv9-t (../shared/README.md): the one file this script lets torch unpickle in full
KNOWN_WEIGHTS = {"yolov9-t-coco.pt": "7dd93c53091f664b4171c9cd933a059cc1c4492ee100680479b17f092ae00197"}
TRAIN = """\
import runpy, sys
from utils.qat.core import compat
compat.apply()
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


class Refused(Exception):
    """A wrong flag or input, in one sentence (exit status 2)."""


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", required=True, help="a YOLOv9 tree patched with this toolkit (./patch_yolov9.sh)")
    p.add_argument("--shared", default=str(portable.shared()),
                   help="the shared folder (datasets/, weights/) (default: YOLOV9_QAT_SHARED, else ../shared)")
    p.add_argument("--weights", default=None, help="the COCO model to start from (default: SHARED/weights/yolov9-t-coco.pt)")
    p.add_argument("--classes", nargs="+", default=["person", "car", "dog"], help="COCO class names kept")
    p.add_argument("--train-set", default="coco369", help="folder of SHARED/datasets trained on")
    p.add_argument("--eval-set", default="coco334", help="folder of SHARED/datasets scored on")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--hyp", default="data/hyps/hyp.scratch-high.yaml", help="upstream hyp yaml (in the tree)")
    p.add_argument("--device", default="0")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder of the data, the weights, custom_model.json and the logs")
    p.add_argument("--python", default=sys.executable)
    return p


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def coco_names(shared: Path) -> dict[int, str]:
    names = yaml.safe_load((shared / "datasets" / "coco334.yaml").read_text())["names"]
    return {int(k): str(v) for k, v in names.items()}


def subset(source: Path, dest: Path, keep: dict[int, int]) -> int:
    """``dest/images`` (symlinks) and ``dest/labels`` for every image of ``source`` with a class of ``keep``
    (COCO id -> new id), its other classes' boxes dropped. Returns the number of images."""
    images, labels = dest / "images", dest / "labels"
    images.mkdir(parents=True)
    labels.mkdir(parents=True)
    n = 0
    for label in sorted((source / "labels").rglob("*.txt")):
        lines = [line.split() for line in label.read_text().splitlines() if line.strip()]
        kept = [" ".join([str(keep[int(float(p[0]))]), *p[1:]]) for p in lines if int(float(p[0])) in keep]
        if not kept:
            continue
        image = next(iter(sorted((source / "images").rglob(label.stem + ".*"))), None)
        if image is None:
            continue
        (images / image.name).symlink_to(image.resolve())
        (labels / label.name).write_text("\n".join(kept) + "\n")
        n += 1
    return n


def make_data(args, out: Path) -> tuple[Path, dict]:
    shared = Path(args.shared)
    coco = coco_names(shared)
    ids = {name: i for i, name in coco.items()}
    unknown = [c for c in args.classes if c not in ids]
    if unknown:
        raise Refused(f"--classes {' '.join(unknown)}: not a COCO class name; see {shared}/datasets/coco334.yaml.")
    keep = {ids[c]: i for i, c in enumerate(args.classes)}
    root = out / "data"
    if root.exists():
        shutil.rmtree(root)
    counts = {split: subset(shared / "datasets" / folder, root / split, keep)
              for split, folder in (("train", args.train_set), ("val", args.eval_set))}
    data = root / "custom.yaml"
    data.write_text(yaml.safe_dump({"path": str(root.resolve()), "train": "train/images", "val": "val/images",
                                    "nc": len(args.classes), "names": dict(enumerate(args.classes))}, sort_keys=False))
    return data, {"classes": args.classes, "coco_ids": list(keep), "images": counts}


def run(name: str, cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> float:
    """``cmd`` in ``cwd``, its output in ``log``; its seconds, or Refused naming ``name`` and the log."""
    start = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        r = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if r.returncode:
        raise Refused(f"{name} exited {r.returncode}; see {log}.")
    return round(time.time() - start, 1)


def main(args) -> dict:
    tree, out = Path(args.tree).resolve(), Path(args.out).resolve()
    if not (tree / "qat.py").is_file() or not (tree / "train.py").is_file():
        raise Refused(f"--tree {tree} is not a patched YOLOv9 tree (needs train.py and qat.py); run ./patch_yolov9.sh on it.")
    weights = Path(args.weights or Path(args.shared) / "weights" / "yolov9-t-coco.pt").resolve()
    if KNOWN_WEIGHTS.get(weights.name) != sha256(weights):
        raise Refused(f"--weights {weights} is not the shared COCO YOLOv9-t (sha256 differs); this script unpickles "
                      "only that file in full.")
    out.mkdir(parents=True, exist_ok=True)
    data, record = make_data(args, out)
    fonts = out / "config"  # upstream's check_font finds Arial.ttf here instead of downloading it
    fonts.mkdir(exist_ok=True)
    import matplotlib
    shutil.copy(Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf", fonts / "Arial.ttf")
    env = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "YOLOV5_CONFIG_DIR": str(fonts), "YOLOv5_AUTOINSTALL": "false",
           "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    name = "custom-" + "-".join(args.classes)
    train = [args.python, "-c", TRAIN, "--weights", str(weights), "--cfg", "", "--data", str(data), "--hyp", args.hyp,
             "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--imgsz", str(args.imgsz),
             "--device", args.device, "--workers", str(args.workers), "--seed", str(args.seed), "--noval",
             "--noplots", "--project", str(out / "train"), "--name", name, "--exist-ok"]
    record["train_seconds"] = run("train.py", train, tree, out / "train.log", env)
    weights_dir = out / "train" / name / "weights"  # upstream writes the last epoch without its optimizer beside it
    last = next(p for p in (weights_dir / "last_striped.pt", weights_dir / "last.pt") if p.is_file())
    model = out / f"{name}.pt"
    shutil.copy(last, model)
    score = [args.python, "qat.py", "eval", "--allow-fp", "--weights", str(model), "--data", str(data),
             "--imgsz", str(args.imgsz), "--device", args.device, "--project", str(out / "eval"), "--name", name,
             "--exist-ok"]
    run("qat.py eval", score, tree, out / "eval.log")
    result = json.loads((out / "eval" / name / "results.json").read_text())
    record.update(weights=str(model), weights_sha256=sha256(model), size_bytes=model.stat().st_size,
                  started_from=weights.name, fp_AP=result.get("AP"), fp_AP50=result.get("AP50"),
                  per_class=result.get("per_class"), commands={"train": ["train.py", *train[3:]], "eval": score[1:]})
    (out / "custom_model.json").write_text(portable.text(json.dumps(record, indent=2), work=out, tree=tree))
    for log in (out / "train.log", out / "eval.log"):  # no path of this machine in what is committed
        log.write_text(portable.text(log.read_text(errors="replace"), work=out, tree=tree))
    print(f"{model}: FP mAP50-95 {record['fp_AP']} on {record['images']['val']} {args.eval_set} images "
          f"({', '.join(args.classes)}); trained on {record['images']['train']} {args.train_set} images in "
          f"{record['train_seconds']} s")
    return record

