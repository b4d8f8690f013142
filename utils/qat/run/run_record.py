"""The evaluating and writing side of a quantization run (rank 0 of a multi-GPU run, or the single process).

    recorder = RunRecorder(out, "gelan-c.pt", score, arguments=vars(args), title=..., world_size=1)
    qat(..., recorder=recorder)   # utils/qat/run/pipeline.py calls origin(), ptq(), epoch_end() and finish()

It keeps the run folder ``out`` current after every stage: the checkpoints in ``out/weights`` (``ptq_*``,
``qat_ep_*``, ``qat_best_*``), report.json / report.md / qat_ap.png, and prints the tables. Every evaluation
records its AP on the two halves of the evaluation images too (``halves``), and report.json's ``selection`` says
which stage ``qat_best`` holds, the last epoch, and the selection-free pick (``reports.selection``). report.json and
every checkpoint record ``arguments``: everything the run was given (for the CLI, every flag's value), and
``provenance``: the weights file and its sha256, the toolkit's version and commit (``utils.qat.core.provenance``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from utils.qat.core import provenance, timing
from utils.qat.model import checkpoint
from utils.qat.run import reports
from utils.qat.core.atomic import copy_file

if TYPE_CHECKING:
    import torch.nn as nn

    from utils.qat.quantize.config import QuantInfo
    from utils.qat.quantize.finetune import EpochResult


def ap_record(m: Any) -> dict:
    """The AP numbers of one evaluation for report.json's epochs and the sensitivity table (segmentation:
    the mask AP ranks, the box AP is kept beside it)."""
    record = {"AP": round(m.mAP50_95, 4), "AP50": round(m.mAP50, 4)}
    if m.mask is not None:
        record.update(box_AP=round(m.box.mAP50_95, 4), box_AP50=round(m.box.mAP50, 4))
    return record


def print_table(rows: list[dict]) -> None:
    """The evaluated models, then their differences from Origin (when it was evaluated)."""
    print()
    if not rows:
        print(reports.NOTHING_EVALUATED)
        return
    print(reports.table(rows))
    diff = reports.deltas(rows)
    if diff:
        print()
        print(reports.table(diff, first="Comparison"))


def slower(arguments: dict) -> str:
    """What to change after fine-tuning diverged: a lower ``--lr`` (the default where the run's was above it, else a
    tenth of it), and the default ``--amax-lr`` where the run's was above it."""
    from utils.qat.quantize.finetune import QATConfig
    default, lr, amax_lr = QATConfig(), arguments.get("lr"), arguments.get("amax_lr")
    if not isinstance(lr, (int, float)) or lr <= 0:
        return "re-run with a lower --lr."
    lower = f"--lr {default.lr:g} (the default)" if lr > default.lr else f"--lr {lr / 10:g}"
    amax = (f" and --amax-lr {default.amax_lr:g} (the default; this run: {amax_lr:g})"
            if isinstance(amax_lr, (int, float)) and amax_lr > default.amax_lr else "")
    return f"re-run with a lower learning rate: {lower} instead of --lr {lr:g}{amax}."


