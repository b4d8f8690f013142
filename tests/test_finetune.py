"""QAT fine-tuning (utils/qat/quantize/finetune.py), its objectives (utils/qat/quantize/objectives.py) and the
QuantizeLinear-exact fake quantization (utils/qat/quantize/qdq.py), on the embedded GELAN-QS model (CPU)."""
from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from helpers import real_images

QS = REPO / "weights" / "gelan-qs-shapes.pt"
IMGSZ = 64


@pytest.fixture(scope="module")
def images(shared):
    return real_images(shared / "datasets" / "coco369" / "images" / "train2017", 4, IMGSZ)


@pytest.fixture(scope="module")
def qs(yolov9_tree):
    from utils.qat.model import checkpoint
    return checkpoint.load_fp(QS)


@pytest.fixture(scope="module")
def qs_calibrated(qs, images):
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    qmodel, info = quantize(qs, [images[:2], images[2:]], QuantConfig(method="max", head_amax="calibrated"))
    qmodel.names = qs.names
    return qmodel, info


def _export(module: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    import onnxruntime as ort
    buf = io.BytesIO()
    torch.onnx.export(module, x, buf, opset_version=17, dynamo=False, input_names=["x"])
    return ort.InferenceSession(buf.getvalue(), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the quantizer on the device QAT runs on)"))])
def test_qdq_rounding_is_quantize_linear_bit_for_bit(yolov9_tree, device):
    """A quantizer's PyTorch output equals ONNX Runtime's QuantizeLinear -> DequantizeLinear of the exported
    graph in every bit, rounding ties (x exactly half-way between two steps) included; modelopt's own
    rounding (x * 127 / amax) does not. On CUDA the quantizer runs the Triton kernels (qdq_triton.py)."""
    from modelopt.torch.quantization.config import QuantizerAttributeConfig
    from modelopt.torch.quantization.nn import TensorQuantizer

    from utils.qat.quantize.qdq import BACKEND, qdq_scale, register

    register()

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, axis=None))
            self.q.amax = torch.tensor(3.7)

        def forward(self, x):
            return self.q(x)

    module = One().eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 32, 32, generator=g) * 2
    x[0, 0] = (torch.randint(-200, 200, (32, 32), generator=g) + 0.5) * qdq_scale(torch.tensor(3.7))  # ties
    x[0, 1, 0, :4] = torch.tensor([100.0, -100.0, 3.7, -3.7])  # clipped and the bounds
    expected = _export(module, x)
    module.q.backend = BACKEND
    module.to(device)
    with torch.no_grad():
        assert np.array_equal(module(x.to(device)).cpu().numpy(), expected)
    module.q.backend = None
    with torch.no_grad():
        assert not np.array_equal(module(x.to(device)).cpu().numpy(), expected)


