"""QAT: fine-tune a calibrated (fake-quantized) model against its frozen FP teacher.

    results = finetune(qmodel, teacher, batches, QATConfig(epochs=10, iters=200), device="cuda:0")

``batches()`` returns a fresh iterable per epoch of image tensors (float, [0, 1], on any device) or of
``(images, targets[, masks])`` tuples from upstream's dataloader (the ``task`` objective needs the labels).
What is minimised is ``QATConfig.objective`` (``utils/qat/quantize/objectives.py``). Every epoch makes exactly
``iters`` optimisation steps: a training set with fewer batches is read again (and the log says so).
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from utils.qat.quantize import objectives
from utils.qat.quantize.cuda_graph import StepGraph
from utils.qat.core import distributed, timing
from utils.qat.core.errors import QATError
from utils.qat.core.progress import progress

OPTIMIZERS = ("adamw", "adam", "sgd")


POSTFIX_EVERY = 10  # steps between the progress bar's loss updates (each one reads the loss back from the GPU)


@dataclass
class QATConfig:
    """How fine-tuning runs. The defaults are the recipe measured best (docs/QAT_FINETUNING.md:
    ``benchmarks/qat_recipes.py``, removed, in commit 1392fea, and ``benchmarks/reference.py`` on GELAN-C and GELAN-S,
    with upstream's augmentation: ``qat.py``'s ``--hyp`` default for detection)."""
    epochs: int = 5
    iters: int = 100  # optimisation steps per epoch
    lr: float = 3e-5
    objective: str = objectives.DEFAULT_OBJECTIVE
    optimizer: str = "adamw"
    weight_decay: float = 0.0  # on conv weights only (not biases)
    warmup: int = 50  # steps of linear warm-up from 0 to lr; then cosine decay to lr * final_lr_ratio
    final_lr_ratio: float = 0.01
    supervision_stride: int = 1  # ``features`` / ``mse``: every N-th block output (plus the last)
    ema: float = 0.99  # decay of an exponential moving average of the weights (0: off); evaluated and kept
    # how the average starts (EMA_RAMPS): "fast", decay (1 + n) / (10 + n) after n steps, which stays under 0.99
    # for 890 steps (about the last 1/9 of the steps so far); "uniform", n / (n + 1), the plain mean of every
    # step so far until it spans 1 / (1 - ema) steps
    ema_ramp: str = "fast"
    amax_lr: float = 1e-3  # learn activation amax (LSQ) at this rate relative to each amax; 0: calibrated amax kept
    bias_lr: float = 1.0  # the biases' learning rate is lr times this
    box_gain: float = 1.0  # weight of the head objective's box term (head.box)
    # weight of its masks term (head.masks: segmentation heads only; docs/QAT_FINETUNING.md "The shapes models to the
    # end, and the mask term's weight")
    mask_gain: float = 5.0
    # on CUDA, replay each step's forward and backward from a CUDA graph (utils/qat/quantize/cuda_graph.py says
    # when it stays eager); the results are the eager step's, bit for bit
    cuda_graph: bool = True


@dataclass
class EpochResult:
    epoch: int
    loss: float
    seconds: float
    terms: dict[str, float] = field(default_factory=dict)  # each objective term, mean over the epoch
    steps: int = 0
    amax: dict[str, float] = field(default_factory=dict)  # learned amax: how far it moved from calibration
    graph_steps: int = 0  # steps whose forward and backward ran as a CUDA graph
    # why the epoch ended before its ``iters`` steps (a loss that was not finite: fine-tuning ends with it), else None
    stopped: str | None = None


def supervised_layers(model: nn.Module, stride: int) -> list[int]:
    """Indices of ``model.model`` whose outputs are matched: every ``stride``-th block plus the last."""
    n = len(model.model)
    stride = max(1, int(stride))
    return sorted(set(range(0, n, stride)) | {n - 1})


class _Taps:
    """Captures the outputs of chosen layers during a forward pass."""

    def __init__(self, model: nn.Module, indices: Sequence[int]):
        from utils.qat.quantize.rules import flat_tensors
        self.outputs: dict[int, list[torch.Tensor]] = {}
        self.flat_tensors = flat_tensors
        self.hooks = [model.model[i].register_forward_hook(self._hook(i)) for i in indices]

    def _hook(self, i):
        def hook(module, args, output):
            self.outputs[i] = self.flat_tensors(output)
        return hook

    def close(self):
        for h in self.hooks:
            h.remove()


def _unpack(batch, device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True), None, None
    images, targets, *rest = batch
    masks = rest[0] if rest else None
    return (images.to(device, non_blocking=True), targets.to(device) if targets is not None else None,
            masks.to(device) if masks is not None else None)


def _steps(batches: Callable[[], Iterable], iters: int, announce: bool) -> Iterator:
    """Exactly ``iters`` batches, reading ``batches()`` again whenever it runs out."""
    done = 0
    while True:
        got = 0
        for batch in batches():
            yield batch
            got += 1
            done += 1
            if done >= iters:
                return
        if got == 0:
            raise QATError("the QAT training set gave no batches; check the 'train' entry of the dataset yaml.")
        if announce and done == got and distributed.is_main():
            print(f"QAT: the training set gives {got} batches an epoch; reading it again to make "
                  f"{iters} steps (--iters) per epoch", flush=True)


def _optimizer(params: list[nn.Parameter], config: QATConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimiser over ``params`` (biases and other 1-d parameters without weight decay, at ``bias_lr``).

    On CUDA it is torch's fused implementation: one kernel per parameter group, and with a ``GradScaler`` it
    skips a step whose gradients overflowed on the GPU itself, where the multi-tensor one makes the scaler read
    the overflow flag back to the CPU every step (the CPU then waits for the step's GPU work before it can launch
    the next). The learned amax add a parameter group each (``amax.LearnedAmax.param_groups``; about 190 groups
    on YOLOv9-t), whose launches no longer sit behind that wait (its step 0.094 s -> 0.058-0.069 s on an H100:
    benchmarks/results/yolov9-t-coco-fused-h100-logs/)."""
    if config.optimizer not in OPTIMIZERS:
        raise QATError(f"--optimizer {config.optimizer} is not supported; choose one of {', '.join(OPTIMIZERS)}.")
    decay = [p for p in params if p.dim() > 1]
    no_decay = [p for p in params if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0, "lr": config.lr * config.bias_lr}]
    fused = {"fused": True} if device.type == "cuda" else {}
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=0.9, nesterov=True, **fused)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=config.lr, **fused)


