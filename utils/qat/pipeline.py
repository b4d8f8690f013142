"""The stages of a quantization run as functions with explicit parameters, for the CLIs and benchmarks.

    qmodel, info = ptq(fp_model, data, imgsz=640, batch_size=16, device=device, method="mse")
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from models.quantize_defaults import DEFAULT_CALIB_METHOD, DEFAULT_PERCENTILE
from utils.qat.data import dataloader, images_only


def ptq(fp_model: nn.Module, data: dict, *, imgsz: int, batch_size: int, device: torch.device,
        method: str = DEFAULT_CALIB_METHOD, percentile: float = DEFAULT_PERCENTILE, skip: Sequence[str] = (),
        calib_batches: int = 25, workers: int = 8, world_size: int = 1, local_rank: int = -1):
    """A calibrated copy of ``fp_model``: Q/DQ placed, amax from ``calib_batches`` batches of the training
    split (letterboxed, no augmentation). Returns ``(qmodel, info)``.

    In a multi-GPU run (``world_size`` processes) each rank reads ``calib_batches`` batches of
    ``batch_size / world_size`` images of its shard, so together the ranks see the images one process
    reading ``calib_batches`` batches of ``batch_size`` sees; calibration then merges their statistics.
    """
    from models.quantize import calibrate, prepare
    qmodel, info = prepare(fp_model, method=method, skip=skip, percentile=percentile)
    qmodel.to(device)
    loader, _ = dataloader(data, "train", imgsz, batch_size // world_size, int(fp_model.stride.max()),
                           workers=workers, rect=False, prefix="calibration: ", local_rank=local_rank)
    calibrate(qmodel, images_only(loader, device), info, num_batches=min(calib_batches, len(loader)))
    qmodel.names = fp_model.names
    return qmodel, info
