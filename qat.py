"""Quantization-aware training for YOLOv9 (INT8, TensorRT-ready).

    python3 qat.py quantize  --weights yolov9-c-converted.pt --data data/coco.yaml --hyp data/hyps/hyp.scratch-high.yaml
    python3 qat.py sensitive --weights yolov9-c-converted.pt --data data/coco.yaml --num-image 1000
    python3 qat.py eval      --weights runs/qat/exp/weights/qat_best_yolov9-c-converted.pt --data data/coco.yaml
"""
from __future__ import annotations

from utils.qat import compat

compat.apply()

import argparse  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING  # noqa: E402


from utils.qat import checkpoint, distributed, reports, validate  # noqa: E402
from utils.qat.backends import TorchBackend  # noqa: E402
from utils.qat.data import check_imgsz, data_argument, dataloader, images_only, labelled, load_data_yaml, load_hyp  # noqa: E402
from utils.qat.device import select_device  # noqa: E402
from utils.qat.errors import QATError, run_cli  # noqa: E402
from utils.qat.evaluate import evaluate  # noqa: E402

if TYPE_CHECKING:
    from models.quantize_finetune import QATConfig



def _common(p: argparse.ArgumentParser, project: str) -> None:
    p.add_argument("--weights", required=True, help="model checkpoint (.pt)")
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


def _calibration(p: argparse.ArgumentParser) -> None:
    from models.quantize_defaults import CALIB_METHODS, DEFAULT_CALIB_METHOD, DEFAULT_PERCENTILE
    p.add_argument("--calib-method", choices=CALIB_METHODS, default=DEFAULT_CALIB_METHOD,
                   help="activation calibration (weights are always per-channel max)")
    p.add_argument("--percentile", type=float, default=DEFAULT_PERCENTILE, help="for --calib-method percentile")
    p.add_argument("--calib-batches", type=int, default=25, help="training-set batches used for calibration")
    p.add_argument("--hyp", default=None, help="hyperparameter yaml for QAT-time augmentation")
    p.add_argument("--seed", type=int, default=57)


