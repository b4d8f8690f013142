"""The forward and backward half of a QAT step recorded once as a CUDA graph, then replayed; and a value computed
from tensors that stay in place (the amax search's loss), the same way.

A QAT step on a GPU waits on the CPU: the Python of a few hundred modelopt quantizers and several thousand
kernel launches (teacher forward, student forward, objective, backward) take longer to issue than the GPU
takes to run them. A CUDA graph records those kernels once, with their memory, and replays them all with one
launch. The optimiser, the loss scaler, the learned-amax clamp and the EMA run eagerly after each replay (a few
multi-tensor kernels; the scaler reads back whether the gradients overflowed), exactly as in an eager step.
A replay runs the kernels the eager step ran, on the same values: the same results bit for bit
(``tests/test_cuda_graph.py``, on a GPU).

    graph = StepGraph(forward_backward, zero_grad)
    if graph.serves(images):
        values = graph(images)          # recorded at the first call, replayed at every one
    else:
        values = graph.eager(images)    # a batch of another shape

What stays eager (``QATStep`` decides): the CPU; a multi-GPU run (DistributedDataParallel all-reduces from
hooks as gradients become ready); the ``task`` objective (its targets change shape every batch); a batch
of another shape than the recorded one (an epoch's short last batch); and a run with ``--no-cuda-graph``.
Recording that fails (an operation that cannot be recorded, e.g. a custom layer reading a value back to the
CPU) says so once and leaves the step eager.

Before recording, the forward and backward run ``WARMUP`` times eagerly on the first batch, their gradients
thrown away (Triton kernels compiled, cuDNN and the loss scale set up: nothing may be created while recording);
no parameter moves, so every step of the run, the first included, is the replayed one. What the recording holds
fixed, so what must stay in place between replays: the parameters and learned amax (the optimiser updates them
in place), their ``.grad`` tensors (written by each replay: never set them to None), the loss scale (a tensor the
scaler updates in place) and the input buffer (each batch is copied in).

``ValueGraph`` serves the amax search (``utils/qat/quantize/head.py``), which scores hundreds of candidate scales by
running the quantized network over the same few batches: on an H100 a candidate's YOLOv9-t forward issued 136 ms of
launches for 10 ms of GPU work. The search changes amax in place (modelopt's setter copies into its buffer, which
the fake-quant kernels read), so the recording replays each candidate with one launch: the search of YOLOv9-t's
layers 0-5 went from 93.4 s to 13.8 s on the H100, with the same choices.

    means = ValueGraph(lambda: torch.stack([images.mean() for images in batches]), cuda=True, name="amax search")
    values = means()   # a list of floats: eager at the first call (and recorded then), replayed after
    means.reset()      # what it reads was replaced: record again at the next call
"""
from __future__ import annotations

import gc
import time
from typing import Callable, TypeVar

import torch

from utils.qat.core import distributed

T = TypeVar("T")
WARMUP = 2  # eager forward and backward passes before recording (their gradients are discarded)


