"""``--device`` parsing: cpu, N, cuda:N; under ``torch.distributed.run``, a list N,M,... (one GPU per process); and
what the CPU is (:func:`cpu_description`, :func:`exact_int8_dot`); and how a CPU run keeps its freed memory
(:func:`keep_freed_memory`).

Multi-GPU mapping (as upstream YOLOv9's train.py does it): the listed GPUs (indices as this process sees
them, i.e. after any CUDA_VISIBLE_DEVICES of the user's) become the only visible ones, in list order, before
CUDA starts; local rank r then runs on the r-th listed GPU, which it sees as ``cuda:r``. Upstream's
dataloader synchronises ranks with ``barrier(device_ids=[local_rank])``, which needs exactly that.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
from pathlib import Path

import torch

from utils.qat.core.distributed import Launch
from utils.qat.core.errors import QATError


def select_device(spec: str | None, launch: Launch | None = None, multi_gpu: str | None = None) -> torch.device:
    """The device for ``spec``; default: the first GPU if there is one, else the CPU with a notice.

    ``launch``: this process's place in a torchrun launch (None: a single process). ``multi_gpu``: the
    command line of a command that can run on several GPUs (e.g. ``qat.py quantize``), used to say how to
    launch it when a single process is given a list; None for commands that run on one GPU.
    """
    spec = (spec or "").strip().lower()
    if launch is not None:
        return _rank_device(spec, launch)
    if spec in ("", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        print("notice: no CUDA GPU found; running on the CPU (slow for full-size models).")
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if "," in spec:
        n = len(spec.split(","))
        if multi_gpu:
            raise QATError(f"--device {spec} names {n} GPUs, which takes one process per GPU: launch with "
                           f"`python -m torch.distributed.run --nproc_per_node {n} {multi_gpu} ... --device {spec}`.")
        raise QATError(f"--device {spec} names several GPUs, but this command runs on one; use e.g. --device 0.")
    return torch.device(f"cuda:{_gpu_indices(spec)[0]}")


def _parse(spec: str) -> list[int]:
    """GPU indices of ``spec`` ("0", "cuda:1", "0,1"), not yet checked against the GPUs present."""
    items = [s.strip().removeprefix("cuda:").removeprefix("cuda") or "0" for s in spec.split(",")]
    if not all(s.isdigit() for s in items):
        raise QATError(f"--device '{spec}' is not understood; use cpu, 0, cuda:0, or a list such as 0,1.")
    return [int(s) for s in items]


def _gpu_indices(spec: str) -> list[int]:
    """GPU indices of ``spec``, each checked against the GPUs present."""
    indices = _parse(spec)
    if not torch.cuda.is_available():
        raise QATError(f"--device {spec} asks for a CUDA GPU but none is available here; use --device cpu.")
    count = torch.cuda.device_count()
    for i in indices:
        if i >= count:
            raise QATError(f"--device {spec}: there is no GPU {i} (found {count}); pick indices below that.")
    return indices


def _rank_device(spec: str, launch: Launch) -> torch.device:
    """The device of one process of a torchrun launch (see the module docstring for the mapping)."""
    procs = launch.local_world_size
    if spec == "cpu":
        return torch.device("cpu")  # the gloo backend: how multi-process runs are tested without GPUs
    if spec in ("", "auto"):
        if not torch.cuda.is_available():
            print("notice: no CUDA GPU found; every process runs on the CPU (slow for full-size models).")
            return torch.device("cpu")
        count = torch.cuda.device_count()
        if procs > count:
            raise QATError(f"torch.distributed.run started {procs} processes on this node but it has {count} "
                           f"GPU{'s' if count != 1 else ''}; pass --nproc_per_node {count} (one process per GPU).")
        return torch.device(f"cuda:{launch.local_rank}")
    indices = _parse(spec)
    if len(indices) != procs:
        raise QATError(f"--device {spec} lists {len(indices)} GPU{'s' if len(indices) != 1 else ''} but "
                       f"torch.distributed.run started {procs} processes on this node; pass --nproc_per_node "
                       f"{len(indices)} (one process per listed GPU).")
    if len(set(indices)) != len(indices):
        raise QATError(f"--device {spec} lists a GPU twice; list each GPU once (one process per GPU).")
    # Narrow the visible GPUs before anything starts CUDA (torch.cuda.is_available() does: cuInit reads
    # CUDA_VISIBLE_DEVICES once; importing modelopt does too, so qat.py selects the device before importing
    # it). Indices are the user's view, i.e. positions in their own CUDA_VISIBLE_DEVICES.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [s.strip() for s in visible.split(",")] if visible else None
    if physical is not None and max(indices) >= len(physical):
        raise QATError(f"--device {spec}: there is no GPU {max(indices)} (CUDA_VISIBLE_DEVICES={visible} shows "
                       f"{len(physical)}); pick indices below that.")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] if physical else str(i) for i in indices)
    # The CUDA runtime's own count (torch.cuda.device_count() asks NVML, which reads the variable anew): more
    # GPUs than listed means CUDA started before the narrowing, and every rank would not get its listed GPU.
    found = torch._C._cuda_getDeviceCount() if torch.cuda._is_compiled() else 0
    if found > len(indices):
        raise RuntimeError("CUDA started before select_device could narrow CUDA_VISIBLE_DEVICES; something imported "
                           "earlier (modelopt does) initialised it: select the device first")
    if found == 0:
        raise QATError(f"--device {spec} asks for CUDA GPUs but none of them is available here; use --device cpu.")
    if found < len(indices):
        raise QATError(f"--device {spec}: only {found} of the {len(indices)} listed GPUs exist here; list indices "
                       "that `nvidia-smi -L` shows.")
    return torch.device(f"cuda:{launch.local_rank}")


#: /proc/cpuinfo flags of the x86 instructions that add 8-bit products straight into 32-bit sums (VNNI, AMX).
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_description() -> tuple[str, set[str] | None]:
    """The CPU's model name and its /proc/cpuinfo flags (None without /proc/cpuinfo: not Linux)."""
    model, flags = platform.processor() or platform.machine(), None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            model = value.strip()
        elif key.strip() == "flags" and flags is None:
            flags = set(value.split())
    return model, flags


