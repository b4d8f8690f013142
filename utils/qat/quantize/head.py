"""The detect head's activation scales chosen by the head's output error (``--head-amax search``).

    result = search_head_amax(qmodel, batches, groups)   # after calibration, on a few calibration batches

Calibration gives every activation quantizer the amax that minimises that tensor's own error. On GELAN-C
the head's input quantizers carry about three quarters of the INT8 loss (docs/QAT.md "Where the INT8 loss sits, and the evaluation with TF32 off"), and
what matters there is the error of the head's outputs, not of its inputs. This search keeps the network
before the head as calibrated, runs it once per batch (quantized, and with every quantizer off: the FP
reference), and then tries multiples of each head input quantizer's amax in turn (coordinate descent in
module order), keeping the one with the lowest ``head`` distillation loss (``utils/qat/quantize/objectives.py``:
class and box-distribution divergence from the FP head, on its raw training-form maps). Only the head is
re-run per candidate, so the search costs a few hundred head evaluations.

A quantizer whose shared-scale group reaches outside the head (a head input that is also the input of a
body layer with a tied scale) keeps its calibrated amax: changing it would change the body too.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from utils.qat.quantize.rules import input_quantizers
from utils.qat.quantize.state import enabled_quantizers, quantizers_off
from utils.qat.core.progress import progress

FACTORS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)
SEARCH_BATCHES = 4


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


def searchable(model: nn.Module, groups: Sequence[Sequence[str]]) -> list[list[str]]:
    """The head's enabled per-tensor input quantizers as search units (names in ``model``): a shared-scale
    group inside the head is one unit; a quantizer tied to one outside the head is left out."""
    index = len(model.model) - 1
    prefix = f"model.{index}."
    names = [n for n, q in input_quantizers(model).items()
             if n.startswith(prefix) and q.amax is not None and q.amax.numel() == 1]
    grouped = {n: list(g) for g in groups for n in g}
    units, done = [], set()
    for n in names:
        if n in done:
            continue
        unit = grouped.get(n, [n])
        done.update(unit)
        if all(m.startswith(prefix) for m in unit):
            units.append(unit)
    return units


@torch.no_grad()
def search_head_amax(model: nn.Module, batches: Iterable[torch.Tensor], groups: Sequence[Sequence[str]],
                     factors: Sequence[float] = FACTORS) -> dict:
    """Set each searchable head input amax to the multiple of its calibrated value (one of ``factors``) that
    gives the lowest head distillation loss over ``batches``, and print one line saying what moved. Returns
    the record ``QuantInfo.head_search`` keeps: ``{"factors": {first name of each unit: factor}, "loss_before",
    "loss_after", "batches"}`` (``{}`` when the head has nothing to search, e.g. it is kept in FP)."""
    from utils.qat.quantize.objectives import head_distillation
    head = model.model[-1]
    units = searchable(model, groups)
    if not units:
        print("head amax search: the head has no activation scale of its own to search (kept in FP?)", flush=True)
        return {}
    modules = dict(model.named_modules())
    everything = enabled_quantizers(model)
    training = model.training
    model.eval()
    head.train()  # the raw maps the objective reads; the capture stops before the head runs
    capture = _HeadInputs(head)
    cached = []
    try:
        for images in batches:
            quantized = capture.run(model, images)
            with quantizers_off(everything):
                target = head(capture.run(model, images))
            cached.append((quantized, target))

        def loss() -> float:
            total = 0.0
            for quantized, target in cached:  # the head writes into the list it is given: a fresh one each time
                parts = head_distillation(head(list(quantized)), target, head.reg_max, head.nc)
                total += float(sum(parts.values()))
            return total / len(cached)

        chosen: dict[str, float] = {}
        best_loss = before = loss()
        for unit in progress(units, desc="head amax search"):
            quantizers = [modules[n] for n in unit]
            start = [q.amax.detach().clone() for q in quantizers]
            best = 1.0
            for f in factors:
                if f == 1.0:
                    continue
                for q, a in zip(quantizers, start):
                    q.amax = a * f
                value = loss()
                if value < best_loss:
                    best_loss, best = value, f
            for q, a in zip(quantizers, start):
                q.amax = a * best
            chosen[unit[0]] = best
    finally:
        model.train(training)
    moved = sorted(f for f in chosen.values() if f != 1.0)
    print(f"head amax search: {len(moved)} of {len(chosen)} head input scales changed"
          + (f" (x{moved[0]:g} to x{moved[-1]:g})" if moved else "")
          + f"; head distillation loss {before:.4g} -> {best_loss:.4g} on {len(cached)} calibration batches", flush=True)
    return {"factors": chosen, "loss_before": before, "loss_after": best_loss, "batches": len(cached)}
