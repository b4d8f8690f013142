"""Quantization-aware training for YOLOv9 (INT8, TensorRT-ready).

    python3 qat.py quantize  --weights yolov9-c-converted.pt --data data/coco.yaml
    python3 qat.py sensitive --weights yolov9-c-converted.pt --data data/coco.yaml --num-image 1000
    python3 qat.py eval      --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --data data/coco.yaml
"""
from __future__ import annotations

from utils.qat.core import compat

compat.apply()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402


from utils.qat.core import distributed, provenance, timing, validate  # noqa: E402
from utils.qat.model import checkpoint  # noqa: E402
from utils.qat.run import reports  # noqa: E402
from utils.qat.evaluation.data import (DEFAULT_HYPS, NO_HYP, data_argument, holdout_images, hyp_argument,  # noqa: E402
                                       load_data_yaml, load_hyp)
from utils.qat.core.device import keep_freed_memory, select_device  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402

if TYPE_CHECKING:
    from utils.qat.quantize.config import QuantConfig
    from utils.qat.quantize.finetune import QATConfig
    from utils.qat.run.pipeline import Evaluation


def _common(p: argparse.ArgumentParser, project: str) -> None:
    p.add_argument("--weights", required=True, help="model checkpoint (.pt)")
    add_trust_flag(p)
    p.add_argument("--data", default=None, help="dataset yaml (default: data/coco.yaml of the YOLOv9 tree, as upstream)")
    p.add_argument("--device", default="", help="cpu, 0 or cuda:0 (default: first GPU, else CPU)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--imgsz", "--img", "--img-size", dest="imgsz", type=int, default=640, help="inference size (pixels)")
    p.add_argument("--workers", type=int, default=8, help="dataloader workers")
    p.add_argument("--project", default=project)
    p.add_argument("--name", default="exp")
    p.add_argument("--exist-ok", action="store_true",
                   help="reuse project/name instead of incrementing it (quantize: a previous run of the same weights "
                        "there is replaced, its report and checkpoints removed first)")


