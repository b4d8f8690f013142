"""Calibration and QAT fine-tuning of the embedded model on fixed inputs, in one process or on each rank of a
torchrun launch (gloo): calibration reads the global batches (rank 0 alone reads them and sends the amax),
fine-tuning rank r reads images r, r + 2, ... of every global batch.

tests/test_ddp.py runs ``python -m torch.distributed.run --nproc_per_node 2 tests/ddp_finetune.py OUT`` from the
top of the patched tree (rank 0 saves its results to OUT/rank0.pt, rank 1 to OUT/rank1.pt) and calls
``results()`` in its own process for the one-process reference.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

GLOBAL_BATCH, STEPS, IMGSZ, LR = 4, 3, 64, 1e-4
WEIGHTS = Path(__file__).resolve().parents[1] / "weights" / "gelan-qs-shapes.pt"


def _amax(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.endswith("_amax")}


def results(rank: int = 0, world: int = 1) -> dict:
    """amax after calibrating (max and mse) on the global batches, then the state dict before and after two
    epochs of fine-tuning the max-calibrated model on this rank's share of every global batch, and the losses."""
    from utils.qat.quantize.model_quant import QuantConfig, fuse, quantize
    from utils.qat.quantize.finetune import QATConfig, finetune
    from utils.qat.model import checkpoint
    images = torch.rand(STEPS, GLOBAL_BATCH, 3, IMGSZ, IMGSZ, generator=torch.Generator().manual_seed(0))
    shards = [b[rank::world] for b in images]
    fp = checkpoint.load_fp(WEIGHTS)
    out = {}
    for method in ("mse", "max"):
        student, _ = quantize(fp, images, QuantConfig(method=method))
        out[f"{method}_amax"] = _amax(student)
    start = {k: v.detach().clone() for k, v in student.state_dict().items()}
    epochs = finetune(student, fuse(fp), lambda: shards, QATConfig(epochs=2, iters=STEPS, lr=LR, warmup=0, supervision_stride=2),
                      amp=False)
    return {**out, "start": start, "state": {k: v.detach().clone() for k, v in student.state_dict().items()},
            "losses": [e.loss for e in epochs]}


def main(out: Path) -> None:
    from utils.qat.core import distributed
    torch.set_num_threads(1)
    launch = distributed.launch_from_env()
    if launch is None:
        raise SystemExit("run under torch.distributed.run with 2 or more processes")
    with distributed.process_group(launch, torch.device("cpu")):
        result = results(launch.rank, launch.world_size)
    torch.save(result, out / f"rank{launch.rank}.pt")


if __name__ == "__main__":
    from utils.qat.core import compat
    compat.apply()
    main(Path(sys.argv[1]))
