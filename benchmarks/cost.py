"""What QAT costs, per model size and per step: time and memory against FP training, one step's work, FP16's mAP,
several GPUs against one.

Four questions, one ``--mode`` each; run from the top of a patched YOLOv9 tree. Each writes JSON and markdown
(``model`` a PNG too) named after the mode and ``--tag`` (default: the device, e.g. h100) into ``--out``; ``ddp``
writes ddp.json and ddp.md.

``--mode model`` (the default; cost-TAG.json/.md/.png): seconds per step and peak memory of upstream train.py's FP
step and of our QAT step (``ratio`` = QAT / FP), calibration seconds per method and of the head amax search,
evaluation images per second (FP against fake-quant), and optionally the data loader alone. Every phase runs on the
same batches, read once and kept in memory, so the steps time the model's work, not the loader's
(``--loader-batches`` times that separately). Random weights (``utils.qat.core.yolov9.reinit``): time and memory do
not depend on them.

    python3 /path/to/yolov9-qat/benchmarks/cost.py --data data/coco.yaml --imgsz 640 --batch-size 16 \\
        --warmup 3 --steps 12 --calib-batches 8 --loader-batches 20

- FP step: as upstream train.py runs it (its global seeding with deterministic kernels, SGD with
  ``smart_optimizer``'s parameter groups and the batch-scaled weight decay, AMP autocast + GradScaler, the loss
  of ``utils/loss_tal.py`` (scaled by the batch), an optimizer step with gradient clipping and the ModelEMA
  update every ``--accumulate`` batches (upstream's 64 / batch)). Its mean is the amortised step; make
  ``--steps`` a multiple of ``--accumulate``.
- QAT step: ``utils.qat.quantize.finetune.finetune`` with the default QATConfig (teacher forward, EMA, learned
  amax included), from the default calibration plus the head search where both are measured. On CUDA that
  replays each step's forward and backward from a CUDA graph recorded at the first step (left out with the
  ``--warmup`` steps); the same loop with every step eager (``--no-cuda-graph``) is measured too, from the same
  calibrated model.
- A step's time runs from the end of the previous step to its own end (the device synchronised), so the first
  ``--warmup`` steps are left out; median and mean are reported. Peak memory is
  ``torch.cuda.max_memory_allocated`` of the phase, reset before it.

A model the tree cannot build (the stand-in tree lacks ELAN1: gelan-t, gelan-s) is skipped with a note; one that
runs out of memory keeps what was measured and says in which phase.

``--mode step`` (qat-step-TAG.json/.md): seconds and operations of one QAT step per model size, for each way of
running it. One step is the library's own (``utils.qat.quantize.finetune.QATStep``: teacher forward, student forward
and backward, optimiser, learned amax, EMA) with the default ``QATConfig``, on random weights calibrated with ``max``
on the same random batch. Per model and ``--impl`` (``eager``: the reference quantizer operations, ``triton``: the
hand-written kernels of utils/qat/quantize/qdq_triton.py, both with every step eager; ``graph``: the kernels with the
forward and backward replayed from a CUDA graph, utils/qat/quantize/cuda_graph.py: the default on CUDA) it reports
the median step time after ``--warmup`` steps (compilation and the graph's recording happen there), and what one step
runs: ATen operator calls issued from Python, GPU kernels and their summed time (torch.profiler, shapes not recorded;
the kernels a graph replays are not seen one by one). On the CPU at a tiny size (``--imgsz 64 --batch-size 2``, the
mode's defaults) arithmetic is negligible and the step time is what the quantizers' Python and operator overhead
costs.

    python3 /path/to/yolov9-qat/benchmarks/cost.py --mode step --device cuda:0 --imgsz 640 --batch-size 16 \\
        --steps 20 --warmup 5

``--mode fp16`` (autocast-TAG.json/.md, and the two graphs): what FP16 for TensorRT 11 (NVIDIA ModelOpt AutoCast)
costs in mAP. A quantized checkpoint is exported as ``export_qat.py --dynamic --simplify`` does, without and with
``--half`` (``utils.qat.onnx.onnx_export.to_fp16``), and each graph reports its ONNX Runtime mAP on the dataset's val
split (val_trt.py's evaluator), the Q/DQ lint, which nodes feed every Conv (``onnx_lint.conv_feeds``), the Q/DQ scale
types, the opset, how many nodes compute in FP16 and the Casts left. ONNX Runtime on the CPU runs FP16 operators it
has no FP16 kernel for in FP32 between Casts it inserts itself, so the FP16 graph's numbers include FP16 rounding at
every tensor the graph stores in FP16, not FP16 arithmetic inside the kernels (TensorRT's FP16 kernels accumulate
in FP32 too). ``--diagnose`` (detection models) also scores, to tell what moves the difference: AutoCast keeping
Q/DQ in FP32 (``op_types_to_exclude``: FP32 scales, Casts between DQ and Conv), and the FP32+INT8 graph with only
its Q/DQ scales changed, rounded to FP16 values or multiplied by 1 + u (u uniform in +-2^-11, FP16's relative
precision) for each ``--diagnose-seeds`` value.

    python3 /path/to/yolov9-qat/benchmarks/cost.py --mode fp16 --weights runs/qat/exp/weights/qat_best.pt \\
        --data data/coco.yaml --imgsz 640 --out runs/benchmark/autocast

``--mode ddp`` (ddp.json/.md, the two runs and their logs; benchmarks/parts/ddp.py): multi-GPU QAT against one GPU.
The same ``qat.py quantize`` (``--weights``, ``--data``, ``--epochs``, ``--iters``, ``--calib-method``) for the same
global batch (``--batch-size``, default 64), once in one process and once under ``torch.distributed.run`` with
``--nproc`` processes: QAT seconds per epoch and the speed-up, calibration seconds, loss and AP per epoch, and the
largest amax differences (N processes against one, and between the ranks). Keep NVLink multicast off where the host
asks for it (e.g. NCCL_NVLS_ENABLE=0; the processes inherit the environment). ``--device cpu`` runs both on the CPU
(gloo), one thread per process.

    python3 /path/to/yolov9-qat/benchmarks/cost.py --mode ddp --weights gelan-c.pt --data data/coco.yaml \\
        --imgsz 640 --batch-size 64 --epochs 3 --iters 50 --out runs/benchmark/ddp
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
sys.path.insert(1, str(Path(__file__).resolve().parent))  # benchmarks/parts/
from utils.qat.core import compat  # noqa: E402

compat.apply()

import torch  # noqa: E402

from utils.qat.core import yolov9  # noqa: E402
from utils.qat.core.atomic import atomic_path, write_text  # noqa: E402
from utils.qat.evaluation.data import DEFAULT_HYPS, NO_HYP, TREE, dataloader, load_data_yaml, load_hyp  # noqa: E402
from utils.qat.core.validate import check_imgsz  # noqa: E402
from utils.qat.core.device import select_device  # noqa: E402
from utils.qat.core.errors import QATError, run_cli  # noqa: E402
from utils.qat.core.progress import progress  # noqa: E402
from utils.qat.quantize.config import CALIB_METHODS, DEFAULT_CALIB_METHOD, QuantConfig  # noqa: E402
from utils.qat.core.validate import Range, check_args, check_value  # noqa: E402
from utils.qat.model.safe_load import add_trust_flag  # noqa: E402

SIZES = ("gelan-t", "gelan-s", "gelan-m", "gelan-c", "gelan-e")
HEAD_SEARCH = "head-search"
METHODS = (*CALIB_METHODS, HEAD_SEARCH)
RESULTS = Path(__file__).resolve().parent / "results"
NBS = 64  # upstream train.py's nominal batch: it accumulates gradients over round(64 / batch) batches
GIB = 2 ** 30


MODES = ("model", "step", "fp16", "ddp")
IMPLS = ("eager", "triton", "graph")  # --mode step; graph: the triton kernels, replayed from a CUDA graph
# each mode's defaults for the flags they share (a flag left at None takes its mode's)
MODE_DEFAULTS = {"model": {"imgsz": 640, "batch_size": 16, "device": "", "workers": 8, "steps": 12},
                 "step": {"imgsz": 64, "batch_size": 2, "device": "cpu", "steps": 10},
                 "fp16": {"imgsz": 640, "batch_size": 8, "workers": 2},
                 "ddp": {"imgsz": 640, "batch_size": 64, "device": "", "workers": 8}}
FP16_VARIANTS = (("FP32+INT8", False), ("FP16+INT8 (AutoCast)", True))


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=MODES, default="model",
                   help="model: QAT against FP training per model size; step: one QAT step per quantizer "
                        "implementation; fp16: the FP16+INT8 graph's mAP against the FP32+INT8 graph's; ddp: "
                        "qat.py quantize on --nproc GPUs against one")
    p.add_argument("--models", nargs="+", default=list(SIZES),
                   help="model yamls: names in the tree's models/detect (gelan-c) or paths (model, step)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data", help="dataset yaml: the batches are its first training batches (model; fp16: its val "
                                    "split is scored; ddp: quantize's --data)")
    src.add_argument("--synthetic", action="store_true", help="random images and boxes instead of a dataset (model)")
    p.add_argument("--hyp", default=DEFAULT_HYPS["detect"],
                   help=f"upstream hyp yaml: the loader's augmentation and the FP loss and optimizer ({NO_HYP}: no "
                        f"augmentation, the FP step with {DEFAULT_HYPS['detect']}'s values) (model)")
    p.add_argument("--imgsz", type=int, default=None, help="image size (default: 640; step: 64)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="batch (default: 16; step: 2; fp16: 8; ddp: 64, the global batch of both runs)")
    p.add_argument("--device", default=None, help="one device: 0, cuda:1, cpu (default: the first GPU; step: cpu; "
                                                  "ddp: GPUs 0 to --nproc - 1, or cpu)")
    p.add_argument("--workers", type=int, default=None, help="loader workers (default: 8; fp16: 2)")
    p.add_argument("--warmup", type=int, default=3, help="steps (and evaluation batches) left out of the timing")
    p.add_argument("--steps", type=int, default=None, help="timed steps of each loop (default: 12; step: 10)")
    p.add_argument("--accumulate", type=int, default=None,
                   help="FP: batches per optimizer step (default: upstream's) (model)")
    p.add_argument("--calib-batches", type=int, default=8, help="(model)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                   help="calibrations to time (default: all; head-search is the head's scale search after mse) (model)")
    p.add_argument("--loader-batches", type=int, default=0,
                   help="time the data loader alone over this many batches (model)")
    p.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS, help="quantizer implementations (step)")
    p.add_argument("--weights", default=None,
                   help="quantized checkpoint, qat.py / segment/qat_seg.py (fp16); the FP checkpoint (ddp)")
    add_trust_flag(p)
    p.add_argument("--num-image", type=int, default=None, help="score the first N val images only (fp16)")
    p.add_argument("--diagnose", action="store_true", help="also the Q/DQ-FP32 AutoCast and scale perturbations (fp16)")
    p.add_argument("--diagnose-seeds", default="1,2", help="seeds of the random scale perturbations (fp16)")
    p.add_argument("--nproc", type=int, default=2, help="processes (GPUs) of the multi-GPU run (ddp)")
    p.add_argument("--epochs", type=int, default=3, help="QAT epochs of both runs (ddp)")
    p.add_argument("--iters", type=int, default=50, help="QAT steps per epoch (ddp)")
    p.add_argument("--calib-method", choices=CALIB_METHODS, default="max", help="calibration of both runs (ddp)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed for each run (ddp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help=f"output folder (default: {RESULTS}; fp16 writes two graphs there too "
                                                "and needs it, ddp its runs)")
    p.add_argument("--tag", default=None, help="file name tag (default: from the device, e.g. h100; fp16: cpu)")
    return p


def check(args: argparse.Namespace) -> None:
    """Fills in the mode's defaults, then refuses what the mode cannot do, in one sentence, before any work."""
    for key, value in MODE_DEFAULTS[args.mode].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_args(args)
    if args.mode == "ddp":
        if not args.weights or not args.data or not args.out:
            raise QATError("--mode ddp runs qat.py quantize twice: pass --weights (the FP checkpoint), --data and --out "
                           "(the runs are written there).")
        args.cpu = args.device == "cpu"
        return
    if args.mode == "fp16":
        if not args.weights or not args.data or not args.out:
            raise QATError("--mode fp16 scores a quantized checkpoint's two graphs: pass --weights, --data (its val "
                           "split is scored) and --out (the graphs are written there).")
        return
    if args.weights:
        raise QATError(f"--weights is for --mode fp16; --mode {args.mode} measures random weights of --models.")
    if args.mode == "step":
        if args.data or args.synthetic:
            raise QATError("--mode step runs on one random batch: drop --data / --synthetic.")
        check_value("--warmup", args.warmup, Range(0))
        check_value("--steps", args.steps, Range(1))
        return
    if not args.data and not args.synthetic:
        raise QATError("--mode model times training on real batches: pass --data (a dataset yaml) or --synthetic.")
    check_value("--warmup", args.warmup, Range(1, hint="a step's time needs the end of the one before"))
    check_value("--steps", args.steps, Range(1))
    check_value("--accumulate", args.accumulate, Range(1))
    check_value("--loader-batches", args.loader_batches, Range(0))
    if not set(args.methods) & set(CALIB_METHODS):
        raise QATError(f"--methods {' '.join(args.methods)} has no calibration method, but QAT starts from a "
                       f"calibrated model; add one of {', '.join(CALIB_METHODS)}.")
    if args.synthetic and args.loader_batches:
        raise QATError("--loader-batches times the dataset's loader, and --synthetic has none; pass --data instead.")


