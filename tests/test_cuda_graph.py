"""QAT steps and the amax search replayed from CUDA graphs (utils/qat/quantize/cuda_graph.py): the same training
and the same choices as eager runs, bit for bit, and eager wherever a graph cannot serve. The graph tests need a
CUDA GPU (they run on the GPU machine, benchmarks/results/cuda-graph-tests-h*.txt); on the CPU what is checked is
that nothing tries to record."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from conftest import REPO
from helpers import real_images

QS = REPO / "weights" / "gelan-qs-shapes.pt"
QS_SEG = REPO / "weights" / "gelan-qs-seg-shapes.pt"
IMGSZ = 64
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")


@pytest.fixture(scope="module")
def images(shared):
    return real_images(shared / "datasets" / "coco369" / "images" / "train2017", 4, IMGSZ)


def _calibrate(weights, images, task: str = "detect"):
    """The embedded model calibrated (on the GPU where there is one), its fused FP teacher, the QuantInfo."""
    from utils.qat.model import checkpoint
    from utils.qat.quantize.model_quant import QuantConfig, fuse, quantize
    fp = checkpoint.load_fp(weights, task=task)
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    qmodel, info = quantize(fp, [images[:2].to(device), images[2:].to(device)],
                            QuantConfig(method="max", head_amax="calibrated"), device=device)
    return qmodel.cpu(), fuse(copy.deepcopy(fp)), info


@pytest.fixture(scope="module")
def calibrated(yolov9_tree, images):
    return _calibrate(QS, images)


@pytest.fixture(scope="module")
def calibrated_seg(yolov9_tree, images):
    return _calibrate(QS_SEG, images, task="segment")


@pytest.fixture
def deterministic():
    """cuDNN's deterministic kernels: two eager runs must agree in every bit before a graph can be compared."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _train(calibrated, batches, device, *, hook=None, **config):
    """Fine-tune a copy of the calibrated model; returns its state dict (on the CPU) and the epochs' results."""
    from utils.qat.quantize.finetune import QATConfig, finetune
    qmodel, teacher, info = calibrated
    student = copy.deepcopy(qmodel)
    if hook is not None:
        student.model[1].register_forward_hook(hook)
    results = finetune(student, copy.deepcopy(teacher), lambda: batches,
                       QATConfig(**{"epochs": 2, "iters": 6, "warmup": 2, "lr": 1e-3, **config}), device=device,
                       scale_groups=info.scale_groups)
    return {k: v.detach().cpu() for k, v in student.state_dict().items()}, results


def _same(a: dict, b: dict) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


@cuda
@pytest.mark.parametrize("model", ["calibrated", "calibrated_seg"])
def test_graph_steps_are_the_eager_steps_bit_for_bit(model, request, images, deterministic, capsys):
    """Two epochs of six steps over batches of 4, 4 and 2 images: the 4-image steps are replayed from a graph
    recorded at the first step, the short ones run eagerly between replays. Weights (EMA-averaged), learned amax,
    the quantizers' state and every epoch's loss terms (the mask term's too, for the segmentation model) are the
    all-eager run's in every bit."""
    calibrated = request.getfixturevalue(model)
    batches = [images.cuda(), images.flip(0).cuda(), images[:2].cuda()]
    graphed, g_results = _train(calibrated, batches, "cuda:0")
    out = capsys.readouterr().out
    eager, e_results = _train(calibrated, batches, "cuda:0", cuda_graph=False)
    assert out.count("now replay a CUDA graph") == 1
    assert [r.graph_steps for r in g_results] == [4, 4]
    assert [r.graph_steps for r in e_results] == [0, 0]
    assert not _same(graphed, eager)
    assert [r.terms for r in g_results] == [r.terms for r in e_results]
    assert [r.loss for r in g_results] == [r.loss for r in e_results]
    assert [r.amax for r in g_results] == [r.amax for r in e_results] and g_results[0].amax


@cuda
def test_a_step_that_cannot_be_recorded_runs_eagerly(calibrated, images, deterministic, capsys):
    """A layer that reads a value back to the CPU cannot be recorded: the run says so once and goes on eagerly,
    training exactly as with --no-cuda-graph."""
    seen = []
    hook = lambda module, args, out: seen.append(float(out.float().abs().sum()))  # noqa: E731
    batches = [images.cuda()]
    before = torch.cuda.memory_allocated()
    graphed, g_results = _train(calibrated, batches, "cuda:0", hook=hook)
    gc.collect()
    leaked = torch.cuda.memory_allocated() - before
    out = capsys.readouterr().out
    eager, _ = _train(calibrated, batches, "cuda:0", hook=hook, cuda_graph=False)
    assert out.count("could not be recorded as a CUDA graph") == 1, out
    assert [r.graph_steps for r in g_results] == [0, 0]
    assert not _same(graphed, eager)
    assert len(seen) == 2 * 12 + 2  # every step of both runs and the two warm-up passes (the recorded read raised)
    assert leaked < 2 ** 20, f"{leaked} bytes still held after the run"  # the failed recording's memory is freed


@cuda
def test_the_labels_objective_stays_eager(calibrated, images):
    """``task`` reads targets whose shape changes every batch: no graph is made for it."""
    from utils.qat.quantize.finetune import QATConfig, QATStep
    qmodel, teacher, info = calibrated
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.2, 0.2]])
    step = QATStep(copy.deepcopy(qmodel), copy.deepcopy(teacher), lambda: [(images, targets)],
                   QATConfig(objective="task"), device="cuda:0", scale_groups=info.scale_groups)
    try:
        assert step.graph is None
    finally:
        step.close()


