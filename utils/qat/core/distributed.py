"""The process group of a multi-GPU run: one process per GPU, started by ``python -m torch.distributed.run``.

A process belongs to a distributed run when torchrun's variables say so (``WORLD_SIZE`` > 1, with
``RANK`` and ``LOCAL_RANK``). Every helper below is a no-op without a process group, so single-process
runs make no ``torch.distributed`` call at all.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from utils.qat.core.errors import QATError

# Rank 0 evaluates (minutes on full COCO) while the others wait at a barrier: 3 hours, as YOLOv5 and
# ultralytics use (torch's default limit, minutes, could end the wait of a long evaluation).
TIMEOUT = timedelta(hours=3)
T = TypeVar("T")


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a torchrun launch."""
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch | None:
    """This process's place in a torchrun launch of two or more processes, else None (a plain
    ``python3 qat.py``, or torchrun with ``--nproc_per_node 1``, runs as a single process)."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env or "LOCAL_RANK" not in env:
        return None
    try:
        world = int(env["WORLD_SIZE"])
        launch = Launch(rank=int(env.get("RANK", env["LOCAL_RANK"])), local_rank=int(env["LOCAL_RANK"]),
                        world_size=world, local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)))
    except ValueError as e:
        raise QATError(f"the torchrun variables WORLD_SIZE/RANK/LOCAL_RANK are not integers ({e}); start "
                       "multi-GPU runs with `python -m torch.distributed.run`, single ones without them set.") from e
    return launch if launch.world_size > 1 else None


@contextlib.contextmanager
def process_group(launch: Launch | None, device: torch.device) -> Iterator[None]:
    """Join the launch's process group for the duration of the block (NCCL on CUDA, gloo on the CPU),
    and leave it however the block ends. Nothing happens for a single process (``launch`` None)."""
    if launch is None:
        yield
        return
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT, device_id=device if cuda else None)
    try:
        yield
    except QATError as e:
        if e.every_rank is None:
            e.every_rank = False  # raised by this rank alone: it prints it (utils.qat.core.errors.run_cli)
        raise
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def same_on_every_rank() -> Iterator[None]:
    """For the checks every rank makes alike (arguments, the files they name): a QATError raised in the block
    on any rank is raised on every rank, marked as every rank's (``run_cli``: rank 0 alone prints it). One
    collective when the block ends, failed or not; nothing without a process group."""
    failed: QATError | None = None
    try:
        yield
    except QATError as e:
        failed = e
    if not active():
        if failed is not None:
            raise failed
        return
    first = next((m for m in all_gather_object(None if failed is None else str(failed)) if m is not None), None)
    if first is None:
        return
    error = failed if failed is not None and str(failed) == first else QATError(first)
    error.every_rank = True
    raise error


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    """True on rank 0 and in single-process runs: the process that evaluates, prints and writes files."""
    return rank() == 0


def barrier() -> None:
    if active():
        dist.barrier()


def _comm_device() -> torch.device:
    """Where collective tensors must live: the process's GPU for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_mean(value: float) -> float:
    """The mean of ``value`` over the ranks (``value`` itself for a single process)."""
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``t`` over the ranks, on ``t``'s device (``t`` for a single process)."""
    if not active():
        return t
    out = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.to(t.device)


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj`` (picklable), in rank order; ``[obj]`` for a single process."""
    if not active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_identical(t: torch.Tensor, what: str) -> None:
    """Raise if ``t`` differs between ranks anywhere (a bug, not a user error): one max-reduction of
    ``[t, -t]`` gives the element-wise max and min over the ranks."""
    if not active():
        return
    flat = t.detach().flatten().double()
    both = all_reduce_max(torch.cat([flat, -flat]))
    high, low = both[:flat.numel()], -both[flat.numel():]
    if not torch.equal(high, low):
        n = int((high != low).sum())
        raise RuntimeError(f"{what} differ between ranks at {n} of {flat.numel()} values")


def broadcast_object(obj: T) -> T:
    """Rank 0's ``obj`` (picklable) on every rank; ``obj`` itself for a single process."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
