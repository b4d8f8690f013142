"""The stages of a quantization run as functions with explicit parameters, for the CLIs and benchmarks.

    score = Evaluation(data, imgsz=640, batch_size=16, device=device)             # how models are scored
    qmodel, info = ptq(fp_model, data, QuantConfig(method="mse"), imgsz=640, batch_size=16, device=device)
    qmodel, info = qat(fp_model, data, QuantConfig(), QATConfig(), imgsz=640, batch_size=16, device=device,
                       recorder=RunRecorder(out, "gelan-c.pt", score, arguments={...}))
    base, layers = sensitivity(fp_model, data, QuantConfig(), score)

``qat`` is ``ptq`` then ``finetune_stage``; the recorder (``utils/qat/run/run_record.py``, rank 0 only) evaluates
and saves after each stage. Multi-GPU: every rank calls ``qat`` with its ``world_size`` / ``local_rank``
(the process group joined); only rank 0 passes a recorder.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from utils.qat.quantize.config import QuantConfig
from utils.qat.core import distributed, timing
from utils.qat.evaluation.data import dataloader, images_only, labelled

if TYPE_CHECKING:
    from utils.qat.quantize.config import QuantInfo
    from utils.qat.quantize.finetune import EpochResult, QATConfig
    from utils.qat.run.run_record import RunRecorder


@dataclass(frozen=True)
class Evaluation:
    """How a run scores a model: mAP on the 'val' split of ``data`` at ``imgsz`` on ``device``; ``task``
    picks the evaluation loop (segment: box + mask mAP, the mask's ranking). The val loader is made once and
    kept for every evaluation of the run (``loaders``: its workers read ahead while the run trains)."""
    data: dict
    imgsz: int
    batch_size: int
    device: torch.device
    task: str = "detect"
    conf_thres: float = 0.001
    iou_thres: float = 0.7
    workers: int = 8
    loaders: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, model: nn.Module, desc: str, num_images: int | None = None,
                 save_json: Path | None = None) -> tuple[Any, float]:
        """``(metrics, seconds)`` of ``model`` (a torch model, FP or fake-quantized)."""
        from utils.qat.evaluation.backends import TorchBackend
        from utils.qat.evaluation.evaluate import evaluate
        start = time.time()
        with timing.timed(f"scoring {desc}"):
            m = evaluate(TorchBackend(model, self.device, task=self.task), self.data, task=self.task, imgsz=self.imgsz,
                         batch_size=self.batch_size, conf_thres=self.conf_thres, iou_thres=self.iou_thres,
                         workers=self.workers, num_images=num_images, save_json=save_json, desc=desc,
                         loaders=self.loaders)
        return m, time.time() - start


def ptq(fp_model: nn.Module, data: dict, config: QuantConfig = QuantConfig(), *, imgsz: int, batch_size: int,
        device: torch.device, calib_batches: int = 25, workers: int = 8) -> tuple[nn.Module, QuantInfo]:
    """A calibrated copy of ``fp_model``: Q/DQ placed, amax from ``calib_batches`` batches of
    ``batch_size`` images of the training split (letterboxed, no augmentation). Returns ``(qmodel, info)``.

    In a multi-GPU run (process group joined) every rank calls this; rank 0 alone reads the images (the
    global batches, as one process does) and the others receive its amax (``utils/qat/quantize/calib.py``).
    """
    from utils.qat.quantize.model_quant import quantize
    batches, num_batches = [], None
    with timing.timed("calibration"):  # its amax search a stage of its own
        if distributed.is_main():
            loader, _ = dataloader(data, "train", imgsz, batch_size, int(fp_model.stride.max()), workers=workers,
                                   rect=False, prefix="calibration: ")
            batches, num_batches = images_only(loader, device), min(calib_batches, len(loader))
        qmodel, info = quantize(fp_model, batches, config, device=device, num_batches=num_batches)
    qmodel.names = fp_model.names
    _dump_amax(qmodel)
    return qmodel, info


def _dump_amax(qmodel: nn.Module) -> None:
    """With YOLOV9_QAT_AMAX_DUMP=<folder>, every process writes its calibrated amax values (quantizer name ->
    list) to <folder>/amax_rank<r>.json: how benchmarks/cost.py --mode ddp compares ranks and runs. Off by default."""
    folder = os.environ.get("YOLOV9_QAT_AMAX_DUMP")
    if not folder:
        return
    from utils.qat.quantize.state import amax_table
    from utils.qat.core.atomic import write_text
    write_text(Path(folder) / f"amax_rank{distributed.rank()}.json", json.dumps(amax_table(qmodel)))


def finetune_stage(qmodel: nn.Module, fp_model: nn.Module, info: QuantInfo, data: dict, config: QATConfig, *,
                   imgsz: int, batch_size: int, device: torch.device, hyp: dict | None = None, workers: int = 8,
                   task: str = "detect", world_size: int = 1, local_rank: int = -1, seed: int | None = None,
                   on_epoch_end: Callable[[EpochResult], None] | None = None,
                   until: Callable[[], bool] | None = None) -> list[EpochResult]:
    """QAT fine-tuning of the calibrated ``qmodel`` towards ``fp_model`` (and/or the labels) on the training
    split (upstream's augmentation per ``hyp``; ``seed``: its order and augmentation). ``batch_size`` is the global
    batch: each of ``world_size`` processes reads its share (``local_rank`` >= 0, DistributedSampler).
    ``on_epoch_end`` / ``until``: as ``finetune`` takes them."""
    from utils.qat.quantize.objectives import needs_labels
    from utils.qat.quantize.model_quant import fused_copy
    from utils.qat.quantize.finetune import finetune
    labels = needs_labels(config.objective)
    # its own seconds: the loader and teacher made, and what runs between the epochs' steps, scoring and saving
    with timing.timed("fine-tuning set-up"):
        loader, _ = dataloader(data, "train", imgsz, batch_size // world_size, int(fp_model.stride.max()),
                               workers=workers, rect=False, shuffle=True, hyp=hyp, prefix="QAT: ",
                               local_rank=local_rank, masks=labels and task == "segment", seed=seed)
        teacher = fused_copy(fp_model, device)  # folded where the student was (model_quant.fused_copy says why)
        return finetune(qmodel, teacher, lambda: (labelled if labels else images_only)(loader, device), config,
                        device=device, hyp=hyp, on_epoch_start=loader.sampler.set_epoch if local_rank >= 0 else None,
                        on_epoch_end=on_epoch_end, until=until, scale_groups=info.scale_groups)


def qat(fp_model: nn.Module, data: dict, quant: QuantConfig, config: QATConfig | None, *, imgsz: int,
        batch_size: int, device: torch.device, hyp: dict | None = None, calib_batches: int = 25, workers: int = 8,
        task: str = "detect", seed: int | None = None, world_size: int = 1, local_rank: int = -1,
        recorder: RunRecorder | None = None) -> tuple[nn.Module, QuantInfo]:
    """PTQ, then QAT fine-tuning per ``config`` (None: stop after calibration, ``--ptq-only``). With a
    ``recorder`` (rank 0 or the single process), the FP model, the PTQ model and every epoch are evaluated
    and saved as they come. Returns the fine-tuned model (not the best epoch's: the recorder keeps that)."""
    if seed is not None:
        from utils.general import init_seeds
        init_seeds(seed)
    if recorder:
        recorder.origin(fp_model)
    start = time.time()
    qmodel, info = ptq(fp_model, data, quant, imgsz=imgsz, batch_size=batch_size, device=device,
                       calib_batches=calib_batches, workers=workers)
    if recorder:
        recorder.ptq(qmodel, info, calibration_seconds=time.time() - start, finetuning=config is not None)
    if config is not None:
        finetune_stage(qmodel, fp_model, info, data, config, imgsz=imgsz, batch_size=batch_size, device=device,
                       hyp=hyp, workers=workers, task=task, world_size=world_size, local_rank=local_rank, seed=seed,
                       on_epoch_end=(lambda result: recorder.epoch_end(qmodel, info, result)) if recorder else None,
                       until=lambda: recorder.until() if recorder else distributed.broadcast_object(False))  # diverged
    if recorder:
        recorder.finish()
    return qmodel, info


def sensitivity(fp_model: nn.Module, data: dict, quant: QuantConfig, score: Evaluation, *, calib_batches: int = 25,
                num_images: int | None = None) -> tuple[Any, list[dict]]:
    """Per-layer sensitivity: the PTQ model scored with all layers INT8, then with each layer's quantizers
    off in turn. Returns ``(all-INT8 metrics, layers)``, layers best first: index, module, AP, AP50 (box AP
    for segmentation) and ``gain`` (AP with that layer in FP minus the all-INT8 AP)."""
    from utils.qat.quantize.state import enabled_quantizers, quantizers_off
    from utils.qat.run.run_record import ap_record
    qmodel, _ = ptq(fp_model, data, quant, imgsz=score.imgsz, batch_size=score.batch_size, device=score.device,
                    calib_batches=calib_batches, workers=score.workers)
    base, _ = score(qmodel, "all layers INT8", num_images)
    layers = []
    for i, layer in enumerate(qmodel.model):
        qs = enabled_quantizers(layer)
        if not qs:
            continue
        with quantizers_off(qs):
            m, _ = score(qmodel, f"layer {i} in FP", num_images)
        layers.append({"layer": i, "module": type(layer).__name__.removeprefix("Quant"), **ap_record(m),
                       "gain": round(m.mAP50_95 - base.mAP50_95, 4)})
    layers.sort(key=lambda r: r["AP"], reverse=True)
    return base, layers
