"""Quantize to an accuracy budget (``qat.py quantize --max-drop D``): escalate only as far as the budget needs, every
decision made on training images held out from calibration and fine-tuning, never on the evaluation images.

    qmodel, info, summary = to_budget(fp, data, QuantConfig(), QATConfig(), Budget(max_drop=0.005), score=score,
                                      imgsz=640, batch_size=16, device=device, recorder=recorder)

Every model is judged by its drop bound: the drop from the FP model's mAP50-95 on the held-out images that it stays
within at the budget's ``confidence``, from a paired bootstrap over those images
(``utils/qat/evaluation/resample.py``). A few dozen images move a drop by hundredths, so the drop alone would stop on
luck and pick the luckiest candidate; the bound weighs each by how much its images agree. The steps, in order of cost;
each ends the escalation once the kept model's bound is within ``max_drop``:

1. calibration as the command's flags say;
2. the other calibrations (:func:`calibrations`: methods, and on a GPU for detection the body search on and off), each
   replacing the kept model when its bound is lower;
3. layers kept in floating point: every quantized layer of ``model.model`` with its quantizers off in turn, the one
   that gives back most kept if its gain over the kept model holds at the same confidence (a layer in FP costs speed
   for good), then the others measured again, while at least ``min_int8`` of the convolutions stay INT8;
4. fine-tuning at the command's rate, then at a third of it if the first gave nothing; an epoch with a lower bound
   replaces the kept model, and a rate stops after ``patience`` epochs that did not.

The evaluation images are scored only for the report (``recorder``, rank 0): the FP model, step 1's model (the PTQ
row) and every kept step, beside their held-out scores, so a reader sees whether the two agree. In a multi-GPU run
every rank runs the same steps; rank 0 scores and decides, and its decisions reach the others
(``distributed.broadcast_object``).
"""
from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from utils.qat.core import distributed, timing
from utils.qat.core.errors import QATError
from utils.qat.evaluation.data import holdout_split
from utils.qat.evaluation.resample import PairedBootstrap
from utils.qat.quantize.config import AUTO_SEARCH, DEFAULT_CALIB_METHODS, QuantConfig, parse_layers
from utils.qat.run.pipeline import Evaluation, finetune_stage, ptq

if TYPE_CHECKING:
    from utils.qat.evaluation.evaluate import Metrics
    from utils.qat.quantize.config import QuantInfo
    from utils.qat.quantize.finetune import EpochResult, QATConfig
    from utils.qat.run.run_record import RunRecorder

DEFAULT_HOLDOUT = 0.2  # of the training images: enough to rank settings, most left to calibrate and fine-tune
# The budget keeps layers in FP only while this share of the convolutions stays INT8: past it, the engine's speed
# is no longer INT8's.
DEFAULT_MIN_INT8 = 0.9
# The calibrations step 2 tries besides the command's own: the task's default, and the percentile calibration that
# keeps long activation tails (on the COCO YOLOv9-t the best without the search: docs/QAT_RECIPE.md "A real COCO model").
ALTERNATIVES = (("default", None), ("percentile", 99.999), ("percentile", 99.99))
RATES = (1.0, 1 / 3)  # step 4: multiples of the fine-tuning rate, tried in turn while a rate gives nothing
# How sure the held-out images must make a step (the drop within the budget, a layer's gain above 0): 9 bootstrap
# draws in 10. 0.5 decides on the held-out figures alone.
DEFAULT_CONFIDENCE = 0.9