def test_qdq_rounding_gradient_is_clipped_straight_through(yolov9_tree):
    from utils.qat.quantize.qdq import _QDQ
    x = torch.tensor([-5.0, -1.0, 0.3, 2.0, 5.0], requires_grad=True)
    _QDQ.apply(x, torch.tensor(4.0), -128, 127).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_quantized_models_use_qdq_rounding(qs_calibrated, tmp_path):
    """Made by prepare() and restored from a checkpoint alike: every quantizer rounds as QuantizeLinear."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    from utils.qat.quantize.qdq import BACKEND
    from utils.qat.model import checkpoint
    qmodel, info = qs_calibrated
    path = checkpoint.save_quantized(tmp_path / "q.pt", qmodel, info)
    restored, _, _ = checkpoint.load_quantized(path)
    for model in (qmodel, restored):
        backends = {m.backend for m in model.modules() if isinstance(m, TensorQuantizer)}
        assert backends == {BACKEND}


def test_head_distillation_zero_at_teacher_and_background_light(qs):
    """The head objective is 0 when student = teacher, and a change of the box logits of anchors where the
    teacher sees no object weighs far less than the same change where it sees one."""
    from utils.qat.quantize.objectives import head_distillation
    from utils.qat.quantize.model_quant import fuse
    model = fuse(copy.deepcopy(qs)).train()
    head = model.model[-1]
    image = torch.full((1, 3, 128, 128), 0.2)
    image[:, :, 40:90, 30:80] = torch.tensor([0.9, 0.3, 0.1])[:, None, None]  # a filled square, as in the shapes set
    with torch.no_grad():
        out = model(image)
    zero = head_distillation(out, out, head.reg_max, head.nc)
    assert set(zero) == {"cls", "box"} and all(abs(float(v)) < 1e-6 for v in zero.values())

    level = out[0]  # B x (4 * reg_max + nc) x H x W
    conf = level[:, 4 * head.reg_max:].sigmoid().amax(1)  # B x H x W
    fg, bg = np.unravel_index(int(conf.argmax()), conf.shape), np.unravel_index(int(conf.argmin()), conf.shape)
    assert float(conf[fg]) > 0.5 > 100 * float(conf[bg])
    costs = []
    for b, y, x in (fg, bg):
        moved = [t.clone() for t in out]
        moved[0][b, : 4 * head.reg_max, y, x] += torch.linspace(-3, 3, 4 * head.reg_max)
        costs.append(float(head_distillation(moved, out, head.reg_max, head.nc)["box"]))
    assert costs[0] > 100 * costs[1] > 0


@pytest.mark.slow
def test_every_objective_trains_and_reports_its_terms(qs, qs_calibrated, images):
    from utils.qat.quantize.objectives import OBJECTIVES
    from utils.qat.quantize.model_quant import fuse
    from utils.qat.quantize.finetune import QATConfig, finetune
    from utils.qat.core.errors import QATError
    qmodel, _ = qs_calibrated
    teacher = fuse(copy.deepcopy(qs))
    targets = torch.tensor([[0, 1, 0.5, 0.5, 0.3, 0.3], [1, 2, 0.4, 0.6, 0.2, 0.4]])
    batch = (images[:2], targets, None)
    expected = {"head": {"head.cls", "head.box"}, "features": {"features"}, "task": {"task"}, "mse": {"mse"}}
    for objective in OBJECTIVES:
        student = copy.deepcopy(qmodel)
        [result] = finetune(student, teacher, lambda: [batch], QATConfig(epochs=1, iters=1, objective=objective, ema=0))
        terms = set().union(*(expected[t] for t in objective.split("+")))
        assert set(result.terms) == terms and np.isfinite(result.loss) and result.loss > 0, objective
    with pytest.raises(QATError, match="needs labels"):
        finetune(copy.deepcopy(qmodel), teacher, lambda: [images[:2]], QATConfig(epochs=1, iters=1, objective="task"))


def test_gains_weight_their_head_terms(yolov9_tree, images):
    """``box_gain`` and ``mask_gain`` multiply the head objective's box and masks terms and nothing else (on
    the embedded GELAN-QS-seg: the first step's terms, before any update, from one calibrated start)."""
    from utils.qat.model import checkpoint
    from utils.qat.quantize.model_quant import QuantConfig, fuse, quantize
    from utils.qat.quantize.finetune import QATConfig, finetune
    seg = checkpoint.load_fp(REPO / "weights" / "gelan-qs-seg-shapes.pt", task="segment")
    qmodel, _ = quantize(seg, [images], QuantConfig(method="max", head_amax="calibrated"))
    teacher = fuse(copy.deepcopy(seg))
    terms = {}
    for gains in ((1.0, 1.0), (2.0, 5.0)):
        config = QATConfig(epochs=1, iters=1, ema=0, amax_lr=0, box_gain=gains[0], mask_gain=gains[1])
        [result] = finetune(copy.deepcopy(qmodel), teacher, lambda: [images], config)
        terms[gains] = result.terms
    plain, weighted = terms[(1.0, 1.0)], terms[(2.0, 5.0)]  # each term kept to 6 decimals
    assert set(plain) == {"head.cls", "head.box", "head.masks"} and min(plain.values()) > 0
    assert weighted["head.cls"] == pytest.approx(plain["head.cls"], rel=1e-3)
    assert weighted["head.box"] == pytest.approx(2 * plain["head.box"], rel=1e-3)
    assert weighted["head.masks"] == pytest.approx(5 * plain["head.masks"], rel=1e-3)


def test_seed_orders_the_training_images(yolov9_tree, small_data):
    """``--seed`` reaches the QAT dataloader: the same seed gives the same order of the training images, another
    seed another order (upstream's loader alone repeats one order whatever the seed)."""
    from utils.qat.evaluation.data import dataloader, load_data_yaml
    data = load_data_yaml(small_data, splits=("train", "val"))

    def order(seed):
        loader, _ = dataloader(data, "train", 64, 2, 32, workers=0, rect=False, shuffle=True, seed=seed)
        return [Path(p).name for batch in loader for p in batch[2]]

    first, again, other = order(1), order(1), order(2)
    assert len(first) == 8 and sorted(first) == sorted(other)
    assert first == again and first != other