class StepGraph:
    """``forward_backward(images) -> values`` (the step's objective terms, gradients left in ``.grad``) replayed
    from a CUDA graph recorded at the first call. ``zero_grad(set_to_none)`` clears the gradients."""

    def __init__(self, forward_backward: Callable[[torch.Tensor], dict[str, torch.Tensor]],
                 zero_grad: Callable[[bool], None], warmup: int = WARMUP):
        self.forward_backward, self.zero_grad, self.warmup = forward_backward, zero_grad, warmup
        self.replays = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.failed: str | None = None
        self.shape: tuple | None = None  # of the first batch: an epoch's full batches (the last may be short)
        self.static_images: torch.Tensor | None = None
        self.static_values: dict[str, torch.Tensor] = {}

    def serves(self, images: torch.Tensor) -> bool:
        """Whether this batch runs through the graph (recorded or still to be): a CUDA batch of the first batch's
        shape, dtype and device, while recording has not failed."""
        if self.failed is not None or images.device.type != "cuda":
            return False
        key = (tuple(images.shape), images.dtype, images.device)
        self.shape = self.shape or key
        return key == self.shape

    @property
    def recorded(self) -> bool:
        return self.graph is not None

    def eager(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """One eager forward and backward. Once a graph is recorded its gradient tensors are zeroed in place
        rather than dropped: the graph writes into them."""
        self.zero_grad(not self.recorded)
        return self.forward_backward(images)

    def __call__(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.graph is None:
            return self._record(images)
        assert self.static_images is not None
        self.static_images.copy_(images, non_blocking=True)
        self.graph.replay()
        self.replays += 1
        return self.static_values

    def _record(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Warm up, record one forward and backward on a copy of ``images`` (recording runs nothing), replay it."""
        for _ in range(self.warmup):
            self.eager(images)
        self.zero_grad(True)  # the backward being recorded creates the .grad tensors that every replay writes
        static = images.clone()
        start = time.perf_counter()
        graph, values, self.failed = _record(lambda: self.forward_backward(static))
        if graph is None or values is None:
            if distributed.is_main():
                print(f"QAT: the step could not be recorded as a CUDA graph ({self.failed}); every step runs "
                      f"eagerly, as with --no-cuda-graph", flush=True)
            return self.eager(images)
        self.graph, self.static_images, self.static_values = graph, static, values
        if distributed.is_main():
            print(f"QAT: the steps' forward and backward now replay a CUDA graph (recorded in "
                  f"{time.perf_counter() - start:.1f} s; --no-cuda-graph keeps every step eager)", flush=True)
        graph.replay()
        self.replays += 1
        return values

    def close(self) -> None:
        """Release the graph and its memory pool."""
        self.graph, self.static_images, self.static_values = None, None, {}


class ValueGraph:
    """``compute() -> tensor``, whose inputs stay where they are between calls, as a list of floats: run eagerly
    at the first call, recorded then (on CUDA), replayed at every later call until ``reset``. Where recording
    fails it says why once and every call runs eagerly."""

    def __init__(self, compute: Callable[[], torch.Tensor], cuda: bool, name: str):
        self.compute, self.cuda, self.name = compute, cuda, name
        self.graph: torch.cuda.CUDAGraph | None = None
        self.output: torch.Tensor | None = None
        self.failed: str | None = None
        self.replays = 0

    def reset(self) -> None:
        """Drop the recording: what ``compute`` reads has been replaced."""
        self.graph = self.output = None

    def __call__(self) -> list[float]:
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            assert self.output is not None
            return self.output.tolist()
        values = self.compute().tolist()  # also the warm-up: kernels compiled, cuDNN set up before recording
        if self.cuda and self.failed is None:
            self._record()
        return values

    def _record(self) -> None:
        self.graph, self.output, self.failed = _record(self.compute)
        if self.graph is None:
            print(f"{self.name}: the computation could not be recorded as a CUDA graph ({self.failed}); it runs "
                  "eagerly", flush=True)


def _record(fn: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph | None, T | None, str | None]:
    """``fn()`` recorded as a CUDA graph (recording runs nothing): ``(graph, what fn returned, None)``, or
    ``(None, None, why)`` where recording failed, the memory it held freed.

    Python's garbage collector stays off while recording: a collection then may free CUDA or pinned memory of
    earlier work (a data loader's abandoned iterator, say), and freeing memory is one of the calls a recording
    forbids. What is garbage already is collected first."""
    graph = torch.cuda.CUDAGraph()
    failed = None
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            output = fn()
    except RuntimeError as e:
        failed = _first_cause(e)
    finally:
        if collecting:
            gc.enable()
    if failed is None:
        return graph, output, None
    del graph
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return None, None, failed


def _first_cause(error: BaseException) -> str:
    """The first line of the error that started it all (ending a failed recording raises a second one)."""
    while isinstance(error.__context__, RuntimeError):
        error = error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