def _calibration(p: argparse.ArgumentParser, task: str) -> None:
    from utils.qat.quantize.config import (CALIB_METHODS, DEFAULT_CALIB_METHODS, DEFAULT_HEAD_AMAX, DEFAULT_HEAD_BATCHES,
                                           DEFAULT_PERCENTILE, DEFAULT_POOL_SCALE, DEFAULT_TIE, HEAD_AMAX,
                                           POOL_SCALES, SEARCH_COSTS, TIES)
    p.add_argument("--calib-method", choices=CALIB_METHODS, default=DEFAULT_CALIB_METHODS[task],
                   help="activation calibration (weights are always per-channel max; default: %(default)s). mse-image "
                        "runs the MSE search with every image weighted alike, so a few images with far larger "
                        "activations cannot stretch the scales (the segmentation default; docs/QAT_CALIBRATION.md "
                        "'`mse-image` on the GPU, and the calibration default per task')")
    p.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE, help="for --calib-method percentile")
    p.add_argument("--calib-batches", type=int, default=25,
                   help="calibration batches: the first N of the training split, unaugmented (a few images with far "
                        "larger activations than the rest can cost more than they teach: docs/QAT_FINETUNING.md "
                        "'GELAN-C run to run, and what limits GELAN-QS-seg')")
    p.add_argument("--calib-sample", default="auto", metavar="N",
                   help="values of each calibration image's activation that its histogram counts, evenly spread, "
                        "over the range of all of them: a number, all, or auto (the default: all on a GPU, 16384 on "
                        "a CPU, where histograms of every value were most of the calibration's time; "
                        "docs/QAT_CALIBRATION.md 'Calibrating on a CPU')")
    p.add_argument("--head-amax", choices=HEAD_AMAX, default=DEFAULT_HEAD_AMAX,
                   help="the detect head's input scales: as calibrated, or searched after calibration for the "
                        "lowest error of the head's outputs against the FP head (a few seconds on a GPU)")
    p.add_argument("--head-batches", type=int, default=DEFAULT_HEAD_BATCHES,
                   help="--head-amax search: the calibration batches each candidate scale is scored on "
                        "(default: %(default)s)")
    p.add_argument("--search-layers", default="auto", metavar="LAYERS",
                   help="body layers (indices, ranges: 2-5; none) whose activation scales are searched after "
                        "calibration like the head's, each candidate scored through the whole network on "
                        "--head-batches batches (a whole forward pass per candidate: 14-23 s for layers 0-5 on an "
                        "H100 or H200, about 30 s for layers 0-2 of YOLOv9-t on 2 CPU cores with --search-cost "
                        "bounded). auto (the default): 0-5 for detection on a GPU, none on a CPU (no gain measured "
                        "there) and for segmentation; the log says which (docs/QAT_RECIPE.md 'The search as the "
                        "default on a GPU', docs/QAT_CALIBRATION.md 'Calibrating on a CPU')")
    p.add_argument("--search-cost", choices=("auto", *SEARCH_COSTS), default="auto",
                   help="forward passes the scale searches may take: full (every candidate factor of every scale, "
                        "each on every --head-batches batch), bounded (each scale walked from its calibrated value "
                        "while the error falls, and a body layer's candidates scored on one batch), or auto (the "
                        "default: full on a GPU, bounded on a CPU)")
    p.add_argument("--tie", choices=TIES, default=DEFAULT_TIE,
                   help="the one scale of tensors TensorRT needs on one scale (a Concat's inputs, MaxPool): max = "
                        "the largest of their calibrated amax, mse = the least squared error over all of them "
                        "(histogram methods; default: %(default)s)")
    p.add_argument("--pool-scale", choices=POOL_SCALES, default=DEFAULT_POOL_SCALE,
                   help="an average pool's output (AConv, ADown): own = calibrated on its own (the default), so that "
                        "averages of INT8 values never land on rounding ties, which each runtime breaks its own way "
                        "(a checkpoint then scores what its graph scores); shared = on its input's scale, as "
                        "checkpoints before 2026-12-06 were made (docs/RESULTS.md 'One model, one score'; default: "
                        "%(default)s)")
    p.add_argument("--seed", type=int, default=57,
                   help="seeds the fine-tuning: the order of the training images and the random streams of their "
                        "augmentation (runs with the same seed and --workers repeat; docs/QAT_FINETUNING.md 'GELAN-C "
                        "run to run, and what limits GELAN-QS-seg')")


def _finetuning(p: argparse.ArgumentParser) -> None:
    from utils.qat.quantize.objectives import OBJECTIVES
    from utils.qat.quantize.config import SEARCHED_LR
    from utils.qat.quantize.finetune import EMA_RAMPS, OPTIMIZERS, QATConfig
    d = QATConfig()
    p.add_argument("--epochs", type=int, default=d.epochs, help="QAT epochs (default: %(default)s)")
    p.add_argument("--iters", type=int, default=d.iters,
                   help="QAT optimisation steps per epoch (a smaller training set is read again)")
    p.add_argument("--qat-loss", choices=OBJECTIVES, default=d.objective,
                   help="what fine-tuning minimises: head = distillation on the head's raw box/class outputs, "
                        "features = normalised block outputs, task = upstream's loss from the labels, "
                        "mse = this project's first recipe; combine with + (default: %(default)s)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak QAT learning rate (default: {SEARCHED_LR:g} where body layers are searched, else {d.lr:g})")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="default: %(default)s")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="on conv weights (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="linear warm-up steps before the cosine decay (default: %(default)s)")
    p.add_argument("--ema", type=float, default=d.ema,
                   help="decay of the moving average of the weights that is evaluated and saved; 0 = off "
                        "(default: %(default)s)")
    p.add_argument("--ema-ramp", choices=list(EMA_RAMPS), default=d.ema_ramp,
                   help="how the average starts: fast = decay (1+n)/(10+n) after n steps (under 0.99 for the first "
                        "890 steps), uniform = the mean of every step so far until it spans 1/(1-ema) steps "
                        "(default: %(default)s)")
    p.add_argument("--supervision-stride", type=int, default=d.supervision_stride,
                   help="--qat-loss features/mse: distil every N-th block output")
    p.add_argument("--amax-lr", type=float, default=d.amax_lr,
                   help="learn the activation amax (LSQ) at this learning rate relative to each calibrated amax; "
                        "0 keeps calibration's (default: %(default)s)")
    p.add_argument("--bias-lr", type=float, default=d.bias_lr,
                   help="the biases' learning rate as a multiple of --lr (default: %(default)s)")
    p.add_argument("--box-gain", type=float, default=d.box_gain,
                   help="--qat-loss head: weight of the box-distribution term against the class term "
                        "(default: %(default)s)")
    p.add_argument("--mask-gain", type=float, default=d.mask_gain,
                   help="--qat-loss head, segmentation: weight of the mask coefficient and prototype term "
                        "(default: %(default)s)")
    p.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                   help="run every QAT step eagerly; by default, on one GPU, each step's forward and backward "
                        "replay a CUDA graph recorded at the first step (same results, a fraction of the CPU time)")


