"""Numbers that are not numbers (#67): every number a checkpoint computes with is checked when it is loaded
(utils/qat/model/numbers.py), and a fine-tuning that diverges says so (finetune.py, run_record.py).

Each damaged file is made from a genuine checkpoint, the embedded model quantized as the quickstart does (or its FP
checkpoint), one number changed; every command that loads it ends in one sentence naming the file, the tensor and a
fix, exit status 2, and writes nothing. The commands run in this process (``cli_error``: the QATError ``run_cli``
prints as ``error: ...`` with status 2), two of them also as users run them.
"""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import REPO, cli_error, run_tool
from helpers import TINY_GELAN, build, real_images

QS = REPO / "weights" / "gelan-qs-shapes.pt"
QS_SEG = REPO / "weights" / "gelan-qs-seg-shapes.pt"
INPUT_AMAX = "model.0.conv.input_quantizer._amax"
WEIGHT_AMAX = "model.2.cv1.conv.weight_quantizer._amax"


def _quantized(fp_path, images, path, task="detect", epoch=0):
    """The FP checkpoint at ``fp_path`` calibrated on ``images`` (max, calibrated head scales: the quick recipe) and
    saved at ``path`` as ``qat.py quantize`` saves it (``epoch`` 0: the PTQ checkpoint)."""
    from utils.qat.core import provenance
    from utils.qat.model import checkpoint
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    fp = checkpoint.load_fp(fp_path, task=task)
    qmodel, info = quantize(fp, [images], QuantConfig(method="max", head_amax="calibrated"), example=images[:1])
    qmodel.names = fp.names
    return checkpoint.save_quantized(path, qmodel, info, epoch=epoch, task=task, source=provenance.record(fp_path))


@pytest.fixture(scope="module")
def images(shapes):
    return real_images(shapes.parent / "images" / "train", 2, 64)


@pytest.fixture(scope="module")
def genuine(yolov9_tree, images, tmp_path_factory):
    return _quantized(QS, images, tmp_path_factory.mktemp("genuine") / "ptq_gelan-qs-shapes.pt")


def _fill(name, value, index=None):
    def change(ckpt):
        t = ckpt["state_dict"][name]
        (t.view(-1)[index] if index is not None else t).fill_(value)
    return change


# name -> (change, tensor, the words saying what is wrong)
QUANTIZED = {
    "NaN amax": (_fill(INPUT_AMAX, math.nan), INPUT_AMAX, "(the scale (amax) of an activation quantizer) is NaN;"),
    "inf amax": (_fill(INPUT_AMAX, math.inf), INPUT_AMAX, "is infinite;"),
    "zero amax": (_fill(INPUT_AMAX, 0.0), INPUT_AMAX, "is 0;"),
    "negative amax": (_fill(INPUT_AMAX, -1.0), INPUT_AMAX, "is negative (-1);"),
    "zero weight amax": (_fill(WEIGHT_AMAX, 0.0, 3), WEIGHT_AMAX,
                         "(the scale (amax) of a weight quantizer) is 0 in 1 of its 32 values;"),
    "NaN weight": (_fill("model.2.cv1.conv.weight", math.nan, 7), "model.2.cv1.conv.weight",
                   "(a layer's weights) is NaN in 1 of its 1024 values;"),
    "inf bias": (_fill("model.22.cv3.0.2.bias", -math.inf, 0), "model.22.cv3.0.2.bias", "is infinite in 1 of its"),
}


def _damaged(source, change, path):
    ckpt = torch.load(source, map_location="cpu", weights_only=True)
    change(ckpt)
    torch.save(ckpt, path)
    return path


def _quantized_commands(path, shapes, project):
    return {"qat.py eval": ("qat.py", "eval", "--weights", str(path), "--data", str(shapes), "--device", "cpu",
                            "--imgsz", "64", "--project", str(project)),
            "export_qat.py": ("export_qat.py", "--weights", str(path), "--imgsz", "64"),
            "export_yoloV9.py": ("export_yoloV9.py", "--weights", str(path), "--size", "64")}