def exact_int8_dot() -> bool | None:
    """Whether this x86 CPU computes 8-bit dot products exactly: True with VNNI or AMX (:data:`INT8_DOT_FLAGS`);
    False on the others (AVX2, AVX-512 without VNNI), whose 8-bit multiply (vpmaddubsw) adds each pair of
    products into a 16-bit sum that saturates; None where unknown (not x86, or no /proc/cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return None
    flags = cpu_description()[1]
    return None if flags is None else any(f in flags for f in INT8_DOT_FLAGS)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> bool:
    """Have glibc keep the memory PyTorch frees on the CPU for its next tensors, instead of handing every large
    block back to the kernel; returns whether it was set (False off glibc: macOS, musl, Windows).

    PyTorch's CPU allocator is malloc. glibc maps each block above 32 MiB (a YOLOv9 activation of a batch of 16 at
    640 px is 26-105 MiB) with its own mmap and unmaps it when freed, so the next tensor of that size page-faults
    in all its pages afresh: on 2 cores, ``x.abs()`` of such an activation took 86 ms, 6 ms with the memory kept,
    and page faults were a third of a CPU calibration's time. Blocks then come from the heap (no mmap) and freed
    memory stays there up to 2 GiB above the top (no trim): the process keeps its peak, the arithmetic is unchanged.
    The same as ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647``, or the caching allocators (jemalloc,
    tcmalloc) PyTorch's CPU tuning guide recommends, without an environment to set."""
    name = ctypes.util.find_library("c")
    if platform.system() != "Linux" or not name or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1))