def model_yaml(name: str) -> Path:
    path = Path(name)
    if path.suffix not in (".yaml", ".yml"):
        path = TREE / "models" / "detect" / f"{name}.yaml"
    if not path.is_file():
        raise QATError(f"--models {name}: {path} not found; name a yaml of the tree's models/detect "
                       f"(e.g. {', '.join(SIZES)}) or pass a yaml path.")
    return path


def build(path: Path, nc: int | None, seed: int) -> torch.nn.Module | str:
    """The model with random weights, or why it cannot be measured (one line)."""
    try:
        model = yolov9.build(path, nc)
    except Exception as e:  # noqa: BLE001  (a yaml the tree's modules cannot build, e.g. ELAN1 in the stand-in)
        return f"the tree cannot build it ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    head = type(yolov9.head(model)).__name__
    if head not in ("Detect", "DDetect"):
        return f"its {head} head is not a single detection head (the FP step uses utils/loss_tal.py)"
    model.names = {i: str(i) for i in range(yolov9.num_classes(model))}
    return yolov9.reinit(model, seed)


# ---- the batches -------------------------------------------------------------------------------------

def dataset_batches(data: dict, args: argparse.Namespace, hyp: dict | None, stride: int, n: int) -> list[tuple]:
    """The first ``n`` training batches (upstream's training loader with ``hyp``'s augmentation), images uint8."""
    loader, _ = dataloader(data, "train", args.imgsz, args.batch_size, stride, workers=args.workers, rect=False,
                           shuffle=True, hyp=hyp, seed=args.seed, prefix="cost: ")
    batches: list[tuple] = []
    while len(batches) < n:
        before = len(batches)
        for im, targets, *_ in progress(loader, desc="reading the batches"):
            batches.append((im, targets))
            if len(batches) == n:
                break
        if len(batches) == before:
            raise QATError("the training split gave no batches; check the 'train' entry of the dataset yaml.")
    return batches