def _budget(p: argparse.ArgumentParser) -> None:
    from utils.qat.run.budget import DEFAULT_CONFIDENCE, DEFAULT_HOLDOUT, DEFAULT_MIN_INT8
    p.add_argument("--max-drop", type=float, default=None, metavar="D",
                   help="an accuracy budget: mAP50-95 at most D below the FP model on training images held out from "
                        "calibration and fine-tuning; the run escalates only as far as it needs (calibration, other "
                        "calibrations and the layer search, layers kept in FP, fine-tuning) and writes the result as "
                        "qat_best (docs/BUDGET.md). Left out: the plain recipe")
    p.add_argument("--holdout-fraction", type=float, default=DEFAULT_HOLDOUT,
                   help="--max-drop: the share of the training images held out to decide on (default: %(default)s; "
                        "never evaluation images)")
    p.add_argument("--min-int8", type=float, default=DEFAULT_MIN_INT8,
                   help="--max-drop: the share of convolutions that must stay INT8 when layers are kept in FP "
                        "(default: %(default)s; 1 keeps every layer INT8)")
    p.add_argument("--confidence", type=float, default=DEFAULT_CONFIDENCE,
                   help="--max-drop: how sure the held-out images must make each decision, as a share of bootstrap "
                        "draws over them (default: %(default)s; 0.5 decides on the held-out figures alone)")
    p.add_argument("--strict", action="store_true",
                   help="--max-drop: a budget not met ends the command with an error (the closest model is written "
                        "all the same)")


def qat_config(args) -> QATConfig:
    """The fine-tuning settings of a ``quantize`` command line."""
    from utils.qat.quantize.finetune import QATConfig
    lr = QATConfig().lr if args.lr is None else args.lr  # None: resolve_auto did not run (a caller of its own)
    return QATConfig(epochs=args.epochs, iters=args.iters, lr=lr, objective=args.qat_loss,
                     optimizer=args.optimizer, weight_decay=args.weight_decay, warmup=args.warmup,
                     ema=args.ema, ema_ramp=args.ema_ramp, supervision_stride=args.supervision_stride, amax_lr=args.amax_lr,
                     bias_lr=args.bias_lr, box_gain=args.box_gain, mask_gain=args.mask_gain,
                     cuda_graph=args.cuda_graph)


SCRIPTS = {"detect": "qat.py", "segment": "segment/qat_seg.py"}