def _nothing_written(folder, damaged, project):
    assert sorted(p.name for p in folder.iterdir()) == [damaged.name], "a refused file must leave nothing beside it"
    assert not project.exists(), "a refused file must leave no run folder"


@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_a_damaged_quantized_checkpoint_is_one_sentence_for_every_command(yolov9_tree, genuine, shapes, tmp_path,
                                                                          kind):
    change, tensor, words = QUANTIZED[kind]
    folder = tmp_path / "weights"
    folder.mkdir()
    damaged = _damaged(genuine, change, folder / "ptq_gelan-qs-shapes.pt")
    project = tmp_path / "runs"
    for name, args in _quantized_commands(damaged, shapes, project).items():
        error = cli_error(yolov9_tree, *args)
        assert error.startswith(f"{damaged} was not loaded: its {tensor} ("), (name, error)
        assert words in error, (name, error)
        # the fix: quantize the FP weights the file records again, with the command that does it (it can: they are
        # genuine); a PTQ checkpoint has no earlier checkpoint of its run to fall back to
        assert f"the file is damaged (a crash while writing, a corrupted copy): quantize its FP weights ({QS}, as the " \
               "file records) again with `qat.py quantize`." in error, (name, error)
        _nothing_written(folder, damaged, project)


def test_a_damaged_fine_tuned_checkpoint_names_the_ptq_checkpoint(yolov9_tree, genuine, tmp_path):
    """A fine-tuned epoch (qat_ep_*, qat_best) that diverged: its run's PTQ checkpoint, or a lower --lr."""
    ckpt = torch.load(genuine, map_location="cpu", weights_only=True)
    ckpt["epoch"] = 2
    _fill(INPUT_AMAX, math.nan)(ckpt)
    torch.save(ckpt, tmp_path / "qat_best_gelan-qs-shapes.pt")
    error = cli_error(yolov9_tree, "export_qat.py", "--weights", str(tmp_path / "qat_best_gelan-qs-shapes.pt"))
    assert "the file is damaged (a fine-tuning that diverged, a crash while writing, a corrupted copy): use the ptq_* " \
           f"checkpoint its run saved before fine-tuning, or quantize its FP weights ({QS}, as the file records) again " \
           "with `qat.py quantize` (a lower --lr if its fine-tuning diverged)." in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qat_best_gelan-qs-shapes.pt"]


@pytest.mark.slow
@pytest.mark.e2e
def test_as_users_run_them(yolov9_tree, genuine, shapes, tmp_path):
    """`error: <the sentence>`, one line, exit status 2, no traceback, nothing written."""
    folder = tmp_path / "weights"
    folder.mkdir()
    damaged = _damaged(genuine, QUANTIZED["NaN amax"][0], folder / "ptq_gelan-qs-shapes.pt")
    project = tmp_path / "runs"
    commands = _quantized_commands(damaged, shapes, project)
    for name in ("qat.py eval", "export_qat.py"):
        r = run_tool(yolov9_tree, *commands[name])
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (name, r.stderr[-2000:])
        assert errors[0].startswith(f"error: {damaged} was not loaded: its {INPUT_AMAX} ("), errors[0]
        _nothing_written(folder, damaged, project)


def test_segmentation(yolov9_tree, shapes, tmp_path):
    """The segmentation CLI loads through the same loader, and names its own quantize command."""
    seg = _quantized(QS_SEG, real_images(shapes.parent / "images" / "train", 2, 64), tmp_path / "seg.pt",
                     task="segment")
    folder = tmp_path / "weights"
    folder.mkdir()
    damaged = _damaged(seg, QUANTIZED["NaN weight"][0], folder / "ptq_gelan-qs-seg-shapes.pt")
    project = tmp_path / "runs"
    for args in (("segment/qat_seg.py", "eval", "--weights", str(damaged), "--data", str(shapes), "--device", "cpu",
                  "--imgsz", "64", "--project", str(project)),
                 ("export_qat.py", "--weights", str(damaged), "--imgsz", "64")):
        error = cli_error(yolov9_tree, *args)
        assert error.startswith(f"{damaged} was not loaded: its model.2.cv1.conv.weight (a layer's weights) is NaN"), error
        assert f"quantize its FP weights ({QS_SEG}, as the file records) again with `segment/qat_seg.py quantize`." \
               in error, error
        _nothing_written(folder, damaged, project)