@dataclass(frozen=True)
class Budget:
    """The accuracy budget: ``max_drop`` (mAP50-95 points below the FP model, on the held-out images), the share of
    the training images held out (``holdout_fraction``), the share of convolutions that must stay INT8
    (``min_int8``; 1 keeps no layer in FP), ``confidence``: how sure the held-out images must make a decision (the
    share of bootstrap draws; 0.5: the held-out figures alone), the epochs without a lower bound that end a rate
    (``patience``), and ``strict``: a budget not met ends the command with an error (the closest model is written
    all the same)."""
    max_drop: float
    holdout_fraction: float = DEFAULT_HOLDOUT
    min_int8: float = DEFAULT_MIN_INT8
    confidence: float = DEFAULT_CONFIDENCE
    patience: int = 2
    strict: bool = False
    calibrations: tuple[QuantConfig, ...] | None = None  # step 2's candidates; None: :func:`calibrations`'


def calibrations(first: QuantConfig, task: str, device_type: str) -> list[QuantConfig]:
    """Step 2's candidates: :data:`ALTERNATIVES`' methods, each with the body search on and off where the search
    is measured (detection on a GPU; on a CPU it gained nothing) and as ``first`` has it elsewhere; ``first``
    itself left out."""
    searches = [first.search_layers]
    if task == "detect" and device_type == "cuda":
        searches = [parse_layers(AUTO_SEARCH), ()]
    out: list[QuantConfig] = []
    for method, percentile in ALTERNATIVES:
        method = DEFAULT_CALIB_METHODS[task] if method == "default" else method
        for layers in searches:
            config = dataclasses.replace(first, method=method, percentile=percentile or first.percentile,
                                         search_layers=layers)
            if _describe(config) != _describe(first) and config not in out:
                out.append(config)
    return out


def _describe(config: QuantConfig) -> str:
    """A calibration as one line shows it: ``mse, layers 0-5 searched``."""
    method = f"percentile {config.percentile:g}" if config.method == "percentile" else config.method
    layers = list(config.search_layers)
    if not layers:
        return f"{method}, no search"
    span = f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else ",".join(map(str, layers))
    return f"{method}, layers {span} searched"


def conv_counts(model: nn.Module) -> tuple[int, int]:
    """``(int8, total)``: the convolutions of ``model`` (a model or one of its layers), and those whose weights are
    quantized."""
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    int8 = [m for m in convs if getattr(getattr(m, "weight_quantizer", None), "is_enabled", False)]
    return len(int8), len(convs)


def _layer_quantizers(model: nn.Module, index: int) -> list:
    from utils.qat.quantize.state import enabled_quantizers
    return enabled_quantizers(model.model[index])


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


BOUNDS = "budget bounds"  # the stage (report.json's stages) of the paired-bootstrap bounds the steps are judged by


def _main_decides(decide: Callable[[], Any]) -> Any:
    """``decide()`` on rank 0 (it scores, so it runs there alone), its result on every rank."""
    return distributed.broadcast_object(decide() if distributed.is_main() else None)


class _HeldOut:
    """Scores a model on the held-out images (rank 0): the AP every decision is made on; ``last`` keeps the last
    evaluation, whose per-image statistics the paired bootstrap draws from."""

    def __init__(self, score: Evaluation):
        self.score = score
        self.last: Metrics | None = None

    def __call__(self, model: nn.Module, desc: str) -> float:
        self.last, _ = self.score(model, f"held-out: {desc}")
        return self.last.mAP50_95