def get_args_parser(task: str = "detect", prog: str = "qat.py", description: str | None = None) -> argparse.ArgumentParser:
    """The CLI of qat.py (``task="detect"``) and of segment/qat_seg.py (``task="segment"``): same flags."""
    parser = argparse.ArgumentParser(prog=prog, description=description or __doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(task=task)
    sub = parser.add_subparsers(dest="cmd", required=True)
    runs = "runs/qat_seg" if task == "segment" else "runs/qat"

    q = sub.add_parser("quantize", help="PTQ calibration, then QAT fine-tuning; evaluates and saves each stage")
    _common(q, runs)
    _calibration(q, task)
    q.add_argument("--hyp", default=DEFAULT_HYPS[task] or NO_HYP,
                   help="upstream hyperparameter yaml for the augmentation of the fine-tuning images (a path, or a "
                        f"name in the tree's data/hyps/); '{NO_HYP}' fine-tunes on the images as they are "
                        "(default: %(default)s, as measured for this task in docs/QAT.md)")
    _finetuning(q)
    q.add_argument("--skip-layers", default="", help="keep in FP: layer indices and/or module patterns, comma separated")
    _budget(q)
    q.add_argument("--no-eval-origin", action="store_true", help="do not evaluate the FP model")
    q.add_argument("--no-eval-ptq", action="store_true", help="do not evaluate the calibrated (PTQ) model")
    q.add_argument("--ptq-only", action="store_true", help="stop after calibration (no fine-tuning)")
    q.add_argument("--conf-thres", type=float, default=0.001)
    q.add_argument("--iou-thres", type=float, default=0.7)

    s = sub.add_parser("sensitive", help="per-layer sensitivity: AP with each layer kept in FP")
    _common(s, f"{runs}_sensitive")
    _calibration(s, task)
    s.add_argument("--hyp", default=None, help="accepted for quantize's command lines; not used (sensitive only calibrates)")
    s.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images")
    s.add_argument("--top", type=int, default=10, help="layers shown in the table and the suggested skip list")
    s.set_defaults(conf_thres=0.001, iou_thres=0.7)  # scored at quantize's evaluation thresholds (no flags)

    e = sub.add_parser("eval", help="evaluate a quantized checkpoint (or an FP one with --allow-fp)")
    _common(e, f"{runs}_eval")
    e.add_argument("--conf-thres", type=float, default=0.001)
    e.add_argument("--iou-thres", type=float, default=0.7)
    e.add_argument("--allow-fp", action="store_true", help="also accept floating-point checkpoints")
    e.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images")
    e.add_argument("--save-json", action="store_true", help="also save COCO-style predictions JSON")
    return parser


def resolve_auto(args, device) -> None:
    """``--search-layers auto`` and the ``--lr`` that goes with it, ``--calib-sample auto`` and ``--search-cost auto``,
    resolved for this task and device in ``args`` (so the run's report records what ran); the main process prints
    what auto chose."""
    from utils.qat.quantize.config import parse_layers, resolve_cost, resolve_lr, resolve_sample, resolve_search
    from utils.qat.quantize.finetune import QATConfig
    args.search_layers, said = resolve_search(args.search_layers, args.task, device.type)
    args.calib_sample, sampled = resolve_sample(str(args.calib_sample), device.type)
    args.search_cost, costed = resolve_cost(args.search_cost, device.type)
    for sentence in (said, sampled, costed):
        if sentence and distributed.is_main():
            print(sentence, flush=True)
    if hasattr(args, "lr"):
        args.lr = resolve_lr(args.lr, parse_layers(args.search_layers), QATConfig().lr)


def quant_config(args) -> QuantConfig:
    """The calibration settings of a ``quantize`` or ``sensitive`` command line."""
    from utils.qat.quantize.config import QuantConfig, parse_layers
    return QuantConfig(method=args.calib_method, percentile=args.percentile,
                       skip=tuple(getattr(args, "skip_layers", "").split(",")), head_amax=args.head_amax,
                       tie=args.tie, head_batches=args.head_batches, pool_scale=args.pool_scale,
                       search_layers=parse_layers(getattr(args, "search_layers", "")), sample=args.calib_sample,
                       search_cost=args.search_cost)


def _score(args, data: dict, device) -> Evaluation:
    from utils.qat.run.pipeline import Evaluation
    return Evaluation(data, imgsz=args.imgsz, batch_size=args.batch_size, device=device, task=args.task,
                      conf_thres=args.conf_thres, iou_thres=args.iou_thres, workers=args.workers)


def _data(args, splits: tuple[str, ...]) -> dict:
    """The dataset yaml, checked; segmentation also needs polygon labels in the splits it evaluates on."""
    args.data = data_argument(args.data)
    data = load_data_yaml(args.data, splits=splits)
    if args.task == "segment":
        from utils.qat.evaluation.data import check_polygons
        check_polygons(data, ("val",))
    return data


def cmd_quantize(args) -> Path | None:
    """Single process, or one process per GPU under torch.distributed.run (``--batch-size`` is then the
    global batch, split evenly over the processes). Returns the run folder (None on ranks other than 0)."""
    launch = distributed.launch_from_env()
    device = select_device(args.device, launch, multi_gpu=f"{SCRIPTS[args.task]} quantize")
    world = launch.world_size if launch else 1
    if args.batch_size % world:
        raise QATError(f"--batch-size {args.batch_size} is the global batch and must split evenly over the {world} "
                       f"processes; pass a multiple of {world}, e.g. --batch-size {max(world, args.batch_size // world * world)}.")
    with distributed.process_group(launch, device):
        return _quantize(args, device, launch)


def _quantize(args, device, launch) -> Path | None:
    """PTQ, then QAT (``utils.qat.run.pipeline.qat``). Rank 0 (or the single process) evaluates, writes every
    file and prints (the recorder); the other ranks train on their shards and wait while rank 0 works."""
    with timing.timed("imports"):  # modelopt's the larger part
        from utils.qat.run.pipeline import qat
        from utils.qat.quantize.head import check_layers
        from utils.qat.quantize.rules import fp_patterns
        from utils.qat.run.run_record import RunRecorder
    with timing.timed("loading"), distributed.same_on_every_rank():  # every rank's checks: one error, printed once
        fp = checkpoint.load_fp(args.weights, task=args.task, trust=args.trust_weights)
        resolve_auto(args, device)
        config = quant_config(args)
        fp_patterns(fp, list(config.skip))  # --skip-layers and --search-layers: before any evaluation
        check_layers(fp, config.search_layers)
        data = _data(args, ("train", "val"))
        if args.max_drop is not None:
            holdout_images(data, args.holdout_fraction)  # a split leaving a side empty: refused before any work
        args.hyp, hyp = hyp_argument(args.hyp, args.task)
        args.imgsz = validate.check_imgsz(args.imgsz, int(fp.stride.max()))
    recorder = None
    if distributed.is_main():
        recorder = RunRecorder(reports.run_dir(args.project, args.name, args.exist_ok), args.weights,
                               _score(args, data, device), arguments=vars(args), task=args.task,
                               title=f"yolov9-qat: {Path(args.weights).name} on {Path(args.data).name} at {args.imgsz}px",
                               world_size=launch.world_size if launch else 1,
                               eval_origin=not args.no_eval_origin, eval_ptq=not args.no_eval_ptq)
    stages = dict(imgsz=args.imgsz, batch_size=args.batch_size, device=device, hyp=hyp,
                  calib_batches=args.calib_batches, workers=args.workers, task=args.task, seed=args.seed,
                  world_size=launch.world_size if launch else 1, local_rank=launch.local_rank if launch else -1,
                  recorder=recorder)
    finetuning = None if args.ptq_only else qat_config(args)
    if args.max_drop is None:
        qat(fp, data, config, finetuning, **stages)
        return recorder.out if recorder else None
    from utils.qat.run import budget
    limits = budget.Budget(max_drop=args.max_drop, holdout_fraction=args.holdout_fraction, min_int8=args.min_int8,
                           confidence=args.confidence, strict=args.strict)
    _, _, summary = budget.to_budget(fp, data, config, finetuning, limits, score=_score(args, data, device), **stages)
    if recorder:
        recorder.finish()
    budget.check(summary, str(recorder.best_path) if recorder else "qat_best", limits.strict)
    return recorder.out if recorder else None


def _one_process_device(spec: str, command: str, task: str = "detect"):
    """``sensitive`` and ``eval`` run in one process on one GPU: refused under torch.distributed.run."""
    if distributed.launch_from_env() is not None:
        script = SCRIPTS[task]
        raise QATError(f"{script} {command} runs in one process on one GPU; start it as `python3 {script} {command} "
                       "... --device 0`, without torch.distributed.run (only quantize uses several GPUs).")
    return select_device(spec)


def cmd_sensitive(args) -> Path:
    from utils.qat.core.atomic import write_text
    from utils.qat.run.pipeline import sensitivity
    from utils.qat.quantize.head import check_layers
    device = _one_process_device(args.device, "sensitive", args.task)
    fp = checkpoint.load_fp(args.weights, task=args.task, trust=args.trust_weights)
    resolve_auto(args, device)
    config = quant_config(args)
    check_layers(fp, config.search_layers)
    data = _data(args, ("train", "val"))
    if load_hyp(args.hyp) is not None:
        print("notice: --hyp sets the augmentation of QAT fine-tuning; sensitive only calibrates (on images without "
              "augmentation, as quantize does), so it is not used here.")
    args.imgsz = validate.check_imgsz(args.imgsz, int(fp.stride.max()))
    out = reports.run_dir(args.project, args.name, args.exist_ok)
    base, layers = sensitivity(fp, data, config, _score(args, data, device),
                               calib_batches=args.calib_batches, num_images=args.num_image)
    top = layers[:args.top]
    skip = ",".join(str(r["layer"]) for r in top if r["gain"] > 0)
    summary = {"weights": args.weights, "task": args.task, "calib_method": args.calib_method, "num_image": base.images,
               "ptq_AP": round(base.mAP50_95, 4), "layers": layers, "suggested_skip_layers": skip,
               "arguments": vars(args), "provenance": provenance.record(args.weights)}
    if args.task == "segment":
        summary["ptq_box_AP"] = round(base.box.mAP50_95, 4)
    write_text(out / "summary-sensitive-analysis.json", json.dumps(summary, indent=2))
    reports.plot_sensitivity(out / "sensitivity.png", layers, base.mAP50_95)
    metric = "mask mAP50-95" if args.task == "segment" else "mAP50-95"
    print(f"\nAll layers INT8 (PTQ): {metric} {base.mAP50_95:.4f} on {base.images} images. "
          f"Top {len(top)} layers whose FP version helps most:")
    columns = ("module", "AP", "AP50", "box_AP", "gain") if args.task == "segment" else ("module", "AP", "AP50", "gain")
    print(reports.table([{"name": str(r["layer"]), **r} for r in top], columns=columns, first="Layer"))
    print(f"\nsuggested: {SCRIPTS[args.task]} quantize ... --skip-layers {skip or '(none: no layer gains from FP)'}")
    print(f"results in {out}: summary-sensitive-analysis.json, sensitivity.png")
    return out


def cmd_eval(args) -> Path:
    from utils.qat.core.atomic import write_text
    from utils.qat.run.run_record import print_table
    device = _one_process_device(args.device, "eval", args.task)
    ckpt = checkpoint.read(args.weights, trust=args.trust_weights)
    source = provenance.record(args.weights)
    if checkpoint.is_quantized(ckpt):
        model, info, _ = checkpoint.load_quantized(args.weights, task=args.task, ckpt=ckpt, trust=args.trust_weights)
        kind = f"INT8 ({info.config.method})"
    elif args.allow_fp:
        model, kind = checkpoint.load_fp(args.weights, task=args.task, ckpt=ckpt), "FP"
    else:
        raise QATError(f"{args.weights} is a floating-point checkpoint; pass --allow-fp to evaluate it, "
                       f"or give a quantized checkpoint from `{SCRIPTS[args.task]} quantize`.")
    data = _data(args, ("val",))
    args.imgsz = validate.check_imgsz(args.imgsz, int(model.stride.max()))
    out = reports.run_dir(args.project, args.name, args.exist_ok)
    m, seconds = _score(args, data, device)(model, f"eval {kind}", num_images=args.num_image,
                                            save_json=out / "predictions.json" if args.save_json else None)
    row = reports.entry(Path(args.weights).stem, args.weights, m, seconds, kind=kind)
    write_text(out / "results.json", json.dumps({**row, **reports.per_class(m), "provenance": source}, indent=2))
    print_table([row])
    print(f"\nscored {args.weights} (sha256 {source['weights_sha256']})")
    print(f"results in {out}/results.json")
    return out


def main(args) -> Path:
    timing.begin()  # report.json's stages: start-up is the time until here
    validate.check_args(args)
    keep_freed_memory()  # the CPU's work (calibration, evaluation, data) without page-faulting every large tensor
    return {"quantize": cmd_quantize, "sensitive": cmd_sensitive, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