def _fp_fill(module_path, attribute, value):
    def change(model):
        module = model
        for part in module_path.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        getattr(module, attribute).view(-1)[0] = value
    return change


# name -> (change of the FP model, tensor, the words saying what is wrong)
FP = {
    "NaN weight": (_fp_fill("model.0.conv", "weight", math.nan), "model.0.conv.weight",
                   "(a layer's weights) is NaN in 1 of its 432 values;"),
    "NaN running mean": (_fp_fill("model.0.bn", "running_mean", math.nan), "model.0.bn.running_mean",
                         "(a BatchNorm's running mean) is NaN in 1 of its 16 values;"),
    "negative running variance": (_fp_fill("model.0.bn", "running_var", -1.0), "model.0.bn.running_var",
                                  "(a BatchNorm's running variance) is negative (-1) in 1 of its 16 values;"),
}


@pytest.mark.parametrize("kind", list(FP))
def test_a_damaged_fp_checkpoint_is_one_sentence_for_every_command(yolov9_tree, shapes, tmp_path, kind):
    """An FP checkpoint whose numbers are not numbers would score 0 or quantize into NaN: every command that loads one
    refuses it, and says that quantizing cannot repair it."""
    change, tensor, words = FP[kind]
    ckpt = torch.load(QS, map_location="cpu", weights_only=False)  # ours: upstream's format, whole modules
    change(ckpt.get("ema") or ckpt["model"])
    folder = tmp_path / "weights"
    folder.mkdir()
    damaged = folder / "gelan-qs-shapes.pt"
    torch.save(ckpt, damaged)
    project = tmp_path / "runs"
    data = ("--data", str(shapes), "--device", "cpu", "--imgsz", "64", "--project", str(project))
    for args in (("qat.py", "quantize", "--weights", str(damaged), *data),
                 ("qat.py", "sensitive", "--weights", str(damaged), *data),
                 ("qat.py", "eval", "--allow-fp", "--weights", str(damaged), *data),
                 ("export_qat.py", "--weights", str(damaged), "--imgsz", "64"),
                 ("export_yoloV9.py", "--weights", str(damaged), "--size", "64"),
                 ("reparameterization.py", "--model", "t", "--weights", str(damaged),
                  "--save", str(folder / "converted.pt"))):
        error = cli_error(yolov9_tree, *args)
        assert error.startswith(f"{damaged} was not loaded: its {tensor} ("), (args[:2], error)
        assert words in error and error.endswith(
            "the file is damaged (a training run that diverged, a corrupted copy), and quantizing it cannot repair it: "
            "use an earlier checkpoint of its training, or copy or download the file again."), (args[:2], error)
        _nothing_written(folder, damaged, project)


def test_a_truncated_checkpoint_is_said_to_be_damaged(yolov9_tree, genuine, tmp_path):
    """A checkpoint cut short (an interrupted copy): the cause is the file, and neither the loader nor the full pickle
    (--trust-weights) can read it, so the fix is a new copy."""
    data = genuine.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    for trust in ((), ("--trust-weights",)):
        error = cli_error(yolov9_tree, "export_qat.py", "--weights", str(cut), *trust)
        assert error == (f"{cut} was not loaded: it starts as a PyTorch checkpoint (a zip archive) but its archive is "
                         "incomplete, so the file is damaged (an interrupted copy or download, a full disk while "
                         "saving); copy or download it again."), error
    assert [p.name for p in tmp_path.iterdir()] == ["cut.pt"]


def test_what_genuine_files_hold_loads(yolov9_tree, genuine, tmp_path):
    """The genuine checkpoints load (the reference FP weights too: tests/test_bounded_load.py and the suites that
    load them), and a zero weight amax is accepted where its channel's weights are all 0, as max calibration makes
    it: modelopt quantizes such a channel to 0."""
    from utils.qat.model import checkpoint
    checkpoint.load_quantized(genuine)
    checkpoint.load_fp(QS)
    ckpt = torch.load(genuine, map_location="cpu", weights_only=True)
    ckpt["state_dict"]["model.2.cv1.conv.weight"][3].zero_()
    ckpt["state_dict"][WEIGHT_AMAX][3].zero_()
    torch.save(ckpt, tmp_path / "zero-channel.pt")
    model = checkpoint.load_quantized(tmp_path / "zero-channel.pt")[0]
    assert float(model.model[2].cv1.conv.weight_quantizer.amax[3].max()) == 0