class _Log:
    """The budget's record and its verdicts (rank 0): one line printed per step, the steps as report.json keeps
    them, and whether the model kept so far meets the budget (:meth:`met`, every rank)."""

    def __init__(self, budget: Budget, fp_holdout: float, split: dict, recorder: RunRecorder | None,
                 heldout: _HeldOut):
        self.budget, self.fp, self.recorder, self.heldout = budget, fp_holdout, recorder, heldout
        self.steps: list[dict] = []
        self.kept: dict = {}  # the kept model's verdict: drop, drop_bound, met
        self.kept_metrics: Metrics | None = None
        self._judged: tuple[Metrics, dict] | None = None
        self.paired = None  # rank 0: the draws over the held-out images and the FP model's AP on each
        if distributed.is_main() and self.bootstrapped:
            with timing.timed(BOUNDS):
                self.paired = PairedBootstrap(heldout.last, level=budget.confidence)
        self.summary: dict = {"max_drop": budget.max_drop, "min_int8": budget.min_int8,
                              "confidence": budget.confidence, "holdout": split,
                              "fp_holdout_AP": round(fp_holdout, 4), "steps": self.steps}

    @property
    def bootstrapped(self) -> bool:
        return self.budget.confidence > 0.5

    def judge(self) -> dict:
        """Rank 0: the last model scored on the held-out images against FP: its ``drop``, ``drop_bound`` (the drop
        it stays within at the budget's confidence; the drop itself at 0.5) and whether that ``met`` the budget.
        Judged once per evaluation."""
        last = self.heldout.last
        assert last is not None
        if self._judged is None or self._judged[0] is not last:
            drop = self.fp - last.mAP50_95
            with timing.timed(BOUNDS):
                bound = -self.paired(last).low if self.paired is not None else drop
            self._judged = (last, {"drop": round(drop, 4), "drop_bound": round(bound, 4),
                                   "met": bound <= self.budget.max_drop + 1e-9})
        return self._judged[1]

    def better(self) -> bool:
        """Rank 0: whether the last model scored is surer to be within the budget than the kept one (a lower
        ``drop_bound``): what replaces the kept model at steps 2 and 4."""
        return self.judge()["drop_bound"] < self.kept["drop_bound"]

    def gain_holds(self) -> tuple[bool, float]:
        """Rank 0: whether the last model scored beats the kept one on the held-out images at the budget's
        confidence, and the gain's lower bound there (the gain itself at 0.5)."""
        assert self.heldout.last is not None and self.kept_metrics is not None
        if not self.bootstrapped:
            gain = self.heldout.last.mAP50_95 - self.kept_metrics.mAP50_95
        else:
            with timing.timed(BOUNDS):
                gain = PairedBootstrap(self.kept_metrics, level=self.budget.confidence)(self.heldout.last).low
        return gain > 0, round(gain, 4)

    def met(self) -> bool:
        """Every rank: whether the model kept so far meets the budget (rank 0 decides)."""
        return bool(distributed.broadcast_object(self.kept.get("met", False) if distributed.is_main() else None))

    def step(self, number: int, kind: str, tried: str, ap: float, kept: bool, model: nn.Module | None = None,
             **extra) -> None:
        """Record one step (rank 0), ``ap`` the score of the last model scored on the held-out images. A kept step's
        model becomes the one the budget is judged on, and is scored on the evaluation images too, for the report."""
        if not distributed.is_main():
            return
        verdict = self.judge()
        record = {"step": number, "kind": kind, "tried": tried, "holdout_AP": round(ap, 4), **verdict,
                  "kept": kept, "met": kept and verdict["met"], **extra}
        if kept:
            self.kept, self.kept_metrics = verdict, self.heldout.last
        if kept and model is not None and self.recorder is not None:
            record["evaluation_AP"] = round(self.recorder.score_kept(model, f"budget step {number}: {tried}"), 4)
        self.steps.append(record)
        sure = f" ({-verdict['drop_bound']:+.4f} or better at {self.budget.confidence:.0%} confidence)" \
            if self.bootstrapped else ""
        outcome = "kept, within the budget" if record["met"] else "kept" if kept else "not kept"
        print(f"budget step {number} ({kind}): {tried}: held-out mAP50-95 {ap:.4f}, {ap - self.fp:+.4f} against FP "
              f"{self.fp:.4f}{sure}; budget {-self.budget.max_drop + 0.0:g}: {outcome}", flush=True)
        if self.recorder is not None:
            self.recorder.budget_progress(self.summary)