def test_a_seeded_loader_starts_its_workers_once(yolov9_tree, small_data, monkeypatch):
    """The seeded loader is upstream's made again: upstream's own is made without workers (its workers would start at
    once and augment batches nobody takes), the loader returned has the workers upstream gives it."""
    import os

    import utils.dataloaders as upstream
    from utils.qat.evaluation.data import dataloader, load_data_yaml
    made, real = [], upstream.create_dataloader

    def counted(*args, **kwargs):
        made.append(kwargs["workers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(upstream, "create_dataloader", counted)
    loader, _ = dataloader(load_data_yaml(small_data, splits=("train", "val")), "train", 64, 2, 32, workers=2,
                           rect=False, shuffle=True, seed=1)
    assert made == [0] and loader.num_workers == min(2, os.cpu_count() or 1)


@pytest.mark.slow
def test_iters_are_steps_and_a_short_set_is_read_again(qs, qs_calibrated, images, capsys):
    from utils.qat.quantize.model_quant import fuse
    from utils.qat.quantize.finetune import QATConfig, finetune
    qmodel, _ = qs_calibrated
    reads = []

    def batches():
        reads.append(1)
        return [images[:2], images[2:]]

    results = finetune(copy.deepcopy(qmodel), fuse(copy.deepcopy(qs)), batches, QATConfig(epochs=2, iters=5, ema=0, amax_lr=0))
    assert [r.steps for r in results] == [5, 5]
    assert len(reads) == 6  # 3 reads of 2 batches per epoch
    assert "gives 2 batches an epoch; reading it again to make 5 steps" in capsys.readouterr().out


@pytest.mark.slow
def test_ema_is_the_model_evaluated_and_returned(qs, qs_calibrated, images):
    """With ``ema``, on_epoch_end sees the averaged weights, and fine-tuning returns the model holding them;
    the averaged weights lie between the start and the last trained weights."""
    from utils.qat.quantize.model_quant import fuse
    from utils.qat.quantize.finetune import QATConfig, finetune
    qmodel, _ = qs_calibrated
    student, plain = copy.deepcopy(qmodel), copy.deepcopy(qmodel)
    name = "model.0.conv.weight"
    start = dict(student.named_parameters())[name].detach().clone()
    seen = []
    config = QATConfig(epochs=1, iters=4, lr=1e-3, warmup=0)
    finetune(student, fuse(copy.deepcopy(qs)), lambda: [images], config,
             on_epoch_end=lambda r: seen.append(dict(student.named_parameters())[name].detach().clone()))
    torch.manual_seed(0)
    finetune(plain, fuse(copy.deepcopy(qs)), lambda: [images], QATConfig(epochs=1, iters=4, lr=1e-3, warmup=0, ema=0))
    averaged, trained = dict(student.named_parameters())[name], dict(plain.named_parameters())[name]
    assert torch.equal(seen[0], averaged.detach())
    assert 0 < float((averaged - start).norm()) < float((trained - start).norm())


def test_ema_ramps():
    """``--ema-ramp``: ``uniform`` is the plain mean of the start and every step so far until it spans 1 / (1 - ema)
    steps; ``fast`` (the default) weighs the last steps most from the start: decay (1 + n) / (10 + n)."""
    from utils.qat.quantize.finetune import _EMA
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    uniform, fast = _EMA(model, 0.99, "uniform"), _EMA(model, 0.99, "fast")
    seen, expected_fast = [0.0], 0.0
    for n, w in enumerate([4.0, 1.0, 7.0, 2.0], start=1):
        with torch.no_grad():
            model.weight.fill_(w)
        uniform.update(model), fast.update(model)
        seen.append(w)
        d = (1 + n) / (10 + n)
        expected_fast = d * expected_fast + (1 - d) * w
        assert float(uniform.params["weight"]) == pytest.approx(sum(seen) / len(seen))
        assert float(fast.params["weight"]) == pytest.approx(expected_fast)
    capped = _EMA(model, 0.5, "uniform")
    for _ in range(3):
        capped.update(model)
    assert capped.decay == 0.5 and min(0.5, capped.ramp(3)) == 0.5


def test_lr_schedule_warms_up_then_decays():
    from utils.qat.quantize.finetune import lr_factor
    f = [lr_factor(s, 100, 10, 0.01) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[9:], f[10:])) and f[-1] == pytest.approx(0.01, abs=1e-3)


def test_learned_amax_gradient_is_lsq(yolov9_tree):
    """With a trainable amax the quantizer gives amax LSQ's gradient, (q - x/scale)/127 inside the range and
    q/127 where the input is clipped; the input's gradient stays the clipped straight-through one."""
    from utils.qat.quantize.qdq import _QDQ, qdq_scale
    amax = torch.tensor(4.0, requires_grad=True)
    x = torch.tensor([-5.0, -1.0, 0.3, 2.0, 5.0], requires_grad=True)
    _QDQ.apply(x, amax, -128, 127).sum().backward()
    scaled = x.detach() / qdq_scale(torch.tensor(4.0))
    q = torch.clamp(torch.round(scaled), -128, 127)
    inside = x.detach().abs() <= 4.0
    expected = float((torch.where(inside, q - scaled, q) / 127).sum())
    assert float(amax.grad) == pytest.approx(expected, rel=1e-3) and expected != 0
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    # per-channel amax (C x 1): the gradient is summed over each channel's elements
    amax_c = torch.tensor([[4.0], [1.0]], requires_grad=True)
    _QDQ.apply(torch.tensor([[0.3, 5.0], [0.3, -5.0]]), amax_c, -128, 127).sum().backward()
    residual = [float(torch.round(0.3 / qdq_scale(torch.tensor(a))) - 0.3 / qdq_scale(torch.tensor(a))) for a in (4.0, 1.0)]
    assert amax_c.grad.shape == (2, 1)
    assert amax_c.grad[:, 0].tolist() == pytest.approx([(residual[0] + 127) / 127, (residual[1] - 128) / 127], rel=1e-4)


@pytest.mark.slow
def test_learned_amax_moves_keeps_groups_shared_and_saves_as_buffers(qs, qs_calibrated, images, tmp_path):
    """--amax-lr: activation amax are trained; the quantizers of a shared-scale group end on one value; the
    model handed back (and every checkpoint) holds plain ``_amax`` buffers, and restores from a checkpoint."""
    from utils.qat.quantize.model_quant import fuse
    from utils.qat.quantize.finetune import QATConfig, finetune
    from utils.qat.quantize.rules import input_quantizers
    from utils.qat.model import checkpoint
    qmodel, info = qs_calibrated
    assert info.scale_groups, "the embedded model has concat groups"
    student = copy.deepcopy(qmodel)
    before = {n: float(q._amax) for n, q in input_quantizers(student).items()}
    saved = []

    def epoch_end(result):
        assert not any("_amax" in q._parameters for q in input_quantizers(student).values())
        saved.append(checkpoint.save_quantized(tmp_path / f"ep{result.epoch}.pt", student, info))
        saved.append(result)

    finetune(student, fuse(copy.deepcopy(qs)), lambda: [images], on_epoch_end=epoch_end,
             config=QATConfig(epochs=1, iters=3, lr=1e-4, warmup=0, amax_lr=0.05, ema=0),
             scale_groups=info.scale_groups)
    after = {n: q for n, q in input_quantizers(student).items()}
    assert all("_amax" in q._buffers and "_amax" not in q._parameters for q in after.values())
    assert not any(p is q._amax for q in after.values() for p in student.parameters())
    moved = [n for n in before if abs(float(after[n]._amax) / before[n] - 1) > 1e-3]
    assert len(moved) > len(before) // 2
    for group in info.scale_groups:
        assert len({float(after[n]._amax) for n in group}) == 1, group
    assert saved[1].amax["amax_change_max"] > 0
    restored, _, _ = checkpoint.load_quantized(saved[0])
    assert {n: float(q._amax) for n, q in input_quantizers(restored).items()} == {
        n: float(q._amax) for n, q in after.items()}
    assert not any(p.requires_grad for n, p in restored.named_parameters() if n.endswith("_amax"))


def test_fake_quant_models_are_evaluated_without_tf32(qs, qs_calibrated, images):
    """TorchBackend runs a fake-quantized model with TF32 off (as ONNX Runtime / TensorRT compute), an FP
    model as PyTorch is configured, and restores the flags after the call."""
    from utils.qat.quantize.model_quant import fuse
    from utils.qat.evaluation.backends import TorchBackend
    qmodel, _ = qs_calibrated
    seen = []
    flags = lambda: (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)  # noqa: E731
    before = flags()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for model in (copy.deepcopy(qmodel), fuse(copy.deepcopy(qs))):
            hook = model.model[0].register_forward_hook(lambda m, a, o: seen.append(flags()))
            TorchBackend(model, torch.device("cpu"))(images[:1])
            hook.remove()
        assert seen == [(False, False), (True, True)] and flags() == (True, True)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
