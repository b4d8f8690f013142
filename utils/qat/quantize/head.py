"""Activation scales chosen by the head's output error: the detect head's (``--head-amax search``) and, with
``--search-layers``, those of chosen body layers.

    result = search_head_amax(qmodel, batches, groups)                # after calibration, a few calibration batches
    result = search_head_amax(qmodel, batches, groups, layers=(2, 3))  # layers 2 and 3 first, then the head

Calibration gives every activation quantizer the amax that minimises that tensor's own error. On GELAN-C
the head's input quantizers carry about three quarters of the INT8 loss (docs/QAT_FINETUNING.md "Where the INT8 loss sits, and the evaluation with TF32 off"), and
what matters there is the error of the head's outputs, not of its inputs. This search keeps the network
before the head as calibrated, runs it once per batch (quantized, and with every quantizer off: the FP
reference), and then tries multiples of each head input quantizer's amax in turn (coordinate descent in
module order), keeping the one with the lowest ``head`` distillation loss (``utils/qat/quantize/objectives.py``:
class and box-distribution divergence from the FP head, on its raw training-form maps). Only the head is
re-run per candidate, so the search costs a few hundred head evaluations.

A quantizer whose shared-scale group reaches outside the head (a head input that is also the input of a
body layer with a tied scale) keeps its calibrated amax: changing it would change the body too.

Body layers (``layers``: indices of ``model.model``) are searched the same way before the head, in module order,
each candidate scored by the whole network's run to the same loss (the FP head's outputs cached once), with wider
multiples (:data:`BODY_FACTORS`): calibration picks each scale by the error of its own tensor, and on a small
model trained on COCO (YOLOv9-t) the mse scales of the early layers clip tails that the detections need
(docs/QAT_RECIPE.md "A real COCO model: YOLOv9-t").

Off the GPU a head candidate runs only what it changes (:class:`_Branches`): every other per-level branch of the
head (``cv2.0``, ``cv3.1``, ...) gives the output it gave with the scales as chosen so far, kept from one run, and
the changed branch runs only from its first layer that holds the candidate's scale, from the input that layer was
given. The loss (``HeadDistillation``) keeps the teacher's terms and each level's class and box terms, and
recomputes only the part whose map changed. A candidate costs a layer or two of one branch instead of the whole head
(on the embedded model, about a seventh of the whole-head path's convolutions), and the loss is the same in every
bit. ``tests/test_quantize_head.py`` counts the convolutions each path runs.

``bounded`` (``--search-cost bounded``, the CPU's default) caps the number of forward passes: each unit walks away
from its calibrated scale, one factor at a time and upwards first, while the loss falls, instead of trying every
factor (two or three candidates instead of eight), and a body candidate is scored on the first calibration batch
only. On yolov9-t-coco (2 CPU cores) it took the head search from 26 s to 10 s, and the PTQ checkpoint scored 0.3996
against 0.4001 with the full search (docs/QAT_CALIBRATION.md "Calibrating on a CPU").
``tests/test_quantize_head.py`` counts the forward passes each way.

On a GPU each candidate's run is replayed from a CUDA graph (``ValueGraph``, ``utils/qat/quantize/cuda_graph.py``),
recorded again whenever the body search moves on to a later layer: the same losses, in every bit, as running it
eagerly, for a fraction of the CPU time.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from utils.qat.core.errors import QATError
from utils.qat.quantize.cuda_graph import ValueGraph
from utils.qat.quantize.rules import input_quantizers
from utils.qat.quantize.state import enabled_quantizers, quantizers_off, weights_quantized
from utils.qat.core.progress import progress

FACTORS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)
BODY_FACTORS = (0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0)
SEARCH_BATCHES = 4
BOUNDED_BODY_BATCHES = 1  # with ``bounded``: the calibration batches a body candidate is scored on


class _HeadInputs:
    """Captures what the head is called with (its list of feature maps), and then stops the forward pass."""

    class Stop(Exception):
        pass

    def __init__(self, head: nn.Module):
        self.head, self.inputs = head, None

    def __call__(self, module, args):
        self.inputs = [t.detach() for t in args[0]]
        raise self.Stop

    def run(self, model: nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
        hook = self.head.register_forward_pre_hook(self)
        try:
            with contextlib.suppress(self.Stop):
                model(images)
        finally:
            hook.remove()
        assert self.inputs is not None
        return self.inputs


@contextlib.contextmanager
def recording_head_inputs(model: nn.Module, count: int) -> Iterator[list[list[torch.Tensor]]]:
    """Inside the block, what the detect head is called with (its list of feature maps) in the model's first
    ``count`` forward passes is appended to the list yielded: calibration's pass, whose quantizers only collect,
    gives the FP head inputs the search's targets are made from (:func:`search_head_amax`'s ``fp_inputs``)."""
    kept: list[list[torch.Tensor]] = []
    if count <= 0:
        yield kept
        return

    def keep(module, args) -> None:
        if len(kept) < count:
            kept.append([t.detach() for t in args[0]])
    hook = model.model[-1].register_forward_pre_hook(keep)
    try:
        yield kept
    finally:
        hook.remove()


def searchable(model: nn.Module, groups: Sequence[Sequence[str]], layers: Iterable[int] = (),
               head: bool = True) -> list[list[str]]:
    """The enabled per-tensor input quantizers of ``layers`` (indices of ``model.model``) and, with ``head``, of
    the detect head, as search units (names in ``model``, in module order): a shared-scale group whose members
    are all searched is one unit; a quantizer tied to one outside them is left out."""
    index = len(model.model) - 1
    prefixes = tuple(f"model.{i}." for i in sorted(set(layers) | ({index} if head else set())))
    if not prefixes:
        return []
    names = [n for n, q in input_quantizers(model).items()
             if n.startswith(prefixes) and q.amax is not None and q.amax.numel() == 1]
    grouped = {n: list(g) for g in groups for n in g}
    units, done = [], set()
    for n in names:
        if n in done:
            continue
        unit = grouped.get(n, [n])
        done.update(unit)
        if all(m.startswith(prefixes) for m in unit):
            units.append(unit)
    return units


def span(layers: Iterable[int]) -> str:
    """``0-5,7``: layer indices as ranges, as ``--search-layers`` takes them."""
    runs: list[list[int]] = []
    for i in sorted(set(layers)):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def check_layers(model: nn.Module, layers: Iterable[int]) -> None:
    """``--search-layers`` names layers before the detect head."""
    last = len(model.model) - 1
    wrong = sorted(i for i in layers if not 0 <= i < last)
    if wrong:
        raise QATError(f"--search-layers {span(wrong)}: this model's layers before its detect head "
                       f"are 0-{last - 1}; give indices in that range (the head's scales are --head-amax search).")


def _layer(name: str) -> int:
    """The layer index of a module name in a YOLOv9 model: ``model.4.cv1...`` -> 4."""
    return int(name.split(".")[1])


def _layers(model: nn.Module, x, y: list, start: int, stop: int) -> tuple:
    """Layers ``start`` to ``stop - 1`` of the network, as upstream's ``BaseModel._forward_once`` runs them: from
    its running input ``x`` and the outputs it keeps (``y``: the saved layers' outputs, ``None`` for the others);
    returns both as they stand after layer ``stop - 1`` (``x`` is the model's output when ``stop`` is the end)."""
    y = list(y)
    for m in model.model[start:stop]:
        if m.f != -1:
            x = y[m.f] if isinstance(m.f, int) else [x if j == -1 else y[j] for j in m.f]
        x = m(x)
        y.append(x if m.i in model.save else None)
    return x, y


class _Prefix:
    """The network run from layer ``start`` on: what ``_forward_once`` holds before that layer is kept per batch,
    so a candidate scale of that layer (or a later one) is scored without running the layers before it again,
    which compute the same whatever the candidate is. ``enter`` moves the start to a unit's first layer, running
    the layers in between once with the scales as chosen so far (units come in module order)."""

    def __init__(self, model: nn.Module, batches: list[torch.Tensor]):
        self.model, self.start = model, 0
        self.states: list[tuple] = [(images, []) for images in batches]

    def enter(self, unit: list[str]) -> bool:
        """Start at ``unit``'s first layer; returns whether the start moved (the kept states were replaced)."""
        start = min(_layer(n) for n in unit)
        assert start >= self.start, f"search units out of module order: {unit}"
        if start == self.start:
            return False
        self.states = [_layers(self.model, x, y, self.start, start) for x, y in self.states]
        self.start = start
        return True

    def outputs(self) -> list:
        return [_layers(self.model, x, y, self.start, len(self.model.model))[0] for x, y in self.states]


class _Branches:
    """The head's per-level branches (each element of its ModuleLists: DDetect's ``cv2.0`` ... ``cv3.2``), and what
    each gave for each batch with the scales as chosen so far. While a unit is scored (:meth:`live`), the others
    return what they gave instead of running again: only the branches holding the unit's quantizers run, and within
    a branch that is a sequence of layers (DDetect's ``Conv, Conv, Conv2d``) only the layers from the first one
    holding the unit's quantizers on, from the input that layer was given. The head's output (and its loss) is the
    same in every bit as running it whole, since a layer's output depends only on its own input and scales. A unit
    outside every branch runs the whole head."""

    def __init__(self, detect: nn.Module, prefix: str):
        self.prefix = prefix  # the head's name in the model, with its dot: 'model.22.'
        self.modules = {f"{name}.{j}": m for name, child in detect.named_children()
                        if isinstance(child, nn.ModuleList) for j, m in enumerate(child)}
        self.steps: dict[str, list[list]] = {b: [] for b in self.modules}  # per batch, each layer's input
        self.outputs: dict[str, list] = {b: [] for b in self.modules}
        self.batch = 0
        self.running: dict[str, int] = {}  # the branches that ran for the last unit, from which layer

    def _run(self, branch: str, x, start: int = 0) -> tuple[list, torch.Tensor]:
        """The branch from layer ``start`` on, from that layer's input ``x``: the inputs of its layers from
        ``start`` on, and its output (a branch that is no sequence runs whole)."""
        module = self.modules[branch]
        if not isinstance(module, nn.Sequential):
            return [x], module(x)
        inputs = []
        for layer in list(module)[start:]:
            inputs.append(x)
            x = layer(x)
        return inputs, x

    def record(self, detect: nn.Module, inputs: list[list[torch.Tensor]]) -> None:
        """Run the whole head once per batch (``inputs``: its input per batch), keeping each branch's layers'
        inputs and its output."""
        hooks = []
        for b, m in self.modules.items():
            hooks.append(m.register_forward_pre_hook(functools.partial(self._start, b)))
            hooks.append(m.register_forward_hook(functools.partial(self._keep, b)))
            layers = list(m) if isinstance(m, nn.Sequential) else []
            hooks += [layer.register_forward_pre_hook(functools.partial(self._step, b)) for layer in layers[1:]]
        try:
            for features in inputs:
                detect(list(features))
        finally:
            for h in hooks:
                h.remove()

    def _start(self, branch: str, module, args) -> None:
        self.steps[branch].append([args[0]])

    def _step(self, branch: str, module, args) -> None:
        self.steps[branch][-1].append(args[0])

    def _keep(self, branch: str, module, args, output) -> None:
        self.outputs[branch].append(output)

    def of(self, unit: list[str]) -> dict[str, int] | None:
        """The branches holding ``unit``'s quantizers, each with the first of its layers that holds one (0 where the
        branch is no sequence), or None where one lies outside every branch."""
        found: dict[str, int] = {}
        for name in unit:
            rest = name[len(self.prefix):].split(".") if name.startswith(self.prefix) else []
            branch = ".".join(rest[:2])
            if branch not in self.modules:
                return None
            layer = int(rest[2]) if isinstance(self.modules[branch], nn.Sequential) and rest[2].isdigit() else 0
            found[branch] = min(found.get(branch, layer), layer)
        return found

    def live(self, branches: dict[str, int] | None) -> None:
        """Score the next candidates with only ``branches`` running, each from its layer (None: the whole head).
        The branches that ran for the unit before have their layers' inputs and outputs made again first, from the
        layer they ran from, with the scale the search kept for it."""
        for b, start in self.running.items():
            for i, steps in enumerate(self.steps[b]):
                later, self.outputs[b][i] = self._run(b, steps[start], start)
                steps[start:] = later
        for b, m in self.modules.items():
            if branches is None:
                m.__dict__.pop("forward", None)  # its own forward again
            else:
                m.forward = functools.partial(self._recorded, b, branches.get(b))
        self.running = {b: 0 for b in self.modules} if branches is None else dict(branches)

    def _recorded(self, branch: str, start: int | None, *_args):
        if start is None:  # not changed by this unit: what it gave
            return self.outputs[branch][self.batch]
        return self._run(branch, self.steps[branch][self.batch][start], start)[1]

    def close(self) -> None:
        for m in self.modules.values():
            m.__dict__.pop("forward", None)

    def head_outputs(self, detect: nn.Module, inputs: list[list[torch.Tensor]]) -> Iterable:
        """The head's output for each batch, the batch index set for the branches that return what they gave."""
        for i, features in enumerate(inputs):
            self.batch = i
            yield detect(list(features))


def downhill(factors: Sequence[float]) -> list[list[float]]:
    """``factors`` other than 1 as the two walks away from 1 that ``_descend(..., downhill_only=True)`` takes: upwards,
    then downwards, each nearest first."""
    return [sorted(f for f in factors if f > 1.0), sorted((f for f in factors if f < 1.0), reverse=True)]


def _descend(units: list[list[str]], modules: dict[str, nn.Module], loss: Callable[[], float], best_loss: float,
             factors: Sequence[float], desc: str, enter: Callable[[list[str]], None] | None = None,
             downhill_only: bool = False) -> tuple[dict[str, float], float]:
    """Coordinate descent: each unit's amax set, in turn, to the multiple of its value in ``factors`` with the
    lowest ``loss`` (``best_loss``: the loss as things stand); ``enter(unit)``, if given, is called before a
    unit's candidates are scored. ``downhill_only``: instead of every factor, walk away from 1 (:func:`downhill`)
    while the loss falls, upwards first and downwards only if the first step up did not lower it: the same choice
    wherever the loss has one minimum along the factors, in two or three candidates instead of all of them."""
    chosen: dict[str, float] = {}
    walks = downhill(factors) if downhill_only else [[f for f in factors if f != 1.0]]
    for unit in progress(units, desc=desc):
        if enter is not None:
            enter(unit)
        quantizers = [modules[n] for n in unit]
        start = [q.amax.detach().clone() for q in quantizers]
        best = 1.0
        for walk in walks:
            for f in walk:
                for q, a in zip(quantizers, start):
                    q.amax = a * f
                value = loss()
                if value < best_loss:
                    best_loss, best = value, f
                elif downhill_only:
                    break
            if best != 1.0:
                break
        for q, a in zip(quantizers, start):
            q.amax = a * best
        chosen[unit[0]] = best
    return chosen, best_loss


@torch.no_grad()
def search_head_amax(model: nn.Module, batches: Iterable[torch.Tensor], groups: Sequence[Sequence[str]],
                     factors: Sequence[float] = FACTORS, layers: Iterable[int] = (), head: bool = True,
                     replay: bool = True, branches: bool | None = None,
                     fp_inputs: Sequence[list[torch.Tensor]] | None = None, bounded: bool = False) -> dict:
    """Set each searchable amax to the multiple of its calibrated value that gives the lowest head distillation
    loss over ``batches``: first those of the body ``layers`` (one of :data:`BODY_FACTORS`), then, with ``head``,
    the head's inputs (one of ``factors``); print one line saying what moved. Returns the record
    ``QuantInfo.head_search`` keeps: ``{"factors": {first name of each unit: factor}, "loss_before",
    "loss_after", "batches"}`` (``{}`` when there is nothing to search, e.g. the head is kept in FP). ``replay``:
    on CUDA, score the candidates from a CUDA graph (``False``: eagerly; the same losses). ``branches``: score a
    head candidate by running only the branches it changes (:class:`_Branches`; None: where no CUDA graph replays
    them; the same losses). ``fp_inputs``: the head's inputs for each of ``batches`` with every quantizer off, as
    calibration's pass gave them (:func:`recording_head_inputs`; None: the network is run again for them, the same
    values). ``bounded`` (``--search-cost bounded``): each unit's factors walked downhill from 1 (:func:`_descend`)
    and the body's candidates scored on the first :data:`BOUNDED_BODY_BATCHES` batches, the head's on all: per body
    unit two or three runs of the network from its layer on one batch, where the full search runs eight on each
    batch."""
    from utils.qat.quantize.objectives import HeadDistillation, head_distillation
    detect = model.model[-1]
    layers = sorted(set(layers))
    body_units = searchable(model, groups, layers, head=False)
    head_units = searchable(model, groups) if head else []
    if not body_units and not head_units:
        if layers:
            where = f"amax search: layers {span(layers)}{' and the head' if head else ''} have no activation scale"
        else:
            where = "head amax search: the head has no activation scale of its own"
        print(f"{where} to search (kept in FP?)", flush=True)
        return {}
    modules = dict(model.named_modules())
    everything = enabled_quantizers(model)
    training = model.training
    model.eval()
    detect.train()  # the raw maps the objective reads
    capture = _HeadInputs(detect)
    batches = list(batches)
    chosen: dict[str, float] = {}
    try:
        with quantizers_off(everything):
            if fp_inputs is None:
                fp_inputs = [capture.run(model, images) for images in batches]
            targets = [detect(list(features)) for features in fp_inputs]

        # every candidate runs with the same weights: each quantized once, the same outputs in every bit
        with weights_quantized(model):
            def loss(outputs: Iterable) -> torch.Tensor:  # per batch
                return torch.stack([sum(head_distillation(out, target, detect.reg_max, detect.nc).values())
                                    for out, target in zip(outputs, targets)])

            def mean(graph: ValueGraph) -> float:
                values = graph()  # one per batch scored
                return sum(values) / len(values)

            cuda = replay and batches[0].is_cuda
            # the body's candidates are scored through the rest of the network, from the searched unit's layer on:
            # the same loss as running it all
            body_batches = batches[:BOUNDED_BODY_BATCHES] if bounded else batches
            bounded_body = bool(body_units) and len(body_batches) < len(batches)
            prefix = _Prefix(model, body_batches)
            body = ValueGraph(lambda: loss(prefix.outputs()), cuda, "body amax search")

            def enter(unit: list[str]) -> None:
                if prefix.enter(unit):
                    body.reset()

            cached: list[list[torch.Tensor]] = []
            # the body's output cached; the head writes into the list it is given: a copy
            head_graph = ValueGraph(lambda: loss(detect(list(quantized)) for quantized in cached), cuda,
                                    "head amax search")

            if body_units:
                before = mean(body)
                found, best_loss = _descend(body_units, modules, lambda: mean(body), before, BODY_FACTORS,
                                            "body amax search", enter=enter, downhill_only=bounded)
                chosen.update(found)
                body.reset()  # the recording's memory back before the head's
                body_loss = (before, best_loss)
            if head_units:
                cached = [capture.run(model, images) for images in batches]  # the body as now scaled, run once
                if not body_units or bounded_body:  # the head's start, on every batch
                    before = best_loss = mean(head_graph)
                if branches is None:
                    branches = not cuda
                enter_head = None
                if branches:
                    split = _Branches(detect, f"model.{len(model.model) - 1}.")
                    split.record(detect, cached)

                    def enter_head(unit: list[str]) -> None:
                        split.live(split.of(unit))
                    # the teacher's terms once, and each level's terms again only where a branch changed them
                    teachers = [HeadDistillation(target, detect.reg_max, detect.nc) for target in targets]

                    def split_loss() -> torch.Tensor:
                        return torch.stack([sum(teacher(out).values()) for teacher, out
                                            in zip(teachers, split.head_outputs(detect, cached))])
                    head_graph = ValueGraph(split_loss, False, "head amax search")
                try:
                    found, best_loss = _descend(head_units, modules, lambda: mean(head_graph), best_loss, factors,
                                                "head amax search", enter=enter_head, downhill_only=bounded)
                finally:
                    if branches:
                        split.close()
                chosen.update(found)
    finally:
        model.train(training)
    for name, units in (("body", body_units), ("head", head_units)):
        if not units:
            continue
        picked = [chosen[u[0]] for u in units]
        moved = sorted(f for f in picked if f != 1.0)
        scope = f"layers {span(layers)}" if name == "body" else "head input"
        print(f"{name} amax search: {len(moved)} of {len(picked)} {scope} scales changed"
              + (f" (x{moved[0]:g} to x{moved[-1]:g})" if moved else ""), flush=True)
    record = {"factors": chosen, "loss_before": before, "loss_after": best_loss, "batches": len(batches),
              **({"layers": layers} if layers else {})}
    if bounded_body:  # the body scored on fewer batches: its loss said apart, and the head's from where it left
        record["body"] = {"loss_before": body_loss[0], "loss_after": body_loss[1], "batches": len(body_batches)}
        print(f"body amax search: head distillation loss {body_loss[0]:.4g} -> {body_loss[1]:.4g} on "
              f"{len(body_batches)} calibration batch{'es' if len(body_batches) > 1 else ''}", flush=True)
        if not head_units:
            record.update(loss_before=body_loss[0], batches=len(body_batches))
            return record
    print(f"amax search: head distillation loss {before:.4g} -> {best_loss:.4g} on {len(batches)} calibration "
          "batches", flush=True)
    return record