def to_budget(fp_model: nn.Module, data: dict, quant: QuantConfig, config: QATConfig | None, budget: Budget, *,
              score: Evaluation, imgsz: int, batch_size: int, device: torch.device, hyp: dict | None = None,
              calib_batches: int = 25, workers: int = 8, task: str = "detect", seed: int | None = None,
              world_size: int = 1, local_rank: int = -1,
              recorder: RunRecorder | None = None) -> tuple[nn.Module, QuantInfo, dict]:
    """The budget's escalation (the module's docstring has its steps). ``data``: the dataset (its ``train`` images
    are split, its ``val`` images scored only for the report); ``quant`` / ``config``: the command's calibration and
    fine-tuning (None: no fine-tuning step, ``--ptq-only``); ``score``: how the evaluation images are scored (the
    held-out images are scored the same way). Returns the model the budget ended with, its record and the budget's
    summary (also in report.json as ``budget``, with the model written as ``qat_best`` by ``recorder``)."""
    if seed is not None:
        from utils.general import init_seeds
        init_seeds(seed)
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="yolov9-qat-holdout-") as lists:
        fit, held, split = holdout_split(data, budget.holdout_fraction, lists)
        if recorder is not None:
            recorder.holdout_lists(lists)
            recorder.origin(fp_model)
        ap = _HeldOut(dataclasses.replace(score, data=held, loaders={}))
        fp_ap = _main_decides(lambda: ap(fp_model, "FP"))
        log = _Log(budget, fp_ap, split, recorder, ap)
        if distributed.is_main():
            sure = f" at {budget.confidence:.0%} confidence (a paired bootstrap over them)" if log.bootstrapped else ""
            print(f"budget: held out {split['holdout_images']} of the training images ({budget.holdout_fraction:g}), "
                  f"FP mAP50-95 {fp_ap:.4f} on them; the INT8 model must stay within {budget.max_drop:g} of it there"
                  f"{sure} (--max-drop)", flush=True)

        def calibrated(cfg: QuantConfig) -> tuple[nn.Module, QuantInfo]:
            return ptq(fp_model, fit, cfg, imgsz=imgsz, batch_size=batch_size, device=device,
                       calib_batches=calib_batches, workers=workers)

        # 1. calibration as the command says
        began = time.time()
        qmodel, info = calibrated(quant)
        if recorder is not None:
            recorder.ptq(qmodel, info, calibration_seconds=time.time() - began, finetuning=False)
        current = _main_decides(lambda: ap(qmodel, "calibration"))
        log.step(1, "calibration", _describe(quant), current, True, None,
                 evaluation_AP=None if recorder is None or recorder.ptq_ap is None else round(recorder.ptq_ap, 4))

        # 2. the other calibrations, the one surest to be within the budget kept
        if not log.met():
            tried = calibrations(quant, task, device.type) if budget.calibrations is None else budget.calibrations
            for cfg in tried:
                candidate, candidate_info = calibrated(cfg)
                got = _main_decides(lambda: ap(candidate, _describe(cfg)))
                kept = _main_decides(log.better)
                log.step(2, "calibration", _describe(cfg), got, kept, candidate if kept else None)
                if kept:
                    qmodel, info, current = candidate, candidate_info, got
                if log.met():
                    break

        # 3. layers kept in floating point, the most helpful first, measured again after each
        fp_layers: list[int] = []
        while not log.met():
            ranking = _main_decides(lambda: _fp_ranking(qmodel, fp_layers, budget.min_int8, ap))
            if not ranking:
                break
            top = ranking[0]
            quantizers = _layer_quantizers(qmodel, top["layer"])
            for q in quantizers:
                q.disable()
            got = _main_decides(lambda: ap(qmodel, f"layers {', '.join(map(str, [*fp_layers, top['layer']]))} in FP"))
            holds, gain = _main_decides(log.gain_holds)
            tried = f"layer {top['layer']} ({top['module']}) in FP"
            if not holds:  # the best layer's gain is within the noise: every layer stays INT8
                for q in quantizers:
                    q.enable()
                log.step(3, "FP layer", f"{tried}, the best of {len(ranking)} layers", got, False,
                         gain_bound=gain, ranking=_shown(ranking))
                break
            fp_layers.append(top["layer"])  # for good: this layer stays in floating point
            current = got
            log.step(3, "FP layer", tried, current, True, qmodel, gain_bound=gain, ranking=_shown(ranking))
        if fp_layers:
            info = _with_fp_layers(qmodel, info, fp_layers)

        # 4. fine-tuning at the rates that hold
        if config is not None and not log.met():
            qmodel, current = _finetune(qmodel, fp_model, info, fit, config, log, ap, current, imgsz=imgsz,
                                        batch_size=batch_size, device=device, hyp=hyp, workers=workers, task=task,
                                        world_size=world_size, local_rank=local_rank, seed=seed)

        int8, total = conv_counts(qmodel)
        log.summary.update(met=log.met(), holdout_AP=round(current, 4), drop=round(fp_ap - current, 4),
                           drop_bound=log.kept.get("drop_bound"), fp_layers=fp_layers,
                           calibration=_describe(info.config), int8_convs=int8, convs=total,
                           int8_share=round(int8 / max(total, 1), 4), seconds=round(time.time() - start, 1))
        if recorder is not None:
            recorder.budget_result(qmodel, info, log.summary)
        return qmodel, info, log.summary