def synthetic_batches(args: argparse.Namespace, nc: int, n: int, boxes: int = 8) -> list[tuple]:
    """Random uint8 images and ``boxes`` random labels per image (image, class, x, y, w, h; normalised)."""
    g = torch.Generator().manual_seed(args.seed)
    b, s = args.batch_size, args.imgsz
    out = []
    for _ in range(n):
        images = torch.randint(0, 256, (b, 3, s, s), dtype=torch.uint8, generator=g)
        index = torch.arange(b).repeat_interleave(boxes)[:, None].float()
        cls = torch.randint(0, nc, (b * boxes, 1), generator=g).float()
        xy = 0.2 + 0.6 * torch.rand(b * boxes, 2, generator=g)
        wh = 0.05 + 0.3 * torch.rand(b * boxes, 2, generator=g)
        out.append((images, torch.cat([index, cls, xy, wh], 1)))
    return out


def loader_rate(data: dict, args: argparse.Namespace, hyp: dict | None, stride: int) -> dict:
    """Images per second of the training loader alone (``--workers``, ``hyp``'s augmentation), after ``--warmup``
    batches (the workers' start)."""
    loader, _ = dataloader(data, "train", args.imgsz, args.batch_size, stride, workers=args.workers, rect=False,
                           shuffle=True, hyp=hyp, seed=args.seed, prefix="loader: ")
    total = args.warmup + args.loader_batches
    times: list[float] = []
    while len(times) < total:
        for _ in progress(loader, desc="data loader alone"):
            times.append(time.perf_counter())
            if len(times) == total:
                break
    seconds = times[-1] - times[args.warmup - 1]
    return {"images_per_second": round(args.loader_batches * args.batch_size / seconds, 1),
            "batches": args.loader_batches, "workers": loader.num_workers}


# ---- measuring ---------------------------------------------------------------------------------------