def _finetuning(p: argparse.ArgumentParser) -> None:
    from models.qat_objectives import OBJECTIVES
    from models.quantize_finetune import OPTIMIZERS, QATConfig
    d = QATConfig()
    p.add_argument("--epochs", type=int, default=d.epochs, help="QAT epochs")
    p.add_argument("--iters", type=int, default=d.iters,
                   help="QAT optimisation steps per epoch (a smaller training set is read again)")
    p.add_argument("--qat-loss", choices=OBJECTIVES, default=d.objective,
                   help="what fine-tuning minimises: head = distillation on the head's raw box/class outputs, "
                        "features = normalised block outputs, task = upstream's loss from the labels, "
                        "mse = this project's first recipe; combine with + (default: %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak QAT learning rate (default: %(default)s)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default=d.optimizer, help="default: %(default)s")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="on conv weights (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=d.warmup,
                   help="linear warm-up steps before the cosine decay (default: %(default)s)")
    p.add_argument("--ema", type=float, default=d.ema,
                   help="decay of the moving average of the weights that is evaluated and saved; 0 = off "
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


def qat_config(args) -> QATConfig:
    """The fine-tuning settings of a ``quantize`` command line."""
    from models.quantize_finetune import QATConfig
    return QATConfig(epochs=args.epochs, iters=args.iters, lr=args.lr, objective=args.qat_loss,
                     optimizer=args.optimizer, weight_decay=args.weight_decay, warmup=args.warmup,
                     ema=args.ema, supervision_stride=args.supervision_stride, amax_lr=args.amax_lr,
                     bias_lr=args.bias_lr, box_gain=args.box_gain)


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
    _calibration(q)
    _finetuning(q)
    q.add_argument("--skip-layers", default="", help="keep in FP: layer indices and/or module patterns, comma separated")
    q.add_argument("--no-eval-origin", action="store_true", help="do not evaluate the FP model")
    q.add_argument("--no-eval-ptq", action="store_true", help="do not evaluate the calibrated (PTQ) model")
    q.add_argument("--ptq-only", action="store_true", help="stop after calibration (no fine-tuning)")
    q.add_argument("--conf-thres", type=float, default=0.001)
    q.add_argument("--iou-thres", type=float, default=0.7)

    s = sub.add_parser("sensitive", help="per-layer sensitivity: AP with each layer kept in FP")
    _common(s, f"{runs}_sensitive")
    _calibration(s)
    s.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images")
    s.add_argument("--top", type=int, default=10, help="layers shown in the table and the suggested skip list")

    e = sub.add_parser("eval", help="evaluate a quantized checkpoint (or an FP one with --allow-fp)")
    _common(e, f"{runs}_eval")
    e.add_argument("--conf-thres", type=float, default=0.001)
    e.add_argument("--iou-thres", type=float, default=0.7)
    e.add_argument("--allow-fp", action="store_true", help="also accept floating-point checkpoints")
    e.add_argument("--num-image", type=int, default=None, help="evaluate on the first N validation images")
    e.add_argument("--save-json", action="store_true", help="also save COCO-style predictions JSON")
    return parser


def _backend(model, device, args) -> TorchBackend:
    return TorchBackend(model, device, task=args.task)


def _score(backend, data, args, desc: str, num_images: int | None = None):
    start = time.time()
    m = evaluate(backend, data, task=args.task, imgsz=args.imgsz, batch_size=args.batch_size,
                 conf_thres=getattr(args, "conf_thres", 0.001), iou_thres=getattr(args, "iou_thres", 0.7),
                 workers=args.workers, num_images=num_images, desc=desc)
    return m, time.time() - start


def _data(args, splits: tuple[str, ...]) -> dict:
    """The dataset yaml, checked; segmentation also needs polygon labels in the splits it evaluates on."""
    args.data = data_argument(args.data)
    data = load_data_yaml(args.data, splits=splits)
    if args.task == "segment":
        from utils.qat.data import check_polygons
        check_polygons(data, ("val",))
    return data


def _epoch_record(m) -> dict:
    """Per-epoch numbers for report.json (segmentation: the mask AP ranks, the box AP is kept beside it)."""
    record = {"AP": round(m.mAP50_95, 4), "AP50": round(m.mAP50, 4)}
    if m.mask is not None:
        record.update(box_AP=round(m.box.mAP50_95, 4), box_AP50=round(m.box.mAP50, 4))
    return record


def _print_table(rows: list[dict]) -> None:
    print()
    print(reports.table(rows))
    diff = reports.deltas(rows)
    if diff:
        print()
        print(reports.table(diff, first="Comparison"))


def _calibrated(fp_model, data, args, device, skip=(), launch=None):
    """PTQ with the command line's settings (``utils.qat.pipeline.ptq``). Returns (model, info)."""
    from utils.qat.pipeline import ptq
    world, local_rank = (launch.world_size, launch.local_rank) if launch else (1, -1)
    qmodel, info = ptq(fp_model, data, imgsz=args.imgsz, batch_size=args.batch_size, device=device,
                       method=args.calib_method, percentile=args.percentile, skip=skip,
                       calib_batches=args.calib_batches, workers=args.workers, world_size=world, local_rank=local_rank)
    _dump_amax(qmodel)
    return qmodel, info


def _dump_amax(qmodel) -> None:
    """With YOLOV9_QAT_AMAX_DUMP=<folder>, every process writes its calibrated amax values (quantizer name ->
    list) to <folder>/amax_rank<r>.json: how benchmarks/ddp.py compares ranks and runs. Off by default."""
    folder = os.environ.get("YOLOV9_QAT_AMAX_DUMP")
    if not folder:
        return
    from models.quantize_state import amax_table
    from utils.qat.atomic import write_text
    write_text(Path(folder) / f"amax_rank{distributed.rank()}.json", json.dumps(amax_table(qmodel)))


def _copy_atomic(src: Path, dest: Path) -> None:
    from utils.qat.atomic import copy_file
    copy_file(src, dest)


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
    """PTQ, then QAT. Rank 0 (or the single process) evaluates, writes every file and prints; the other
    ranks calibrate and train on their shards, and wait at barriers while rank 0 evaluates."""
    from models.qat_objectives import needs_labels
    from models.quantize import fuse
    from models.quantize_finetune import finetune
    from utils.general import init_seeds
    world, local_rank = (launch.world_size, launch.local_rank) if launch else (1, -1)
    fp = checkpoint.load_fp(args.weights, task=args.task)
    validate.skip_layers(fp, args.skip_layers)  # before any evaluation
    data = _data(args, ("train", "val"))
    hyp = load_hyp(args.hyp)
    stride = int(fp.stride.max())
    args.imgsz = check_imgsz(args.imgsz, stride)
    init_seeds(args.seed)
    skip = [s for s in args.skip_layers.split(",") if s.strip()]
    run = _Run(args, data, device, world) if distributed.is_main() else None
    if run and not args.no_eval_origin:
        run.origin(fp)

    start = time.time()
    qmodel, info = _calibrated(fp, data, args, device, skip, launch)
    if run:
        run.ptq(qmodel, info, calibration_seconds=time.time() - start)

    if not args.ptq_only:
        config = qat_config(args)
        labels = needs_labels(config.objective)
        loader, _ = dataloader(data, "train", args.imgsz, args.batch_size // world, stride, workers=args.workers,
                               rect=False, shuffle=True, hyp=hyp, prefix="QAT: ", local_rank=local_rank,
                               masks=labels and args.task == "segment")
        teacher = fuse(copy.deepcopy(fp))
        finetune(qmodel, teacher, lambda: (labelled if labels else images_only)(loader, device), config,
                 device=device, hyp=hyp,
                 on_epoch_start=loader.sampler.set_epoch if launch else None,
                 on_epoch_end=functools.partial(run.epoch_end, qmodel, info) if run else None,
                 scale_groups=info.scale_groups)
    return run.finish(qat=not args.ptq_only) if run else None


class _Run:
    """The evaluating and writing side of ``quantize`` (rank 0 of a multi-GPU run): the run folder, the
    checkpoints, report.json / report.md kept current after every stage, and the tables printed."""

    def __init__(self, args, data: dict, device, world: int):
        self.args, self.data, self.device = args, data, device
        self.out = reports.run_dir(args.project, args.name, args.exist_ok)
        self.wdir = self.out / "weights"
        self.wdir.mkdir(exist_ok=True)
        self.stem = Path(args.weights).stem
        reports.replace_previous_run(self.out, self.stem)
        self.title = f"yolov9-qat: {Path(args.weights).name} on {Path(args.data).name} at {args.imgsz}px"
        self.rows: list[dict] = []
        self.epochs: list[dict] = []
        self.meta: dict = {"world_size": world}
        self.best_path = self.wdir / f"qat_best_{self.stem}.pt"
        self.ptq_ap: float | None = None
        self.best_ap: float | None = None
        self.best_epoch, self.best_row = 0, None

    def save_report(self) -> None:
        reports.write_report(self.out, self.rows, self.epochs, self.title, **self.meta)

    def origin(self, fp) -> None:
        m, sec = _score(_backend(fp, self.device, self.args), self.data, self.args, "Origin")
        self.rows.append(reports.entry("Origin", self.args.weights, m, sec))
        self.save_report()

    def ptq(self, qmodel, info, calibration_seconds: float) -> None:
        self.meta["calibration_seconds"] = round(calibration_seconds, 1)
        if not self.args.no_eval_ptq:
            m, sec = _score(_backend(qmodel, self.device, self.args), self.data, self.args, "PTQ")
            self.ptq_ap = self.best_ap = m.mAP50_95
            path = self.wdir / f"ptq_ap_{m.mAP50_95:.4f}_{self.stem}.pt"
            self.rows.append(reports.entry("PTQ", path, m, sec, calib_method=info.calib_method))
        else:
            path = self.wdir / f"ptq_{self.stem}.pt"
        checkpoint.save_quantized(path, qmodel, info, epoch=0, metrics=self.rows[-1] if self.ptq_ap is not None else None,
                                  task=self.args.task)
        self.save_report()
        print(f"PTQ model saved to {path}")
        if self.ptq_ap is not None and not self.args.ptq_only:
            _copy_atomic(path, self.best_path)  # the starting point counts: fine-tuning must beat it

    def epoch_end(self, qmodel, info, result) -> None:
        epoch = result.epoch + 1
        m, sec = _score(_backend(qmodel, self.device, self.args), self.data, self.args, f"QAT epoch {epoch}")
        path = self.wdir / f"qat_ep_{epoch}_ap_{m.mAP50_95:.4f}_{self.stem}.pt"
        row = reports.entry(f"QAT epoch {epoch}", path, m, sec)
        checkpoint.save_quantized(path, qmodel, info, epoch=epoch, metrics=row, task=self.args.task)
        self.epochs.append({"epoch": epoch, **_epoch_record(m), "loss": result.loss, "loss_terms": result.terms,
                            "steps": result.steps, "train_seconds": round(result.seconds, 1), "weights": str(path)})
        if self.best_ap is None or m.mAP50_95 > self.best_ap:
            self.best_ap, self.best_epoch, self.best_row = m.mAP50_95, epoch, row
            _copy_atomic(path, self.best_path)
        self.save_report()

    def finish(self, qat: bool) -> Path:
        if qat:
            if self.best_row is not None:
                self.rows.append({**self.best_row, "name": "QAT", "weights": str(self.best_path), "epoch": self.best_epoch})
            elif self.ptq_ap is not None:
                ptq_row = next(r for r in self.rows if r["name"] == "PTQ")
                self.rows.append({**ptq_row, "name": "QAT", "weights": str(self.best_path), "epoch": 0,
                                  "note": "no fine-tuning epoch beat the calibrated model; qat_best is the PTQ model"})
            self.save_report()
            print(f"best QAT model (epoch {self.best_epoch}) saved to {self.best_path}")
        _print_table(self.rows)
        print(f"\nresults in {self.out}: report.md, report.json{', qat_ap.png' if self.epochs else ''}, weights/")
        return self.out


def _one_process_device(spec: str, command: str, task: str = "detect"):
    """``sensitive`` and ``eval`` run in one process on one GPU: refused under torch.distributed.run."""
    if distributed.launch_from_env() is not None:
        script = SCRIPTS[task]
        raise QATError(f"{script} {command} runs in one process on one GPU; start it as `python3 {script} {command} "
                       "... --device 0`, without torch.distributed.run (only quantize uses several GPUs).")
    return select_device(spec)


def cmd_sensitive(args) -> Path:
    from models.quantize_state import enabled_quantizers, quantizers_off
    from utils.qat.atomic import write_text
    device = _one_process_device(args.device, "sensitive", args.task)
    fp = checkpoint.load_fp(args.weights, task=args.task)
    data = _data(args, ("train", "val"))
    if args.hyp:
        load_hyp(args.hyp)
        print("notice: --hyp sets the augmentation of QAT fine-tuning; sensitive only calibrates (on images without "
              "augmentation, as quantize does), so it is not used here.")
    args.imgsz = check_imgsz(args.imgsz, int(fp.stride.max()))
    out = reports.run_dir(args.project, args.name, args.exist_ok)
    qmodel, info = _calibrated(fp, data, args, device)
    backend = _backend(qmodel, device, args)
    base, _ = _score(backend, data, args, "all layers INT8", args.num_image)
    layers = []
    for i, layer in enumerate(qmodel.model):
        qs = enabled_quantizers(layer)
        if not qs:
            continue
        with quantizers_off(qs):
            m, _ = _score(backend, data, args, f"layer {i} in FP", args.num_image)
        layers.append({"layer": i, "module": type(layer).__name__.removeprefix("Quant"), **_epoch_record(m),
                       "gain": round(m.mAP50_95 - base.mAP50_95, 4)})
    layers.sort(key=lambda r: r["AP"], reverse=True)
    top = layers[:args.top]
    skip = ",".join(str(r["layer"]) for r in top if r["gain"] > 0)
    summary = {"weights": args.weights, "task": args.task, "calib_method": info.calib_method, "num_image": base.images,
               "ptq_AP": round(base.mAP50_95, 4), "layers": layers, "suggested_skip_layers": skip}
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
    from utils.qat.atomic import write_text
    device = _one_process_device(args.device, "eval", args.task)
    ckpt = checkpoint.read(args.weights)
    if checkpoint.is_quantized(ckpt):
        model, info, _ = checkpoint.load_quantized(args.weights, task=args.task, ckpt=ckpt)
        kind = f"INT8 ({info.calib_method})"
    elif args.allow_fp:
        model, kind = checkpoint.load_fp(args.weights, task=args.task, ckpt=ckpt), "FP"
    else:
        raise QATError(f"{args.weights} is a floating-point checkpoint; pass --allow-fp to evaluate it, "
                       f"or give a quantized checkpoint from `{SCRIPTS[args.task]} quantize`.")
    data = _data(args, ("val",))
    args.imgsz = check_imgsz(args.imgsz, int(model.stride.max()))
    out = reports.run_dir(args.project, args.name, args.exist_ok)
    start = time.time()
    m = evaluate(_backend(model, device, args), data, task=args.task, imgsz=args.imgsz, batch_size=args.batch_size,
                 conf_thres=args.conf_thres, iou_thres=args.iou_thres, workers=args.workers,
                 num_images=args.num_image, save_json=out / "predictions.json" if args.save_json else None,
                 desc=f"eval {kind}")
    row = reports.entry(Path(args.weights).stem, args.weights, m, time.time() - start, kind=kind)
    write_text(out / "results.json", json.dumps({**row, **reports.per_class(m)}, indent=2))
    _print_table([row])
    print(f"\nresults in {out}/results.json")
    return out


def main(args) -> Path:
    validate.check_args(args)
    return {"quantize": cmd_quantize, "sensitive": cmd_sensitive, "eval": cmd_eval}[args.cmd](args)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