def _module(model: nn.Module, index: int) -> str:
    return type(model.model[index]).__name__.removeprefix("Quant")


def _fp_ranking(qmodel: nn.Module, fp_layers: list[int], min_int8: float,
                ap: Callable[[nn.Module, str], float]) -> list[dict]:
    """Rank 0: every layer that can still go to FP (quantizers on, and without it at least ``min_int8`` of the
    convolutions stay INT8), scored with its quantizers off; best first (empty: no layer may go)."""
    from utils.qat.quantize.state import quantizers_off
    int8, total = conv_counts(qmodel)
    ranking = []
    for i, layer in enumerate(qmodel.model):
        quantizers = _layer_quantizers(qmodel, i)
        if not quantizers or i in fp_layers or int8 - conv_counts(layer)[0] < min_int8 * total:
            continue
        with quantizers_off(quantizers):
            score = ap(qmodel, f"layer {i} in FP")
        ranking.append({"layer": i, "module": _module(qmodel, i), "holdout_AP": round(score, 4), "score": score})
    if not ranking:
        print(f"budget step 3 (FP layer): no further layer can stay in FP with {min_int8:g} of the convolutions INT8 "
              "(--min-int8)", flush=True)
    return sorted(ranking, key=lambda r: -r["score"])


def _shown(ranking: list[dict]) -> list[dict]:
    """The top of a ranking as report.json keeps it (rounded scores)."""
    return [{k: v for k, v in r.items() if k != "score"} for r in ranking[:5]]


def _with_fp_layers(qmodel: nn.Module, info: QuantInfo, layers: list[int]) -> QuantInfo:
    """``info`` with ``layers`` among the layers kept in FP, as ``--skip-layers`` would record them (the export's
    lint and a rebuilt checkpoint read them there)."""
    from utils.qat.quantize.rules import fp_patterns
    skip = tuple(dict.fromkeys([*info.config.skip, *map(str, layers)]))
    return dataclasses.replace(info, config=dataclasses.replace(info.config, skip=skip),
                               fp_patterns=list(dict.fromkeys([*info.fp_patterns, *fp_patterns(qmodel, map(str, layers))])))