def test_a_loss_that_is_not_finite_ends_the_epoch_without_a_step(yolov9_tree, shared):
    """The step of a non-finite loss is not taken (the weights stay those of the last finite step), the epoch ends
    there and fine-tuning with it, and the result says why."""
    import copy

    from utils.qat.quantize.finetune import QATConfig, finetune
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    x = real_images(shared / "datasets" / "coco369" / "images" / "train2017", 2, 64)
    fp = build(TINY_GELAN).eval()
    qmodel, info = quantize(fp, [x], QuantConfig(method="max", head_amax="calibrated"), example=x[:1])
    bad = torch.full_like(x, math.nan)
    fed = []

    def batches():
        for batch in (x, bad, x):
            fed.append(batch)
            yield batch
    seen = {}
    results = finetune(qmodel, copy.deepcopy(fp), batches, QATConfig(epochs=2, iters=3, ema=0, warmup=1),
                       scale_groups=info.scale_groups, on_epoch_end=lambda r: seen.update(epoch=r.epoch))
    after_one = {n: p.detach().clone() for n, p in qmodel.named_parameters()}
    assert len(results) == 1 and seen == {"epoch": 0}, "fine-tuning ends with the epoch"
    result = results[0]
    assert result.stopped == "the loss was not finite at step 2 of 3" and result.steps == 1
    assert math.isfinite(result.loss) and len(fed) == 2
    assert all(torch.isfinite(p).all() for p in after_one.values())


@pytest.mark.slow
@pytest.mark.e2e
def test_a_fine_tuning_that_diverges_is_said(yolov9_tree, shapes, tmp_path):
    """The issue's run: the embedded model at --lr 1 --amax-lr 1 (its first epoch scores 0). The epoch lies far below
    PTQ by the evaluation's own spread (its interval against FP entirely below PTQ's), so fine-tuning ends there,
    says so and what to change, qat_best stays the PTQ model, and report.md and report.json say it too."""
    r = run_tool(yolov9_tree, "qat.py", "quantize", "--weights", str(QS), "--data", str(shapes), "--device", "cpu",
                 "--batch-size", "8", "--imgsz", "128", "--project", str(tmp_path), "--name", "d",
                 "--calib-batches", "2", "--calib-method", "max", "--epochs", "2", "--iters", "4", "--lr", "1",
                 "--amax-lr", "1", "--supervision-stride", "2", "--workers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "d"
    report = json.loads((run / "report.json").read_text())
    stopped = report["finetuning_stopped"]
    assert stopped["epoch"] == 1 and [e["epoch"] for e in report["epochs"]] == [1], "fine-tuning ends at epoch 1"
    sentence = stopped["sentence"]
    assert sentence.startswith("fine-tuning diverged in epoch 1: it scored ") and "against FP, entirely below the PTQ " \
        "model's" in sentence
    assert "fine-tuning ends here, qat_best keeps the PTQ model" in sentence
    assert sentence.endswith("re-run with a lower learning rate: --lr 3e-05 (the default) instead of --lr 1 and "
                             "--amax-lr 0.001 (the default; this run: 1).")
    assert r.stdout.count(f"warning: {sentence}") == 2  # when it happened, and again at the end beside the tables
    weights = run / "weights"
    ptq = next(weights.glob("ptq_ap_*_gelan-qs-shapes.pt"))
    assert (weights / "qat_best_gelan-qs-shapes.pt").read_bytes() == ptq.read_bytes()
    qat = next(m for m in report["models"] if m["name"] == "QAT")
    assert qat["epoch"] == 0 and "qat_best is the PTQ model" in qat["note"]
    md = (run / "report.md").read_text()
    assert "## Fine-tuning diverged" in md and sentence[1:] in md
