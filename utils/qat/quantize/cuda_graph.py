"""The forward and backward half of a QAT step recorded once as a CUDA graph, then replayed.

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
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import torch

from utils.qat.core import distributed

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
        """Warm up, record one forward and backward on a copy of ``images`` (recording runs nothing), replay it.

        Python's garbage collector stays off while recording: a collection then may free CUDA or pinned memory
        of earlier work (a data loader's abandoned iterator, say), and freeing memory is one of the calls a
        recording forbids. What is garbage already is collected first."""
        for _ in range(self.warmup):
            self.eager(images)
        self.zero_grad(True)  # the backward being recorded creates the .grad tensors that every replay writes
        static = images.clone()
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                values = self.forward_backward(static)
        except RuntimeError as e:
            self.failed = _first_cause(e)
        finally:
            if collecting:
                gc.enable()
        if self.failed is not None:
            return self._after_failure(graph, images)
        self.graph, self.static_images, self.static_values = graph, static, values
        if distributed.is_main():
            print(f"QAT: the steps' forward and backward now replay a CUDA graph (recorded in "
                  f"{time.perf_counter() - start:.1f} s; --no-cuda-graph keeps every step eager)", flush=True)
        graph.replay()
        self.replays += 1
        return values

    def _after_failure(self, graph: torch.cuda.CUDAGraph, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """Say why once, free what the recording held, and run this step eagerly (as every later one)."""
        if distributed.is_main():
            print(f"QAT: the step could not be recorded as a CUDA graph ({self.failed}); every step runs eagerly, "
                  f"as with --no-cuda-graph", flush=True)
        del graph
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return self.eager(images)

    def close(self) -> None:
        """Release the graph and its memory pool."""
        self.graph, self.static_images, self.static_values = None, None, {}


def _first_cause(error: BaseException) -> str:
    """The first line of the error that started it all (ending a failed recording raises a second one)."""
    while isinstance(error.__context__, RuntimeError):
        error = error.__context__
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