class _Epochs:
    """Step 4 at one rate: rank 0 scores each epoch on the held-out images; every rank keeps the weights of an
    epoch that lowered the drop bound, and stops when the budget is met or ``patience`` epochs did not."""

    def __init__(self, qmodel: nn.Module, log: _Log, ap: Callable[[nn.Module, str], float], best: float, lr: float,
                 patience: int):
        self.qmodel, self.log, self.ap, self.best, self.lr, self.patience = qmodel, log, ap, best, lr, patience
        self.verdict: dict | None = None
        self.state: dict[str, torch.Tensor] | None = None
        self.idle = 0

    def epoch_end(self, result: EpochResult) -> None:  # rank 0, the evaluated (EMA) weights in place
        got = self.ap(self.qmodel, f"QAT epoch {result.epoch + 1} at lr {self.lr:g}")
        improved = self.log.better()
        self.idle = 0 if improved else self.idle + 1
        self.best = got if improved else self.best
        self.log.step(4, "fine-tuning", f"epoch {result.epoch + 1} at lr {self.lr:g}", got, improved,
                      self.qmodel if improved else None, loss=round(result.loss, 6))
        stop = self.log.kept.get("met", False) or self.idle >= self.patience
        self.verdict = {"improved": improved, "stop": stop, "best": self.best}

    def until(self) -> bool:  # every rank, after epoch_end
        self.verdict = distributed.broadcast_object(self.verdict)
        assert self.verdict is not None
        self.best = self.verdict["best"]
        if self.verdict["improved"]:
            self.state = _snapshot(self.qmodel)
        return self.verdict["stop"]


def _finetune(qmodel: nn.Module, fp_model: nn.Module, info: QuantInfo, fit: dict, config: QATConfig, log: _Log,
              ap: Callable[[nn.Module, str], float], current: float, **kwargs) -> tuple[nn.Module, float]:
    start = _snapshot(qmodel)
    best_state, best = start, current
    for multiple in RATES:
        lr = config.lr * multiple
        qmodel.load_state_dict(start)
        epochs = _Epochs(qmodel, log, ap, best, lr, log.budget.patience)
        finetune_stage(qmodel, fp_model, info, fit, dataclasses.replace(config, lr=lr), on_epoch_end=epochs.epoch_end,
                       until=epochs.until, **kwargs)
        if epochs.state is not None:
            best_state, best = epochs.state, epochs.best
            break
    qmodel.load_state_dict(best_state)
    return qmodel, best


def not_met(summary: dict, saved: str) -> str:
    """The one sentence of a budget not met: the closest result, what it kept in FP, and what to change; when its
    drop is within the budget but too few held-out images confirm it, it says that instead."""
    layers = summary.get("fp_layers") or []
    kept = f"layers {', '.join(map(str, layers))} kept in FP" if layers else "no layer kept in FP"
    model = f"{kept} ({summary['int8_share']:.1%} of the convolutions INT8), saved as {saved}"
    drop, bound, budget = summary["drop"], summary.get("drop_bound"), summary["max_drop"]
    images, confidence = summary["holdout"]["holdout_images"], summary.get("confidence", 0.5)
    if bound is not None and drop <= budget + 1e-9 < bound:
        return (f"the accuracy budget was not confirmed: on the {images} held-out images the closest model is "
                f"{-drop:+.4f} against FP, within --max-drop {budget:g}, but so few images put it only at "
                f"{-bound:+.4f} or better at {confidence:.0%} confidence; it has {model}; hold out more images "
                "(--holdout-fraction) or add training images, pass a larger --max-drop, or --confidence 0.5 to "
                "decide on the held-out figures alone.")
    sure = f" ({-bound:+.4f} or better at {confidence:.0%} confidence)" if bound is not None and bound != drop else ""
    return (f"the accuracy budget was not met: the closest model scores {summary['holdout_AP']:.4f} on the held-out "
            f"images, {-drop:+.4f} against FP{sure} for --max-drop {budget:g}, with {model}; pass a larger "
            "--max-drop, a lower --min-int8 to let more layers stay in FP, or more --epochs.")


def check(summary: dict, saved: str, strict: bool) -> None:
    """After the run: a budget not met (or not confirmed) is one sentence, with ``strict`` an error."""
    if summary.get("met"):
        return
    sentence = not_met(summary, saved)
    if strict:
        raise QATError(sentence)
    if distributed.is_main():
        print(f"notice: {sentence}", flush=True)