def lr_factor(step: int, total: int, warmup: int, final_ratio: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from 1 to ``final_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress_ = min(step - warmup, span) / span
    return final_ratio + (1 - final_ratio) * 0.5 * (1 + math.cos(math.pi * progress_))


def finetune(model: nn.Module, teacher: nn.Module, batches: Callable[[], Iterable], config: QATConfig | None = None, *,
             device: torch.device | str = "cpu", amp: bool | None = None, hyp: dict | None = None,
             on_epoch_start: Callable[[int], None] | None = None,
             on_epoch_end: Callable[[EpochResult], None] | None = None,
             scale_groups: list[list[str]] | None = None,
             on_step: Callable[[int], None] | None = None,
             until: Callable[[], bool] | None = None) -> list[EpochResult]:
    """Fine-tune the fake-quantized ``model`` towards ``teacher`` (and/or the labels) per ``config``.

    Optimiser over every trainable parameter, and with ``config.amax_lr`` the activation amax too
    (``utils/qat/quantize/amax.py``; ``scale_groups``: the calibration's shared-scale groups, traced on the first
    batch when not given); linear warm-up then cosine decay, AMP on CUDA by default. ``hyp``: upstream hyp yaml
    values for the ``task`` objective's loss gains. ``on_epoch_start(epoch)`` runs before every epoch (e.g. a
    sampler's ``set_epoch``), ``on_epoch_end`` after every epoch (evaluate, save), ``on_step(step)`` after every
    optimisation step, counted over all epochs (``benchmarks/cost.py`` times the steps with it). ``until()`` runs on
    every rank after ``on_epoch_end``, with the evaluated weights in place; True ends fine-tuning there (the
    accuracy budget stops when its held-out score stops improving: ``utils/qat/run/budget.py``).

    A loss that is not finite ends the epoch at once, without an optimisation step on it, and ends fine-tuning after
    that epoch's ``on_epoch_end`` (its ``EpochResult.stopped`` says so; the weights are those of the last finite
    step). Where a ``GradScaler`` runs (AMP on CUDA) it already skips the step of a non-finite gradient, and the loss
    is read only with the progress bar's (every :data:`POSTFIX_EVERY` steps): the epoch ends there. In a multi-GPU
    run the ranks decide together.

    In a multi-GPU run (process group joined) every rank calls this with its own shard of each global batch
    and its own copy of the teacher. The student is wrapped in DistributedDataParallel, which averages the
    ranks' gradients: each rank's loss is a mean over its equal share of the batch, so a step is the
    one-process step on the global batch. The loss reported is the mean over the ranks; ``on_epoch_end``
    runs on rank 0 only while the other ranks wait at a barrier.
    """
    config = config or QATConfig()
    step = QATStep(model, teacher, batches, config, device=device, amp=amp, hyp=hyp, scale_groups=scale_groups)
    results = []
    try:
        for epoch in range(config.epochs):
            if on_epoch_start is not None:
                on_epoch_start(epoch)
            step.train()
            start, steps, replays = time.time(), 0, step.graph_steps
            sums: dict[str, torch.Tensor] = {}  # summed on the device: reading a loss each step would wait for the GPU
            stopped = None
            bar = progress(_steps(batches, config.iters, announce=epoch == 0), total=config.iters,
                           desc=f"QAT epoch {epoch + 1}/{config.epochs}")
            for batch in bar:
                values = step(batch)
                if step.not_finite:  # no step was taken on it
                    stopped = f"the loss was not finite at step {steps + 1} of {config.iters}"
                    break
                for k, v in values.items():
                    sums[k] = sums[k] + v.detach() if k in sums else v.detach().clone()
                steps += 1
                if steps % POSTFIX_EVERY == 0 or steps == config.iters:
                    loss = float(sum(sums.values())) / steps
                    if not step.guarded and _any_rank(not math.isfinite(loss)):
                        stopped = f"the loss was not finite by step {steps} of {config.iters}"
                        break
                    bar.set_postfix(loss=f"{loss:.5f}")
                if on_step is not None:
                    on_step(epoch * config.iters + steps - 1)
            totals = {k: float(v) for k, v in sums.items()}
            means = {k: round(distributed.all_reduce_mean(v / max(steps, 1)), 6) for k, v in totals.items()}
            learned = step.learned
            loss = distributed.all_reduce_mean(sum(totals.values()) / steps) if steps else math.nan
            result = EpochResult(epoch, loss, time.time() - start,
                                 terms=means, steps=steps, amax=learned.summary() if learned is not None else {},
                                 graph_steps=step.graph_steps - replays, stopped=stopped)
            results.append(result)
            timing.add(f"training epoch {epoch + 1}", result.seconds)
            model.eval()
            teacher.eval()
            with (step.ema.applied(model) if step.ema is not None else contextlib.nullcontext(),
                  learned.as_buffers() if learned is not None else contextlib.nullcontext()):
                if on_epoch_end is not None and distributed.is_main():
                    on_epoch_end(result)
                distributed.barrier()
                if stopped is not None or (until is not None and until()):
                    break
    finally:
        step.close()
    return results


class QATStep:
    """One optimisation step of fine-tuning, with everything it needs built once (optimiser, schedule, scaler,
    learned amax, EMA, taps): ``finetune`` loops over it, ``benchmarks/cost.py --mode step`` times it.

        step = QATStep(qmodel, teacher, batches, QATConfig(), device="cuda:0")
        step.train()
        values = step(batch)      # each objective term; the loss is their sum
        step.close()              # the model averaged (EMA), amax buffers again, evaluation mode
    """

    def __init__(self, model: nn.Module, teacher: nn.Module, batches: Callable[[], Iterable], config: QATConfig, *,
                 device: torch.device | str = "cpu", amp: bool | None = None, hyp: dict | None = None,
                 scale_groups: list[list[str]] | None = None):
        self.model, self.config = model, config
        self.terms = objectives.parse(config.objective)
        self.gains = {"box": config.box_gain, "masks": config.mask_gain}  # weights of the head objective's terms (cls: 1)
        self.device = device = torch.device(device)
        amp = device.type == "cuda" if amp is None else amp
        self.teacher = teacher = teacher.to(device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        model.to(device)
        self.head = objectives.head_of(model)
        self.train_form = "mse" not in self.terms  # raw head maps (training form); the legacy objective used decoded boxes
        supervised = supervised_layers(model, config.supervision_stride)
        self.tapped: list[int] = []  # block outputs the objective reads: the head's too for mse, not for features
        if "mse" in self.terms:
            self.tapped = supervised
        elif "features" in self.terms:
            self.tapped = [i for i in supervised if i != len(model.model) - 1]
        self.task = objectives.task_loss_fn(model, hyp) if "task" in self.terms else None
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer = _optimizer(params, config, device)
        self.learned = None
        if config.amax_lr > 0:
            from utils.qat.quantize.amax import LearnedAmax
            if scale_groups is None:
                from utils.qat.quantize.rules import scale_groups as trace_groups
                example = _unpack(next(iter(batches())), device)[0][:1]
                scale_groups = trace_groups(model, example.float() / 255 if example.dtype == torch.uint8 else example)
            self.learned = LearnedAmax(model, scale_groups)
            for group in self.learned.param_groups(config.amax_lr):
                optimizer.add_param_group(group)
        total = max(1, config.epochs * config.iters)
        warmup = min(config.warmup, total // 2)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total, warmup, config.final_lr_ratio))
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp)
        # no cast cache: a CUDA graph cannot record it (the casts it saves are of the teacher's weights, once a step)
        self.autocast = ((lambda: torch.autocast(device.type, dtype=torch.float16, cache_enabled=False)) if amp
                         else contextlib.nullcontext)
        self.student = _distributed(model, device, every_parameter_used="features" not in self.terms or len(self.terms) > 1)
        self.ema = _EMA(model, config.ema, config.ema_ramp) if config.ema > 0 else None
        self.student_taps, self.teacher_taps = _Taps(model, self.tapped), _Taps(teacher, self.tapped)
        # without a GradScaler (the CPU, or CUDA without AMP) nothing else would keep a step off a non-finite loss:
        # each step's loss is checked before the optimiser steps (on the CPU it costs nothing)
        self.guarded, self.not_finite = not self.scaler.is_enabled(), False
        self.graph: StepGraph | None = None
        if config.cuda_graph and device.type == "cuda" and not distributed.active() and self.task is None:
            self.graph = StepGraph(lambda images: self._forward_backward(images, None, None),
                                   lambda none: optimizer.zero_grad(set_to_none=none))

    def train(self) -> None:
        """The student and the teacher in the form the objective compares (training form unless ``mse``)."""
        self.model.train(self.train_form)
        self.teacher.train(self.train_form)

    @property
    def graph_steps(self) -> int:
        """Steps so far whose forward and backward were replayed from the CUDA graph."""
        return self.graph.replays if self.graph is not None else 0

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        """One optimisation step on ``batch``; returns each objective term (tensors, not synchronised; those of a
        replayed step are overwritten by the next one)."""
        images, targets, masks = _unpack(batch, self.device)
        if self.graph is not None:  # replayed, or eager with the graph's gradient tensors kept (a short batch)
            values = self.graph(images) if self.graph.serves(images) else self.graph.eager(images)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            values = self._forward_backward(images, targets, masks)
        if self.guarded and _any_rank(not bool(torch.isfinite(sum(v.detach() for v in values.values())))):
            self.not_finite = True  # no step: the weights stay those of the last finite one
            self.optimizer.zero_grad(set_to_none=self.graph is None)
            return values
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.schedule.step()
        if self.learned is not None:
            self.learned.clamp()
        if self.ema is not None:
            self.ema.update(self.model)
        return values

    def _forward_backward(self, images: torch.Tensor, targets: torch.Tensor | None,
                          masks: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """Teacher and student forward, the objective, and its scaled backward (gradients left in ``.grad``)."""
        if images.dtype == torch.uint8:
            images = images.float() / 255
        with torch.no_grad(), self.autocast():
            t_out = self.teacher(images)
        with self.autocast():
            s_out = self.student(images)
        values = {}
        for term in self.terms:
            if term == "head":
                parts = objectives.head_distillation(s_out, t_out, self.head.reg_max, self.head.nc)
                values.update({f"head.{k}": v * self.gains.get(k, 1.0) for k, v in parts.items()})
            elif term == "features":
                values[term] = objectives.feature_distillation(self.student_taps.outputs, self.teacher_taps.outputs,
                                                               self.tapped)
            elif term == "mse":
                values[term] = objectives.legacy_mse(self.student_taps.outputs, self.teacher_taps.outputs, self.tapped)
            else:
                if targets is None:
                    raise QATError("--qat-loss task needs labels: pass batches of (images, targets).")
                values[term] = self.task(s_out, targets, masks)
        loss = sum(values.values())
        self.scaler.scale(loss).backward()
        return values

    def close(self) -> None:
        """Taps removed, evaluation mode, the averaged weights in the model, amax buffers again."""
        if self.graph is not None:
            self.graph.close()
        self.student_taps.close()
        self.teacher_taps.close()
        self.model.eval()
        self.teacher.eval()
        if self.ema is not None:
            self.ema.copy_to(self.model)  # the model handed back is the averaged one, as evaluated
        if self.learned is not None:
            self.learned.release()


def _any_rank(flag: bool) -> bool:
    """``flag`` on any rank (a collective in a multi-GPU run, so that every rank takes the same branch)."""
    return distributed.all_reduce_mean(float(flag)) > 0 if distributed.active() else flag


EMA_RAMPS = {"fast": lambda n: (1 + n) / (10 + n), "uniform": lambda n: n / (n + 1)}


class _EMA:
    """Exponential moving average of the trainable parameters (upstream's ModelEMA idea, for fine-tuning):
    the decay after n updates is ``min(decay, ramp(n))`` (:data:`EMA_RAMPS`). Quantizer amax and other
    buffers are not averaged (they do not change during QAT)."""

    def __init__(self, model: nn.Module, decay: float, ramp: str = "fast"):
        self.decay, self.updates, self.ramp = decay, 0, EMA_RAMPS[ramp]
        self.params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        self._pairs: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Multi-tensor operations over all parameters (a few kernels in all, not two per parameter); the same
        arithmetic as ``mul_(d).add_(p, alpha=1 - d)`` per parameter."""
        self.updates += 1
        d = min(self.decay, self.ramp(self.updates))
        if self._pairs is None:  # the model's parameter objects are fixed during fine-tuning
            named = dict(model.named_parameters())
            self._pairs = list(self.params.values()), [named[n].detach() for n in self.params]
        averaged, current = self._pairs
        torch._foreach_mul_(averaged, d)
        torch._foreach_add_(averaged, current, alpha=1 - d)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        for n, p in model.named_parameters():
            if n in self.params:
                p.copy_(self.params[n])

    @contextlib.contextmanager
    def applied(self, model: nn.Module):
        """The averaged parameters in ``model`` inside the block (evaluate, save), the trained ones after."""
        trained = {n: p.detach().clone() for n, p in model.named_parameters() if n in self.params}
        self.copy_to(model)
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n in trained:
                        p.copy_(trained[n])


def _distributed(model: nn.Module, device: torch.device, every_parameter_used: bool = True) -> nn.Module:
    """``model`` wrapped in DistributedDataParallel in a multi-GPU run, else ``model`` itself.

    Hooks stay on ``model``'s layers (DDP calls its forward). Buffers are not re-broadcast every step: the
    only ones are the quantizers' amax (fixed during QAT, identical on every rank after calibration) and
    the head's anchors and strides. With an objective on the head every trainable parameter reaches the
    loss, so DDP needs no unused-parameter search; ``features`` alone leaves the head's convs out of it.
    """
    if not distributed.active():
        return model
    import inspect

    from torch.nn.parallel import DistributedDataParallel
    # torch >= 2.14 names it forward_sync_buffers (buffers still synced once, at construction)
    no_sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                   find_unused_parameters=not every_parameter_used, **{no_sync: False})