class StepTimer:
    """Called at the end of every step: each step's seconds since the end of the one before (the device
    synchronised), the first ``warmup`` steps left out."""

    def __init__(self, device: torch.device, warmup: int):
        self.device, self.warmup, self.ends = device, warmup, []

    def __call__(self, step: int | None = None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ends.append(time.perf_counter())

    def seconds(self) -> list[float]:
        ends = self.ends[self.warmup - 1:]
        return [b - a for a, b in zip(ends, ends[1:])]

    def summary(self) -> dict:
        s = self.seconds()
        return {"median": round(statistics.median(s), 4), "mean": round(statistics.fmean(s), 4), "steps": len(s)}


@contextlib.contextmanager
def peak_memory(device: torch.device, record: dict):
    """``record["peak_memory_gib"]``: the most device memory allocated by tensors inside the block, and
    ``record["peak_reserved_gib"]``: the most the caching allocator held (what has to fit on the GPU, less the CUDA
    context); GiB, None on the CPU."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    yield
    record["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 2) if cuda else None
    record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 2) if cuda else None


def timed(device: torch.device, fn) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(time.perf_counter() - start, 2), result


@contextlib.contextmanager
def upstream_seeding(seed: int):
    """train.py's global state while it trains: ``init_seeds(seed, deterministic=True)`` (deterministic
    algorithms and cuDNN kernels); put back afterwards, as our QAT runs without them. An op without a deterministic
    kernel warns instead of failing the run (the same kernels wherever upstream's training runs at all)."""
    from utils.general import init_seeds
    saved = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    init_seeds(seed, deterministic=True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.deterministic = saved[1]


def fp_training(fp: torch.nn.Module, batches: list[tuple], hyp: dict, device: torch.device,
                args: argparse.Namespace, desc: str) -> dict:
    """Upstream train.py's training step, per batch (its lines, without the data loading and logging)."""
    from utils.loss_tal import ComputeLoss
    from utils.torch_utils import ModelEMA, smart_optimizer
    record: dict = {}
    accumulate = args.accumulate
    amp = device.type == "cuda"
    with upstream_seeding(args.seed), peak_memory(device, record):
        model = copy.deepcopy(fp).to(device)
        hyp = dict(hyp, weight_decay=hyp["weight_decay"] * args.batch_size * accumulate / NBS)
        optimizer = smart_optimizer(model, "SGD", hyp["lr0"], hyp["momentum"], hyp["weight_decay"])
        ema = ModelEMA(model)
        model.nc, model.hyp = yolov9.num_classes(model), hyp
        scaler = torch.amp.GradScaler(device.type, enabled=amp)
        compute_loss = ComputeLoss(model)
        timer = StepTimer(device, args.warmup)
        model.train()
        optimizer.zero_grad()
        last_opt_step, mloss = -1, torch.zeros(3, device=device)
        for i, (imgs, targets) in enumerate(progress(batches, desc=f"{desc}: FP training")):
            imgs = imgs.to(device, non_blocking=True).float() / 255
            with torch.autocast(device.type, enabled=amp):
                pred = model(imgs)
                loss, loss_items = compute_loss(pred, targets.to(device))
            scaler.scale(loss).backward()
            if i - last_opt_step >= accumulate:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
                ema.update(model)
                last_opt_step = i
            mloss = (mloss * i + loss_items) / (i + 1)  # upstream's running mean: never read here, part of its step
            timer(i)
        del model, ema, optimizer
    return {"seconds_per_step": timer.summary(), **record}


def calibrations(fp: torch.nn.Module, batches: list[tuple], device: torch.device, args: argparse.Namespace,
                 record: dict):
    """Each --methods calibration on the same first ``--calib-batches`` batches, then the head search on the
    model QAT starts from (the default method's where measured). Returns that model and its QuantInfo."""
    import dataclasses

    from utils.qat.quantize.head import SEARCH_BATCHES, search_head_amax
    from utils.qat.quantize.model_quant import calibrate, prepare
    from utils.qat.quantize.state import enabled_quantizers
    methods = [m for m in args.methods if m in CALIB_METHODS]
    start_from = DEFAULT_CALIB_METHOD if DEFAULT_CALIB_METHOD in methods else methods[0]
    calib = batches[:args.calib_batches]
    images = lambda: (im.to(device, non_blocking=True).float() / 255 for im, _ in calib)  # noqa: E731
    seconds, peaks, kept = {}, {}, None
    for method in methods:
        config = QuantConfig(method=method, head_amax="calibrated")
        qmodel, info = prepare(fp, config, device)
        with peak_memory(device, peaks.setdefault(method, {})):
            qmodel.to(device)
            seconds[method], (groups, _) = timed(device, lambda: calibrate(qmodel, images(), config,
                                                                          num_batches=len(calib)))
        if method == start_from:
            kept = qmodel.cpu(), dataclasses.replace(info, scale_groups=groups)
        del qmodel
    qmodel, info = kept
    qmodel.to(device)
    if HEAD_SEARCH in args.methods:
        search = [im.to(device).float() / 255 for im, _ in calib[:SEARCH_BATCHES]]
        seconds[HEAD_SEARCH], found = timed(device, lambda: search_head_amax(qmodel, search, info.scale_groups))
        info = dataclasses.replace(info, config=dataclasses.replace(info.config, head_amax="search"), head_search=found)
    record.update(calibration_seconds=seconds, calibration_batches=len(calib),
                  calibration_peak_memory_gib=max(p["peak_memory_gib"] or 0 for p in peaks.values()) or None,
                  quantizers=len(enabled_quantizers(qmodel)))
    qmodel.names = fp.names
    return qmodel, info


def qat_training(qmodel: torch.nn.Module, info, fp: torch.nn.Module, batches: list[tuple], hyp: dict,
                 device: torch.device, args: argparse.Namespace, cuda_graph: bool = True) -> dict:
    """The library's QAT loop (``finetune``, default QATConfig) for one epoch of exactly the batches."""
    from utils.general import init_seeds
    from utils.qat.quantize.finetune import QATConfig, finetune
    from utils.qat.quantize.model_quant import fused_copy
    from utils.qat.quantize.objectives import needs_labels
    config = QATConfig(epochs=1, iters=len(batches), cuda_graph=cuda_graph)
    labels = needs_labels(config.objective)
    feed = [(im, targets, None) if labels else im for im, targets in batches]
    init_seeds(args.seed)  # as qat.py seeds a run
    record: dict = {}
    timer = StepTimer(device, args.warmup)
    with peak_memory(device, record):
        teacher = fused_copy(fp, device)
        results = finetune(qmodel, teacher, lambda: feed, config, device=device, hyp=hyp,
                           scale_groups=info.scale_groups, on_step=timer)
        del teacher
    return {"seconds_per_step": timer.summary(), **record, "objective": config.objective,
            "graph_steps": results[0].graph_steps,
            "calibration": info.config.method + (" + head search" if info.config.head_amax == "search" else "")}


def images_per_second(model: torch.nn.Module, batches: list[tuple], device: torch.device, warmup: int,
                      desc: str) -> float:
    """Inference forwards (the evaluator's TorchBackend) over the batches: images per second after ``warmup``."""
    from utils.qat.evaluation.backends import TorchBackend
    backend = TorchBackend(model, device)
    timer = StepTimer(device, warmup)
    for i, (im, _) in enumerate(progress(batches, desc=desc)):
        backend(im.to(device, non_blocking=True).float() / 255)
        timer(i)
    return round(len(batches[0][0]) / statistics.fmean(timer.seconds()), 1)


def measure(name: str, fp: torch.nn.Module, batches: list[tuple], hyp: dict, device: torch.device,
            args: argparse.Namespace) -> dict:
    """Every phase for one model; an out-of-memory error ends the model's phases, keeping what was measured."""
    from utils.qat.quantize.model_quant import fused_copy
    record: dict = {"model": name, "parameters": sum(p.numel() for p in fp.parameters())}
    phase = "FP training"
    try:
        record["fp"] = fp_training(fp, batches, hyp, device, args, name)
        phase = "calibration"
        qmodel, info = calibrations(fp, batches, device, args, record)
        phase = "QAT"
        if device.type == "cuda":  # first, on a copy: the default run below trains qmodel itself
            record["qat_eager"] = qat_training(copy.deepcopy(qmodel), info, fp, batches, hyp, device, args,
                                               cuda_graph=False)
        record["qat"] = qat_training(qmodel, info, fp, batches, hyp, device, args)
        fp_mean, qat_mean = record["fp"]["seconds_per_step"]["mean"], record["qat"]["seconds_per_step"]["mean"]
        record["ratio"] = round(qat_mean / fp_mean, 3)
        phase = "evaluation"
        record["eval_images_per_second"] = {
            "fp": images_per_second(fused_copy(fp, device), batches, device, args.warmup, f"{name}: FP evaluation"),
            "fake_quant": images_per_second(qmodel, batches, device, args.warmup, f"{name}: fake-quant evaluation")}
    except torch.cuda.OutOfMemoryError:
        record["error"] = f"out of memory in {phase} at batch {args.batch_size}"
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


# ---- the report --------------------------------------------------------------------------------------

def _version(dist: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine(device: torch.device) -> dict:
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
            "torch": torch.__version__, "cuda": torch.version.cuda, "modelopt": _version("nvidia-modelopt"),
            "python": platform.python_version()}
    if device.type == "cuda":
        info["device_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 1)
    return info


def device_tag(device: torch.device) -> str:
    """File name tag of the device: the GPU's model number (h100, a100, l40s), else its name; cpu."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if found:
        return found.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower().replace("nvidia", "")).strip("-")


def _cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _step(phase: dict) -> str:
    return f"{phase['seconds_per_step']['median']:.3f} / {phase['seconds_per_step']['mean']:.3f}" if phase else "-"


def _peak(phase: dict) -> str:
    return "-" if phase.get("peak_memory_gib") is None else f"{phase['peak_memory_gib']} ({phase['peak_reserved_gib']})"


def render(result: dict) -> str:
    s, m = result["settings"], result["machine"]
    methods = [k for k in METHODS if any(k in r.get("calibration_seconds", {}) for r in result["models"])]
    lines = [f"# What QAT costs: {m['device']}, {s['imgsz']} px, batch {s['batch_size']}", "",
             f"Seconds per step: median / mean of {s['steps']} steps after {s['warmup']} (the device synchronised), "
             f"on the same batches ({s['data'] or 'synthetic'}, augmentation {s['hyp']}). FP: upstream train.py's "
             f"step (optimizer every {s['accumulate']} batches, deterministic kernels as it sets them); QAT: "
             "`finetune` with the default QATConfig (on CUDA: forward and backward replayed from a CUDA graph); QAT "
             "eager: the same with every step eager (`--no-cuda-graph`); QAT/FP: the ratio of the means (the "
             "default's). Peak GiB: the most allocated "
             "by tensors in the phase (in brackets: held by the caching allocator). Calibration: seconds for "
             f"{s['calib_batches']} batches. Evaluation: inference forwards (the evaluator's TorchBackend), images "
             "per second.", "",
             "| model | parameters (M) | quantizers (enabled) | FP s/step | QAT s/step | QAT/FP | QAT eager s/step | "
             "FP peak GiB | QAT peak GiB | QAT eager peak GiB | "
             + " | ".join(f"{k} s" for k in methods) + " | eval img/s FP / fake-quant |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(methods) + "---:|"]
    for r in result["models"]:
        fp, qat, ev = r.get("fp", {}), r.get("qat", {}), r.get("eval_images_per_second")
        eager = r.get("qat_eager", {})
        cells = [r["model"], f"{r['parameters'] / 1e6:.1f}", _cell(r.get("quantizers")), _step(fp), _step(qat),
                 _cell(r.get("ratio"), "{:.2f}x"), _step(eager), _peak(fp), _peak(qat), _peak(eager) if eager else "-",
                 *(_cell(r.get("calibration_seconds", {}).get(k)) for k in methods),
                 f"{ev['fp']} / {ev['fake_quant']}" if ev else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [f"- {r['model']}: {r['error']}." for r in result["models"] if "error" in r]
    lines += [f"- {name} skipped: {why}." for name, why in result["skipped"].items()]
    if result.get("loader"):
        ld = result["loader"]
        lines.append(f"- Data loader alone: {ld['images_per_second']} images/s ({ld['workers']} workers, "
                     f"{ld['batches']} batches, augmentation {s['hyp']}); a step waits for data where the loader "
                     "gives fewer images per second than batch / step seconds.")
    lines.append("- Machine: " + ", ".join(f"{k} {v}" for k, v in m.items()))
    return "\n".join(lines) + "\n"


def plot(result: dict, png: Path) -> Path:
    """Seconds per step (FP, QAT) and peak memory against parameters, one point per model."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["models"] if "fp" in r and "qat" in r]
    params = [r["parameters"] / 1e6 for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    for ax, value, label in ((left, lambda d: d["seconds_per_step"]["mean"], "seconds per step (mean)"),
                             (right, lambda d: d["peak_memory_gib"], "peak memory (GiB)")):
        ax.set_xscale("log")
        ax.set_xlabel("parameters (M)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if any(value(r["qat"]) is None for r in rows):  # the CPU counts no peak memory
            ax.text(0.5, 0.5, "not measured on this device", transform=ax.transAxes, ha="center")
            continue
        labels = {"fp": "FP training", "qat": "QAT", "qat_eager": "QAT, every step eager"}
        for phase, label_ in labels.items():
            if all(phase in r for r in rows):
                ax.plot(params, [value(r[phase]) for r in rows], marker="o", label=label_,
                        linestyle=":" if phase == "qat_eager" else "-")
        for x, r in zip(params, rows):
            ax.annotate(r["model"], (x, value(r["qat"])), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.legend()
    s = result["settings"]
    fig.suptitle(f"QAT against FP training: {result['machine']['device']}, {s['imgsz']} px, batch {s['batch_size']}")
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return png


def save(result: dict, out: Path, tag: str, final: bool) -> None:
    write_text(out / f"cost-{tag}.json", json.dumps(result, indent=2) + "\n")
    write_text(out / f"cost-{tag}.md", render(result))
    if final:
        plot(result, out / f"cost-{tag}.png")


def measure_models(args: argparse.Namespace) -> dict:
    """--mode model: every phase for each model, the report saved after each."""
    yamls = {name: model_yaml(name) for name in args.models}
    device = select_device(args.device)
    augment = load_hyp(args.hyp)
    hyp = augment or load_hyp(DEFAULT_HYPS["detect"])
    data = load_data_yaml(args.data, splits=("train",)) if args.data else None
    built = {name: build(path, data["nc"] if data else None, args.seed) for name, path in yamls.items()}
    models = {name: m for name, m in built.items() if not isinstance(m, str)}
    skipped = {name: why for name, why in built.items() if isinstance(why, str)}
    skipped = {Path(name).stem: why for name, why in skipped.items()}
    for name, why in skipped.items():
        print(f"{name}: skipped, {why}", flush=True)
    if not models:
        raise QATError(f"none of --models {' '.join(args.models)} can be built by this tree; see the notes above.")
    stride = max(yolov9.model_stride(m) for m in models.values())
    args.imgsz = check_imgsz(args.imgsz, stride)
    args.accumulate = args.accumulate or max(round(NBS / args.batch_size), 1)
    if args.steps % args.accumulate:
        print(f"notice: --steps {args.steps} is not a multiple of --accumulate {args.accumulate}: the FP mean over-"
              "or under-counts optimizer steps.", flush=True)
    n = args.warmup + args.steps
    nc = yolov9.num_classes(next(iter(models.values())))
    batches = dataset_batches(data, args, augment, stride, n) if data else synthetic_batches(args, nc, n)
    if device.type == "cuda":
        batches = [(im.pin_memory(), t) for im, t in batches]
    out, tag = Path(args.out or RESULTS), args.tag or device_tag(device)
    settings = {k: getattr(args, k) for k in ("models", "data", "synthetic", "hyp", "imgsz", "batch_size", "device",
                                              "workers", "warmup", "steps", "accumulate", "calib_batches", "methods",
                                              "loader_batches", "seed")}
    result: dict = {"settings": settings, "machine": machine(device), "skipped": skipped, "loader": None,
                    "models": [], "complete": False}
    if args.loader_batches:
        result["loader"] = loader_rate(data, args, augment, stride)
    for name, fp in models.items():
        record = measure(Path(name).stem, fp, batches, hyp, device, args)
        result["models"].append(record)
        fp, qat = record.get("fp", {}), record.get("qat", {})
        print(f"{record['model']}: s/step (median / mean) FP {_step(fp)}, QAT {_step(qat)}, QAT/FP "
              f"{_cell(record.get('ratio'))}; peak GiB FP {_peak(fp)}, QAT {_peak(qat)}"
              f"{'; ' + record['error'] if 'error' in record else ''}", flush=True)
        save(result, out, tag, final=False)  # what was measured survives a run cut short
    result["complete"] = True
    save(result, out, tag, final=True)
    print(render(result))
    return result



# ---- --mode step: one QAT step per quantizer implementation -------------------------------------------

def step_operations(step, batch: torch.Tensor, device: torch.device) -> dict:
    """ATen operator calls, GPU kernels and their summed milliseconds, of one step."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, record_shapes=False) as prof:
        step(batch)
        _sync(device)
    events = prof.events()
    ops = sum(1 for e in events if e.name.startswith("aten::"))
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    cuda = device.type == "cuda"
    return {"aten_ops": ops, "gpu_kernels": len(gpu) if cuda else None,
            "gpu_ms": round(sum(e.device_time for e in gpu) / 1e3, 2) if cuda else None}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(qmodel: torch.nn.Module, teacher: torch.nn.Module, batch: torch.Tensor, impl: str,
                 args: argparse.Namespace, device: torch.device) -> dict:
    """``--warmup`` untimed steps, then the median of ``--steps`` timed ones and one profiled, for one implementation."""
    from utils.qat.quantize import qdq
    from utils.qat.quantize.finetune import QATConfig, QATStep
    model = copy.deepcopy(qmodel)
    with qdq.implementation("triton" if impl == "graph" else impl):
        step = QATStep(model, copy.deepcopy(teacher), lambda: [batch], QATConfig(cuda_graph=impl == "graph"),
                       device=device)
        step.train()
        try:
            t0 = time.perf_counter()
            for _ in range(args.warmup):
                step(batch)
            _sync(device)
            warmup_s = time.perf_counter() - t0
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                step(batch)
                _sync(device)
                times.append(time.perf_counter() - t0)
            ops = step_operations(step, batch, device)
        finally:
            step.close()
    return {"seconds_per_step": round(statistics.median(times), 5), "min_seconds": round(min(times), 5),
            "warmup_seconds": round(warmup_s, 2), **ops}


def measure_steps(args: argparse.Namespace) -> dict:
    """--mode step: a row per model, each implementation timed and counted, eager's time over each's."""
    from utils.qat.quantize.model_quant import fused_copy, quantize
    from utils.qat.quantize.state import enabled_quantizers
    yamls = {name: model_yaml(name) for name in args.models}
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    batch = torch.rand(args.batch_size, 3, args.imgsz, args.imgsz, generator=g).to(device)
    rows, skipped = [], {}
    for name, path in yamls.items():
        fp = build(path, 80, args.seed)
        if isinstance(fp, str):
            skipped[path.stem] = fp
            print(f"{path.stem}: skipped, {fp}", flush=True)
            continue
        qmodel, _ = quantize(fp, [batch], QuantConfig(method="max", head_amax="calibrated"), device=device)
        teacher = fused_copy(fp, device)
        row = {"model": path.stem, "quantizers": len(enabled_quantizers(qmodel)),
               "parameters_M": round(sum(p.numel() for p in fp.parameters()) / 1e6, 2)}
        for impl in args.impl:
            row[impl] = measure_step(qmodel, teacher, batch, impl, args, device)
            print(f"{row['model']} {impl}: {row[impl]}", flush=True)
        for impl in ("triton", "graph"):  # eager's time over each's
            if "eager" in row and impl in row:
                row[f"speedup_{impl}"] = round(row["eager"]["seconds_per_step"] / row[impl]["seconds_per_step"], 3)
        rows.append(row)
    if not rows:
        raise QATError(f"none of --models {' '.join(args.models)} can be built by this tree; see the notes above.")
    doc = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"CPU ({platform.processor() or 'cpu'})",
           "imgsz": args.imgsz, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
           "skipped": skipped, "rows": rows}
    out, tag = Path(args.out or RESULTS), args.tag or device_tag(device)
    write_text(out / f"qat-step-{tag}.json", json.dumps(doc, indent=2) + "\n")
    write_text(out / f"qat-step-{tag}.md", render_steps(doc))
    print(render_steps(doc))
    return doc


def render_steps(doc: dict) -> str:
    impls = [i for i in IMPLS if any(i in r for r in doc["rows"])]
    speedups = [i for i in impls if any(f"speedup_{i}" in r for r in doc["rows"])]
    head = "| " + " | ".join(["model", "params (M)", "quantizers"]
                             + [f"{i} {c}" for i in impls for c in ("s/step", "ATen ops", "GPU kernels", "GPU ms")]
                             + [f"speed-up {i}" for i in speedups]) + " |"
    lines = [f"## QAT step: {doc['device']}, {doc['imgsz']} px, batch {doc['batch_size']} (median of {doc['steps']} "
             f"steps after {doc['warmup']}; torch {doc['torch']}, {doc['threads']} threads)", "", head,
             "|" + "---|" * (3 + 4 * len(impls) + len(speedups))]
    for r in doc["rows"]:
        cells = []
        for i in impls:
            m = r.get(i, {})
            cells += [f"{m.get('seconds_per_step', '')}", f"{m.get('aten_ops', '')}", f"{m.get('gpu_kernels') or '-'}",
                      f"{m.get('gpu_ms') or '-'}"]
        cells += [f"{r.get(f'speedup_{i}', '-')}" for i in speedups]
        lines.append(f"| {r['model']} | {r['parameters_M']} | {r['quantizers']} | " + " | ".join(cells) + " |")
    lines += [f"- {name} skipped: {why}." for name, why in doc.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


# ---- --mode fp16: the FP16+INT8 graph against the FP32+INT8 graph -------------------------------------

def diagnose(fp32: Path, out: Path, data: dict, args: argparse.Namespace) -> dict:
    """mAP50-95 of the diagnostic graphs (see the module docstring), by name."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    from modelopt.onnx.autocast import convert_to_mixed_precision

    from utils.qat.evaluation.backends import ORTBackend
    from utils.qat.evaluation.evaluate import evaluate

    def score(model, name: str) -> float:
        path = out / f"diagnose-{name}.onnx"
        onnx.save(model, str(path))
        m = evaluate(ORTBackend(path, "cpu"), data, imgsz=args.imgsz, batch_size=args.batch_size,
                     workers=args.workers, num_images=args.num_image, desc=name)
        return round(float(m.mAP50_95), 6)

    def scaled(fn):
        m = onnx.load(str(fp32))
        inits = {t.name: t for t in m.graph.initializer}
        for name in sorted({n.input[1] for n in m.graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")}):
            t = inits[name]
            t.CopyFrom(numpy_helper.from_array(fn(numpy_helper.to_array(t).astype(np.float32)), name))
        return m

    npz = out / "diagnose-inputs.npz"
    np.savez(npz, images=np.random.default_rng(0).random((1, 3, args.imgsz, args.imgsz), dtype=np.float32))
    res = {"autocast_qdq_fp32": score(convert_to_mixed_precision(
        str(fp32), "fp16", keep_io_types=True, calibration_data=str(npz),
        op_types_to_exclude=["QuantizeLinear", "DequantizeLinear"]), "autocast_qdq_fp32")}
    res["fp16round_0"] = score(scaled(lambda a: a.astype(np.float16).astype(np.float32)), "fp16round")
    for seed in (int(x) for x in args.diagnose_seeds.split(",") if x):
        rng = np.random.default_rng(seed)
        res[f"random_{seed}"] = score(scaled(lambda a: (a * (1 + rng.uniform(-2 ** -11, 2 ** -11, a.shape)))
                                             .astype(np.float32)), f"random{seed}")
    return res


def graph_facts(path: Path, allow_fp: list[str]) -> dict:
    """Lint, Conv feeds, scale types, opset, FP16 share and Casts of one exported graph."""
    from collections import Counter

    import onnx

    from utils.qat.onnx import onnx_lint
    from utils.qat.onnx.onnx_export import module_to_onnx_pattern
    m = onnx.load(str(path))
    inits = {t.name: t for t in m.graph.initializer}
    scale_types: Counter = Counter()
    for n in m.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[1] in inits:
            scale_types[onnx.TensorProto.DataType.Name(inits[n.input[1]].data_type)] += 1
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update({o.name: o.type.tensor_type.elem_type for o in m.graph.output})
    float_nodes = [n for n in m.graph.node if n.output and types.get(n.output[0]) in (1, 10)]
    fp16 = sum(1 for n in float_nodes if types.get(n.output[0]) == 10)
    patterns = tuple(onnx_lint.DEFAULT_ALLOW_FP) + tuple(module_to_onnx_pattern(p) for p in allow_fp)
    lint = onnx_lint.lint(m, allow_fp=patterns)
    return {
        "opset": next(o.version for o in m.opset_import if o.domain in ("", "ai.onnx")),
        "lint": onnx_lint.format_lint(lint),
        "lint_findings": lint["total"],
        "conv_feeds": onnx_lint.conv_feeds(m),
        "qdq_scale_types": dict(scale_types),
        "float_nodes": len(float_nodes),
        "fp16_nodes": fp16,
        "casts": sum(1 for n in m.graph.node if n.op_type == "Cast"),
        "size_mb": round(path.stat().st_size / 1e6, 2),
    }


def score_fp16(args: argparse.Namespace) -> dict:
    """--mode fp16: the quantized checkpoint exported without and with AutoCast, each graph scored and described."""
    import onnx
    import onnxruntime

    from utils.qat import __version__
    from utils.qat.evaluation.backends import ORTBackend
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.evaluation.evaluate import evaluate
    from utils.qat.model import checkpoint
    from utils.qat.onnx.onnx_export import export_onnx, load_for_export
    from utils.qat.run import reports
    ckpt = checkpoint.read(args.weights, trust=args.trust_weights)
    model, task, quantized, fp_patterns = load_for_export(args.weights, ckpt)
    if not quantized:
        raise QATError(f"{args.weights} is not quantized; pass a checkpoint of qat.py or segment/qat_seg.py.")
    data = load_data_yaml(args.data, splits=("val",))
    out, tag = Path(args.out), args.tag or "cpu"
    out.mkdir(parents=True, exist_ok=True)
    stem = Path(args.weights).stem
    rows, results = [], {}
    for name, half in FP16_VARIANTS:
        path = out / f"{stem}-{'fp16' if half else 'fp32'}.onnx"
        t0 = time.time()
        rep = export_onnx(model, path, imgsz=args.imgsz, dynamic=True, simplify=True, half=half, task=task,
                          allow_fp=fp_patterns)
        export_s = time.time() - t0
        facts = graph_facts(path, fp_patterns)
        backend = ORTBackend(path, "cpu")
        t0 = time.time()
        m = evaluate(backend, data, task=task, imgsz=args.imgsz, batch_size=args.batch_size, workers=args.workers,
                     num_images=args.num_image, desc=f"ORT {name}")
        eval_s = time.time() - t0
        row = reports.entry(name, path, m, eval_s)
        rows.append(row)
        exact = {"mAP50_95": round(float(m.mAP50_95), 6), "mAP50": round(float(m.mAP50), 6)}
        if task == "segment":
            exact = {f"{k}_{g}": round(float(getattr(getattr(m, g), k)), 6) for g in ("box", "mask")
                     for k in ("mAP50_95", "mAP50")}
        results[name] = {**facts, "metrics": exact, "row": row, "export_seconds": round(export_s, 1),
                         "eval_seconds": round(eval_s, 1), "export_opset": rep["opset"]}
        print(f"{name}: {exact}  lint: {facts['lint']}  conv inputs: {facts['conv_feeds']['input']}")
    diag = diagnose(out / f"{stem}-fp32.onnx", out, data, args) if args.diagnose and task == "detect" else None
    a, b = (results[n]["metrics"] for n, _ in FP16_VARIANTS)
    delta = {k: round(b[k] - a[k], 6) for k in a}
    doc = {"weights": str(args.weights), "task": task, "imgsz": args.imgsz, "data": str(args.data),
           "images": m.images, "variants": results, "delta_fp16_minus_fp32": delta, "diagnose": diag,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                       "torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
                       "modelopt": _version("nvidia-modelopt"), "yolov9_qat": __version__}}
    write_text(out / f"autocast-{tag}.json", json.dumps(doc, indent=2) + "\n")
    write_text(out / f"autocast-{tag}.md", render_fp16(doc, rows))
    print(render_fp16(doc, rows))
    return doc


def render_fp16(doc: dict, rows: list[dict]) -> str:
    from utils.qat.run import reports
    lines = [f"## AutoCast FP16+INT8 vs FP32+INT8: {Path(doc['weights']).name} ({doc['task']}, {doc['imgsz']} px, "
             f"{doc['images']} images, ONNX Runtime CPU)", "", reports.table(rows), "",
             "| graph | opset | lint | Conv inputs | Conv weights | Q/DQ scales | FP16 nodes | Casts |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in doc["variants"].items():
        feeds = {k: "; ".join(f"{p}: {c}" for p, c in v["conv_feeds"][k].items()) for k in ("input", "weight")}
        scales = ", ".join(f"{k} {c}" for k, c in v["qdq_scale_types"].items())
        lines.append(f"| {name} | {v['opset']} | {'clean' if not v['lint_findings'] else v['lint']} | "
                     f"{feeds['input']} | {feeds['weight']} | {scales} | {v['fp16_nodes']}/{v['float_nodes']} | "
                     f"{v['casts']} |")
    delta = ", ".join(f"{k} {d:+.5f}" for k, d in doc["delta_fp16_minus_fp32"].items())
    lines += ["", f"FP16+INT8 minus FP32+INT8: {delta}", ""]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> dict:
    check(args)
    if args.mode == "ddp":
        from parts import ddp
        return ddp.main(args)
    return {"model": measure_models, "step": measure_steps, "fp16": score_fp16}[args.mode](args)


if __name__ == "__main__":
    run_cli(lambda: main(get_args_parser().parse_args()))