@cuda
def test_a_replayed_step_never_waits_for_the_gpu(calibrated, images):
    """After the graph is recorded, a whole step (replay, loss scaler, fused optimiser over the weights and the
    learned amax, schedule, amax clamp, EMA) launches its work without reading anything back: CUDA's sync debug
    mode turns any synchronising call into an error. The multi-tensor optimiser failed here (the loss scaler read
    its overflow flag every step; benchmarks/results/yolov9-t-coco-fused-h100-logs/)."""
    from utils.qat.quantize.finetune import QATConfig, QATStep
    qmodel, teacher, info = calibrated
    batch = images.cuda()
    step = QATStep(copy.deepcopy(qmodel), copy.deepcopy(teacher), lambda: [batch], QATConfig(), device="cuda:0",
                   scale_groups=info.scale_groups)
    try:
        step.train()
        for _ in range(2):  # the first records the graph (recording synchronises)
            step(batch)
        assert step.learned is not None and step.ema is not None
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                step(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert step.graph_steps == 5  # the recording step replays too
    finally:
        step.close()


@cuda
def test_amax_search_replayed_is_the_eager_search_bit_for_bit(calibrated, images, deterministic):
    """The body search (``--search-layers``) and the head search scored from CUDA graphs, recorded again when the
    body search moves on to a later layer: the same choices, losses and amax as scoring every candidate eagerly,
    in every bit; the first layer runs only while a graph is made, not per candidate."""
    from utils.qat.quantize import head
    from utils.qat.quantize.state import amax_state
    qmodel, _, info = calibrated
    layers = (0, 3)
    batches = [images.cuda(), images.flip(-1).cuda()]
    units = head.searchable(qmodel, info.scale_groups, layers=layers, head=False)
    assert {head._layer(u[0]) for u in units} == set(layers)

    def search(replay: bool) -> tuple[dict, dict, int]:
        model = copy.deepcopy(qmodel).cuda()
        modules = dict(model.named_modules())
        for n in units[-1]:  # a clipped scale, so that the search has something to move
            modules[n].amax = modules[n].amax * 0.5
        runs = []
        model.model[0].register_forward_hook(lambda *_: runs.append(1))
        result = head.search_head_amax(model, batches, info.scale_groups, layers=layers, replay=replay)
        return result, amax_state(model), len(runs)

    (graphed, g_amax, g_runs), (eager, e_amax, e_runs) = search(True), search(False)
    assert graphed == eager and graphed["factors"][units[-1][0]] > 1.0
    assert g_amax.keys() == e_amax.keys() and all(torch.equal(g_amax[n], e_amax[n]) for n in e_amax)
    # per batch: the FP targets, the loss before (eager) and its recording, the run into layer 3, the head's inputs
    assert g_runs == 5 * len(batches) < e_runs


@cuda
def test_a_value_that_cannot_be_recorded_is_computed_eagerly(capsys):
    """A computation that reads a value back to the CPU cannot be recorded: it says so once and every call computes
    it eagerly, with the right values; one that can is replayed, reading what its inputs hold now."""
    from utils.qat.quantize.cuda_graph import ValueGraph
    x = torch.arange(4.0, device="cuda")
    reads = ValueGraph(lambda: x * float(x.sum()), cuda=True, name="test")
    assert reads() == [0.0, 6.0, 12.0, 18.0]
    x.fill_(1.0)
    assert reads() == [4.0] * 4 and reads.graph is None and reads.replays == 0
    assert capsys.readouterr().out.count("could not be recorded as a CUDA graph") == 1
    doubles = ValueGraph(lambda: x * 2, cuda=True, name="test")
    assert doubles() == [2.0] * 4 and doubles.graph is not None
    x.copy_(torch.arange(4.0))
    assert doubles() == [0.0, 2.0, 4.0, 6.0] and doubles.replays == 1


def test_no_graph_on_the_cpu(calibrated, images):
    """On the CPU every step is eager, and the epochs say so."""
    from utils.qat.quantize.cuda_graph import StepGraph, ValueGraph
    from utils.qat.quantize.finetune import QATConfig, QATStep, finetune
    qmodel, teacher, info = calibrated
    step = QATStep(copy.deepcopy(qmodel), copy.deepcopy(teacher), lambda: [images], QATConfig(), device="cpu",
                   scale_groups=info.scale_groups)
    step.close()
    assert step.graph is None
    assert not StepGraph(lambda x: {}, lambda none: None).serves(images)
    value = ValueGraph(lambda: images.mean((1, 2, 3)), cuda=False, name="test")
    assert value() == value() == images.mean((1, 2, 3)).tolist() and value.graph is None
    results = finetune(copy.deepcopy(qmodel), copy.deepcopy(teacher), lambda: [images], QATConfig(epochs=1, iters=2),
                       device="cpu", scale_groups=info.scale_groups)
    assert results[0].steps == 2 and results[0].graph_steps == 0


def test_no_cuda_graph_flag(yolov9_tree):
    """``--no-cuda-graph`` reaches the fine-tuning config; graphs are the default."""
    from conftest import cli_module
    qat = cli_module(yolov9_tree, "qat.py")
    parser = qat.get_args_parser()
    base = ["quantize", "--weights", "w.pt", "--data", "d.yaml"]
    assert qat.qat_config(parser.parse_args(base)).cuda_graph is True
    assert qat.qat_config(parser.parse_args(base + ["--no-cuda-graph"])).cuda_graph is False