class RunRecorder:
    """The run folder of one quantization: ``out`` (created by the caller), the weights it started from
    (``weights``: names the checkpoints), ``score`` (a ``utils.qat.run.pipeline.Evaluation``), the task of the
    checkpoints, and ``arguments`` (JSON-able) recorded in report.json and in every checkpoint.
    ``eval_origin`` / ``eval_ptq``: evaluate the FP / calibrated model (an unevaluated PTQ model is saved as
    ``ptq_<weights>.pt`` and does not compete for ``qat_best``)."""

    def __init__(self, out: Path, weights: str | Path, score: Callable[..., tuple[Any, float]], *,
                 arguments: dict, task: str = "detect", title: str | None = None, world_size: int = 1,
                 eval_origin: bool = True, eval_ptq: bool = True):
        self.out, self.weights, self.score, self.task = Path(out), str(weights), score, task
        self.arguments = dict(arguments)
        self.eval_origin, self.eval_ptq = eval_origin, eval_ptq
        self.wdir = self.out / "weights"
        self.wdir.mkdir(exist_ok=True)
        self.stem = Path(weights).stem
        reports.replace_previous_run(self.out, self.stem)
        self.title = title or f"yolov9-qat: {Path(weights).name}"
        self.rows: list[dict] = []
        self.epochs: list[dict] = []
        self.source = provenance.record(weights)  # hashed once: every checkpoint of the run records it
        self.meta: dict = {"world_size": world_size, "arguments": self.arguments, "provenance": self.source}
        self.best_path = self.wdir / f"qat_best_{self.stem}.pt"
        self.ptq_ap: float | None = None
        self.best_ap: float | None = None
        self.best_epoch, self.best_row = 0, None
        self.finetuned = False
        self.row = "Origin"  # the row being recorded: what its stages are called (utils.qat.core.timing)
        self.kept: tuple[Any, float] | None = None  # the budget's last kept model, as scored: (metrics, seconds)
        self.paired = None  # the paired bootstrap over the FP model's per-image statistics (resample.py)
        self.ptq_paired = None  # the PTQ model's paired difference from FP (divergence's reference)
        self.stopped: dict | None = None  # fine-tuning ended by divergence (epoch, why, the sentence printed)

    def _timed(self, what: str) -> Any:
        """A stage of the row being recorded, timed (report.json's ``stages``): ``interval PTQ``,
        ``save QAT epoch 2``."""
        return timing.timed(f"{what} {self.row}")

    def save_report(self) -> None:
        with self._timed("save"):
            if self.epochs:
                self.meta["selection"] = reports.selection(self.rows, self.epochs, self.best_epoch)
            reports.write_report(self.out, self.rows, self.epochs, self.title, **self.meta)

    def _save(self, path: Path, qmodel: nn.Module, info: QuantInfo, epoch: int, metrics: dict | None) -> None:
        with self._timed("save"):
            checkpoint.save_quantized(path, qmodel, info, epoch=epoch, metrics=metrics, task=self.task,
                                      arguments=self.arguments, source=self.source)

    def _best(self, path: Path) -> None:
        """``path``'s checkpoint copied to ``qat_best``."""
        with self._timed("save"):
            copy_file(path, self.best_path)

    def origin(self, fp: nn.Module) -> None:
        if not self.eval_origin:
            return
        m, sec = self.score(fp, "Origin")
        self.rows.append(reports.entry("Origin", self.weights, m, sec))
        self.save_report()
        if m.per_image:  # every later evaluation of these images gets its interval against FP, val_trt.py's too
            from utils.qat.evaluation import resample
            with self._timed("interval"):  # the draws, and FP's AP on each
                self.paired = resample.PairedBootstrap(m)
            with self._timed("save"):
                resample.save_images(m, self.out / resample.REFERENCE_FILE)

    def _paired(self, m: Any) -> Any:
        """The evaluation's paired difference from FP (``resample.Paired``), None where FP was not evaluated."""
        if self.paired is None:
            return None
        try:
            with self._timed("interval"):
                return self.paired(m)
        except ValueError as e:  # not the FP model's images (never seen): the row goes without its interval
            print(f"notice: no interval against FP for this evaluation ({e}).")
            return None

    def _vs_origin(self, m: Any, paired: Any = None) -> dict:
        """``{"vs_origin": ...}``: the evaluation's difference from FP with its paired-bootstrap interval (nothing
        where FP was not evaluated); ``paired``: that difference when already drawn."""
        from utils.qat.evaluation import resample
        paired = paired or self._paired(m)
        return {} if paired is None else {"vs_origin": resample.record(paired)}

    def ptq(self, qmodel: nn.Module, info: QuantInfo, calibration_seconds: float, finetuning: bool) -> None:
        self.row = "PTQ"
        self.meta["calibration_seconds"] = round(calibration_seconds, 1)
        if info.head_search:
            self.meta["head_search"] = info.head_search
        self.finetuned = finetuning
        if self.eval_ptq:
            m, sec = self.score(qmodel, "PTQ")
            self.kept = (m, sec)
            self.ptq_ap = self.best_ap = m.mAP50_95
            path = self.wdir / f"ptq_ap_{m.mAP50_95:.4f}_{self.stem}.pt"
            self.ptq_paired = self._paired(m)
            self.rows.append(reports.entry("PTQ", path, m, sec, calib_method=info.config.method,
                                           **self._vs_origin(m, self.ptq_paired)))
        else:
            path = self.wdir / f"ptq_{self.stem}.pt"
        self._save(path, qmodel, info, 0, self.rows[-1] if self.ptq_ap is not None else None)
        self.save_report()
        print(f"PTQ model saved to {path}")
        if self.ptq_ap is not None and finetuning:
            self._best(path)  # the starting point counts: fine-tuning must beat it

    def epoch_end(self, qmodel: nn.Module, info: QuantInfo, result: EpochResult) -> None:
        epoch = result.epoch + 1
        self.row = f"QAT epoch {epoch}"
        m, sec = self.score(qmodel, f"QAT epoch {epoch}")
        path = self.wdir / f"qat_ep_{epoch}_ap_{m.mAP50_95:.4f}_{self.stem}.pt"
        paired = self._paired(m)
        row = reports.entry(f"QAT epoch {epoch}", path, m, sec, **self._vs_origin(m, paired))
        self._save(path, qmodel, info, epoch, row)
        self.epochs.append({"epoch": epoch, **ap_record(m), "halves": reports.halves(m),
                            "loss": result.loss if math.isfinite(result.loss) else None,
                            "loss_terms": {k: v if math.isfinite(v) else None for k, v in result.terms.items()},
                            "steps": result.steps, "graph_steps": result.graph_steps,
                            "train_seconds": round(result.seconds, 1), "weights": str(path),
                            **({"stopped": result.stopped} if result.stopped else {})})
        if self.best_ap is None or m.mAP50_95 > self.best_ap:
            self.best_ap, self.best_epoch, self.best_row = m.mAP50_95, epoch, row
            self._best(path)
        self._divergence(epoch, m, paired, result)
        self.save_report()

    def _divergence(self, epoch: int, m: Any, paired: Any, result: EpochResult) -> None:
        """Whether fine-tuning diverged in this epoch, said (printed, and report.json / report.md's
        ``finetuning_stopped``) and kept in ``stopped`` (``until`` then ends the fine-tuning): a loss that was not
        finite (``finetune`` ended the epoch), or an epoch that falls far below PTQ by the evaluation's own spread:
        its 95% paired interval against FP lies entirely below the PTQ model's (docs/QAT_FINETUNING.md "When
        fine-tuning diverges"). That rule needs both FP and PTQ evaluated, as by default."""
        from utils.qat.evaluation.resample import shown
        if result.stopped:
            why = f"{result.stopped}, so the epoch ended there, without a step on it"
        elif paired is not None and self.ptq_paired is not None and paired.interval[1] < self.ptq_paired.interval[0]:
            why = (f"it scored {m.mAP50_95:.4f}, {shown(paired)} against FP, entirely below the PTQ model's "
                   f"{shown(self.ptq_paired)}")
        else:
            return
        kept = "the PTQ model" if self.best_epoch == 0 else f"epoch {self.best_epoch}"
        best = "" if self.best_ap is None else f" ({self.best_ap:.4f})"
        sentence = (f"fine-tuning diverged in epoch {epoch}: {why}; fine-tuning ends here, qat_best keeps {kept}{best}; "
                    f"{slower(self.arguments)}")
        self.stopped = {"epoch": epoch, "why": why, "kept": kept, "sentence": sentence}
        self.meta["finetuning_stopped"] = self.stopped
        print(f"warning: {sentence}", flush=True)

    def until(self) -> bool:
        """True once fine-tuning diverged (``finetune``'s ``until``; rank 0's answer on every rank)."""
        from utils.qat.core import distributed
        return distributed.broadcast_object(self.stopped is not None)

    # ---- the accuracy budget (utils/qat/run/budget.py) ----

    def holdout_lists(self, folder: str | Path) -> None:
        """Keep the budget's image lists (``fit.txt``: calibration and fine-tuning; ``holdout.txt``: its decisions)
        in the run folder, ``holdout/``."""
        for name in ("fit.txt", "holdout.txt"):
            copy_file(Path(folder) / name, self.out / "holdout" / name)

    def score_kept(self, model: nn.Module, desc: str) -> float:
        """The AP on the evaluation images of a model the budget kept (no row, no checkpoint). The budget ends with
        the last model it kept, so ``budget_result`` reuses that evaluation instead of scoring the same model again."""
        self.kept = self.score(model, desc)
        return self.kept[0].mAP50_95

    def budget_progress(self, summary: dict) -> None:
        self.row = "budget"
        self.meta["budget"] = summary
        self.save_report()

    def budget_result(self, qmodel: nn.Module, info: QuantInfo, summary: dict) -> None:
        """The model the budget ended with (the last it kept, scored then; scored here only if that step was not,
        as under ``--no-eval-ptq``), saved as ``qat_best``."""
        self.row = "budget"
        m, sec = self.kept or self.score(qmodel, "INT8 (budget)")
        paired = self._paired(m)  # drawn once: the row's interval and the summary's spread
        row = reports.entry("Budget", self.best_path, m, sec, calib_method=info.config.method,
                            fp_layers=summary.get("fp_layers", []), int8_share=summary.get("int8_share"),
                            **self._vs_origin(m, paired))
        self._save(self.best_path, qmodel, info, None, row)
        self.rows.append(row)
        summary["evaluation_AP"] = row["AP"]
        if paired is not None:  # how far the evaluation images themselves can tell it from FP
            summary["evaluation_spread"] = round(paired.spread, 4)
        self.budget_progress(summary)
        print(f"budget model saved to {self.best_path}")

    def finish(self) -> Path:
        """The run's last report (the ``QAT`` row where it fine-tuned, and ``stages``: where its time went), its tables
        printed."""
        if self.stopped:
            print(f"\nwarning: {self.stopped['sentence']}")
        self.row = "QAT"
        if self.finetuned:
            if self.best_row is not None:
                self.rows.append({**self.best_row, "name": "QAT", "weights": str(self.best_path), "epoch": self.best_epoch})
            elif self.ptq_ap is not None:
                ptq_row = next(r for r in self.rows if r["name"] == "PTQ")
                self.rows.append({**ptq_row, "name": "QAT", "weights": str(self.best_path), "epoch": 0,
                                  "note": "no fine-tuning epoch beat the calibrated model; qat_best is the PTQ model"})
        self.meta["stages"] = timing.record()  # up to this last report: what is left takes well under a second
        self.save_report()
        if self.finetuned:
            print(f"best QAT model (epoch {self.best_epoch}) saved to {self.best_path}")
        print_table(self.rows)
        if self.meta.get("selection"):
            print()
            print(reports.selection_table(self.meta["selection"]))
        if self.meta.get("budget"):
            print()
            print(reports.budget_table(self.meta["budget"]))
        print(f"\nwhere the time went (report.json's stages):\n{timing.table(self.meta['stages'])}")
        print(f"\nresults in {self.out}: report.md, report.json{', qat_ap.png' if self.epochs else ''}, weights/")
        return self.out
