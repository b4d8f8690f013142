"""``--head-amax search`` (utils/qat/quantize/head.py): the detect head's input scales chosen by the head's
output error after calibration, on the embedded GELAN-QS model (CPU, small images)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import real_images

REPO = Path(__file__).resolve().parents[1]
QS = REPO / "weights" / "gelan-qs-shapes.pt"
IMGSZ = 64


@pytest.fixture(scope="module")
def images(shared):
    return real_images(shared / "datasets" / "coco369" / "images" / "train2017", 2, IMGSZ)


@pytest.fixture(scope="module")
def calibrated(yolov9_tree, images):
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.model import checkpoint
    return quantize(checkpoint.load_fp(QS), [images], QuantConfig(method="max", head_amax="calibrated"))


def _amax(model) -> dict[str, torch.Tensor]:
    from utils.qat.quantize.state import amax_state
    return amax_state(model)


def test_weights_quantized_once_give_the_same_network_and_are_put_back(calibrated, images):
    """``weights_quantized``, inside which the amax searches run the network: each weight holds its quantized value and
    its quantizer is off, the outputs equal the quantized model's bit for bit, and afterwards every weight and
    weight quantizer is as before, also when the block raises."""
    from utils.qat.quantize.state import weights_quantized
    qmodel, _ = calibrated
    qmodel.eval()
    quantizers = [m.weight_quantizer for m in qmodel.modules() if hasattr(m, "weight_quantizer")]
    on = [q.is_enabled for q in quantizers]
    weights = {n: p.detach().clone() for n, p in qmodel.named_parameters()}
    assert sum(on) > 50
    with torch.no_grad():
        want = qmodel(images)[0]
        with weights_quantized(qmodel):
            assert not any(q.is_enabled for q in quantizers)
            assert any(not torch.equal(p, weights[n]) for n, p in qmodel.named_parameters())
            got = qmodel(images)[0]
        assert torch.equal(got, want)
        with pytest.raises(RuntimeError), weights_quantized(qmodel):
            raise RuntimeError
    assert [q.is_enabled for q in quantizers] == on
    assert all(torch.equal(p, weights[n]) for n, p in qmodel.named_parameters())


@pytest.mark.slow
def test_search_lowers_the_head_loss_and_touches_only_head_scales(calibrated, images):
    import copy

    from utils.qat.quantize.head import FACTORS, search_head_amax, searchable
    qmodel, info = calibrated
    qmodel = copy.deepcopy(qmodel)
    head = f"model.{len(qmodel.model) - 1}."
    units = searchable(qmodel, info.scale_groups)
    assert units and all(n.startswith(head) and n.endswith("input_quantizer") for u in units for n in u)
    before = _amax(qmodel)
    # a deliberately poor scale: the head's first input quantizer at 1.5x its calibrated amax (coarse steps)
    first = dict(qmodel.named_modules())[units[0][0]]
    first.amax = first.amax * 1.5
    result = search_head_amax(qmodel, [images], info.scale_groups)
    after = _amax(qmodel)
    assert result["loss_after"] < result["loss_before"]
    assert set(result["factors"]) == {u[0] for u in units} and set(result["factors"].values()) <= set(FACTORS)
    searched = {n for u in units for n in u}
    for name, amax in before.items():
        if name not in searched:
            assert torch.equal(after[name], amax), name  # body scales and every weight scale untouched
        else:
            unit = next(u for u in units if name in u)
            start = amax * (1.5 if unit is units[0] else 1.0)
            torch.testing.assert_close(after[name], start * result["factors"][unit[0]])
    for group in info.scale_groups:  # a shared scale stays shared
        assert len({float(after[n]) for n in group if n in after}) <= 1, group


def test_head_candidates_run_only_their_branch(calibrated, images):
    """Off the GPU a head candidate runs only the branch whose scale it changes, from the first of its layers that
    holds the scale (``_Branches``), and its loss recomputes only the level parts that changed
    (``HeadDistillation``): the same choices, losses and amax in every bit as running the whole head per candidate,
    for a bounded count of convolutions: per batch, the whole head three times (the FP targets, the loss before, the
    branches' outputs kept), then each unit's layers once per candidate and once more with its kept scale. The
    whole-head path runs every head convolution per candidate."""
    import copy

    from utils.qat.quantize import head
    from utils.qat.quantize.state import amax_state
    qmodel, info = calibrated
    batches = [images, images.flip(-1)]
    units = head.searchable(qmodel, info.scale_groups)

    def search(branches: bool) -> tuple[dict, dict, int, dict]:
        model = copy.deepcopy(qmodel)
        modules = dict(model.named_modules())
        for n in units[0]:  # a scale coarse enough (3x) that the search moves it on any host's arithmetic
            modules[n].amax = modules[n].amax * 3.0
        detect = model.model[-1]
        runs: list[str] = []
        convs = {n: m for n, m in detect.named_modules() if isinstance(m, torch.nn.Conv2d)}
        for n, m in convs.items():
            m.register_forward_hook(lambda *_, n=n: runs.append(n))
        result = head.search_head_amax(model, batches, info.scale_groups, branches=branches)
        return result, amax_state(model), len(runs), convs

    (split, s_amax, s_runs, convs), (whole, w_amax, w_runs, _) = search(True), search(False)
    assert split == whole and split["factors"][units[0][0]] != 1.0
    assert s_amax.keys() == w_amax.keys() and all(torch.equal(s_amax[n], w_amax[n]) for n in w_amax)
    split_of = head._Branches(qmodel.model[-1], f"model.{len(qmodel.model) - 1}.")

    def convs_from(branch: str, start: int) -> int:  # the convolutions of a branch's layers from ``start`` on
        layers = list(split_of.modules[branch])[start:]
        return sum(1 for layer in layers for m in layer.modules() if isinstance(m, torch.nn.Conv2d))

    per_branch = {b: convs_from(b, 0) for b in split_of.modules}
    starts = [split_of.of(u) for u in units]
    candidates = len(head.FACTORS) - 1
    unit_convs = [sum(convs_from(b, s) for b, s in found.items()) for found in starts]
    whole_head = sum(per_branch.values())  # the convolutions of the head's training form (not the DFL's)
    assert len(per_branch) == 6 and whole_head >= 18 and whole_head == len(convs) - 1
    assert sum(1 for found in starts if min(found.values()) > 0) >= len(units) // 2  # units inside a branch
    assert s_runs == len(batches) * (3 * whole_head + (candidates + 1) * sum(unit_convs[:-1])
                                     + candidates * unit_convs[-1])
    assert w_runs == len(batches) * whole_head * (2 + candidates * len(units))
    assert 6 * s_runs < w_runs  # 538 against 3816 convolutions on this model


def test_head_loss_recomputes_only_what_changed(calibrated, images):
    """``HeadDistillation`` gives ``head_distillation``'s value in every bit, for a first student and for one that
    differs from it in one part of one level, whose other parts' terms it keeps (the same tensors)."""
    import copy

    from utils.qat.quantize.objectives import HeadDistillation, head_distillation
    from utils.qat.quantize.state import quantizers_off
    qmodel, _ = calibrated
    model = copy.deepcopy(qmodel)
    detect = model.model[-1]
    model.eval()
    detect.train()
    with torch.no_grad():
        student = model(images)
        with quantizers_off([m for n, m in model.named_modules() if n.endswith("_quantizer")]):
            teacher = model(images)
    loss = HeadDistillation(teacher, detect.reg_max, detect.nc)
    assert [len(level) for level in loss.kept] == [0, 0, 0]
    assert loss(student) == head_distillation(student, teacher, detect.reg_max, detect.nc)
    kept = [dict(level) for level in loss.kept]
    moved = [t.clone() for t in student]
    moved[1][:, 4 * detect.reg_max:] += 0.25  # level 1's class logits
    want = head_distillation(moved, teacher, detect.reg_max, detect.nc)
    assert loss(moved) == want and want["cls"] != head_distillation(student, teacher, detect.reg_max, detect.nc)["cls"]
    for i, level in enumerate(loss.kept):
        for part in ("cls", "box"):
            assert (level[part][1] is kept[i][part][1]) == ((i, part) != (1, "cls")), (i, part)


def test_head_in_fp_has_nothing_to_search(yolov9_tree, images, capsys):
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.model import checkpoint
    fp = checkpoint.load_fp(QS)
    qmodel, info = quantize(fp, [images], QuantConfig(method="max", skip=(str(len(fp.model) - 1),), head_amax="search"))
    assert "the head has no activation scale of its own to search" in capsys.readouterr().out
    assert info.to_dict()["head_amax"] == "search" and info.head_search == {}


def test_the_default_searches_and_records_its_choice(yolov9_tree, images, capsys):
    """quantize() with the default config searches the head's scales; what it chose travels in QuantInfo (and so in
    checkpoints and report.json), the factors being the ones the amax moved by."""
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.quantize.config import QuantInfo
    from utils.qat.model import checkpoint
    fp = checkpoint.load_fp(QS)
    plain, _ = quantize(fp, [images], QuantConfig(method="max", head_amax="calibrated"))
    qmodel, info = quantize(fp, [images], QuantConfig(method="max"))
    assert info.config.head_amax == "search" and "head amax search:" in capsys.readouterr().out
    record = info.head_search
    assert record["batches"] == 1 and record["loss_after"] <= record["loss_before"] and record["factors"]
    before, after = _amax(plain), _amax(qmodel)
    for name, factor in record["factors"].items():
        torch.testing.assert_close(after[name], before[name] * factor)
    assert QuantInfo.from_dict(info.to_dict()).head_search == record


def test_config_checks_and_records_the_choice():
    from utils.qat.quantize.config import QuantConfig, QuantInfo
    from utils.qat.core.errors import QATError
    with pytest.raises(QATError, match="--head-amax"):
        QuantConfig(head_amax="learned")
    info = QuantInfo(QuantConfig(head_amax="search"))
    assert QuantInfo.from_dict(info.to_dict()).config.head_amax == "search"
    assert QuantInfo.from_dict({"calib_method": "max"}).config.head_amax == "calibrated"  # older checkpoints


@pytest.mark.slow
def test_search_layers_scale_the_body_by_the_whole_networks_error(calibrated, images, capsys):
    """``--search-layers``: a body layer's scales searched through the whole network, before the head's; a
    deliberately clipping scale there (x0.5) is moved up, the loss falls, nothing outside the layer and the head
    moves, and the record names the layers."""
    import copy

    from utils.qat.quantize.head import BODY_FACTORS, search_head_amax, searchable
    qmodel, info = calibrated
    qmodel = copy.deepcopy(qmodel)
    units = searchable(qmodel, info.scale_groups, layers=(2,), head=False)
    assert units and all(n.startswith("model.2.") for u in units for n in u)
    modules = dict(qmodel.named_modules())
    for n in units[0]:
        modules[n].amax = modules[n].amax * 0.5
    before = _amax(qmodel)
    result = search_head_amax(qmodel, [images], info.scale_groups, layers=(2,), head=False)
    after = _amax(qmodel)
    assert result["loss_after"] < result["loss_before"] and result["layers"] == [2]
    assert set(result["factors"]) == {u[0] for u in units} and set(result["factors"].values()) <= set(BODY_FACTORS)
    assert result["factors"][units[0][0]] > 1.0  # the clipped scale opened up again
    searched = {n for u in units for n in u}
    for name, amax in before.items():
        if name not in searched:
            assert torch.equal(after[name], amax), name
    assert "body amax search:" in capsys.readouterr().out


@pytest.mark.slow
def test_search_layers_run_the_network_from_the_searched_layer(calibrated, images, monkeypatch):
    """The body search scores each candidate from the searched unit's layer on (the layers before it kept from one
    run): the same choices and the same losses, to the bit, as running the whole network for every candidate (every
    unit taken as starting at layer 0), and the first layer runs once per candidate of its own units only."""
    import copy

    from utils.qat.quantize import head
    qmodel, info = calibrated
    layers = (0, 3)
    batches = [images, images.flip(-1)]
    units = head.searchable(qmodel, info.scale_groups, layers=layers, head=False)
    assert [head._layer(u[0]) for u in units] == sorted(head._layer(u[0]) for u in units)
    assert {head._layer(u[0]) for u in units} == set(layers)
    own = sum(head._layer(u[0]) == 0 for u in units)

    def search(from_layer_0: bool) -> tuple[dict, int]:
        model = copy.deepcopy(qmodel)
        modules = dict(model.named_modules())
        for n in units[-1]:  # a clipped scale in the last layer searched, as in the test above
            modules[n].amax = modules[n].amax * 0.5
        runs = []
        model.model[0].register_forward_hook(lambda *_: runs.append(1))
        with monkeypatch.context() as m:
            if from_layer_0:
                m.setattr(head, "_layer", lambda name: 0)
            result = head.search_head_amax(model, batches, info.scale_groups, layers=layers, head=False)
        return {**result, "amax": _amax(model)}, len(runs)

    (prefix, prefix_runs), (whole, whole_runs) = search(False), search(True)
    assert prefix["factors"] == whole["factors"] and prefix["factors"][units[-1][0]] > 1.0
    assert prefix["loss_before"] == whole["loss_before"] and prefix["loss_after"] == whole["loss_after"]
    assert all(torch.equal(prefix["amax"][n], whole["amax"][n]) for n in whole["amax"])
    candidates = len(head.BODY_FACTORS) - 1
    # per batch: the FP targets, the loss before, then every candidate (whole) or layer 0's own candidates and
    # one run into layer 3 (from the searched layer)
    assert whole_runs == len(batches) * (2 + len(units) * candidates)
    assert prefix_runs == len(batches) * (2 + own * candidates + 1)


def _walked(factor: float, factors) -> int:
    """The candidates ``bounded`` scores for a unit that ended at ``factor``: up from 1 until the loss stops falling
    (the step that did not lower it included, unless the list ended), and down the same way only if the first step
    up did not lower it."""
    from utils.qat.quantize.head import downhill
    up, down = downhill(factors)
    if factor > 1.0:
        return up.index(factor) + 1 + (factor != up[-1])
    if factor == 1.0:
        return 1 + 1
    return 1 + down.index(factor) + 1 + (factor != down[-1])


@pytest.mark.slow
def test_bounded_search_walks_downhill_on_one_body_batch(calibrated, images):
    """``--search-cost bounded`` (the CPU's default): the forward passes are counted, not timed. A body candidate
    runs the network on the first batch only, and each unit's candidates stop where the loss stops falling: layer 0
    runs once per batch for the FP targets, once for the loss before, and once per candidate walked, where the full
    search runs it for all eight factors on every batch. The clipped scale still opens up, the loss still falls, and
    the head's candidates are walked the same way on every batch."""
    import copy

    from utils.qat.quantize import head
    qmodel, info = calibrated
    batches = [images, images.flip(-1), images.flip(-2)]
    units = head.searchable(qmodel, info.scale_groups, layers=(0,), head=False)

    def search(bounded: bool, with_head: bool = False) -> tuple[dict, int, int]:
        model = copy.deepcopy(qmodel)
        modules = dict(model.named_modules())
        for n in units[-1]:
            modules[n].amax = modules[n].amax * 0.5
        runs, heads = [], []
        model.model[0].register_forward_hook(lambda *_: runs.append(1))
        model.model[-1].register_forward_hook(lambda *_: heads.append(1))
        result = head.search_head_amax(model, batches, info.scale_groups, layers=(0,), head=with_head,
                                       bounded=bounded)
        return result, len(runs), len(heads)

    (full, full_runs, _), (bounded, bounded_runs, _) = search(False), search(True)
    assert full_runs == len(batches) * (2 + len(units) * (len(head.BODY_FACTORS) - 1))
    assert set(bounded["factors"]) == set(full["factors"]) == {u[0] for u in units}  # the same units, fewer runs
    walked = sum(_walked(bounded["factors"][u[0]], head.BODY_FACTORS) for u in units)
    assert bounded_runs == len(batches) + 1 + walked  # the targets, the loss before, the candidates walked
    assert bounded_runs < full_runs / 3
    assert bounded["factors"][units[-1][0]] > 1.0 and bounded["loss_after"] < bounded["loss_before"]
    assert bounded["batches"] == bounded["body"]["batches"] == 1  # body only: its loss is the record's
    assert bounded["loss_after"] == bounded["body"]["loss_after"]
    with_head, _, head_runs = search(True, with_head=True)
    assert with_head["body"]["batches"] == 1 and with_head["batches"] == len(batches)
    assert with_head["body"]["loss_after"] < with_head["body"]["loss_before"]
    # the head runs per batch for the FP targets, the branches' record and the head's loss before; per body candidate
    # (and the body's loss before) on one batch; per head candidate on every batch
    body_walks = sum(_walked(with_head["factors"][u[0]], head.BODY_FACTORS) for u in units)
    head_walks = sum(_walked(with_head["factors"][u[0]], head.FACTORS)
                     for u in head.searchable(qmodel, info.scale_groups))
    assert head_runs == 3 * len(batches) + 1 + body_walks + head_walks * len(batches)


def test_search_layers_auto_searches_detection_bodies_on_a_gpu_only():
    """``--search-layers auto`` (the default) is ``0-5`` for detection calibrated on a GPU, with the lower rate
    measured with it (docs/QAT_RECIPE.md 'The search as the default on a GPU'); none on a CPU, where it gained nothing
    (docs/QAT_CALIBRATION.md 'Calibrating on a CPU'), or for segmentation; ``--search-cost auto`` is ``bounded`` on a
    CPU. Each choice is said in a sentence naming the flag that changes it; layers, costs or ``none`` given are taken
    as given."""
    from utils.qat.core.errors import QATError
    from utils.qat.quantize.config import QuantConfig, parse_layers, resolve_cost, resolve_lr, resolve_search
    text, said = resolve_search("auto", "detect", "cuda")
    assert text == "0-5" and said.startswith("--search-layers auto: layers 0-5 searched on this GPU")
    assert "--search-layers none" in said
    for task, device, where in (("detect", "cpu", "on the CPU (no gain measured there)"),
                                ("segment", "cuda", "for segmentation"), ("segment", "cpu", "on the CPU")):
        text, said = resolve_search("auto", task, device)
        assert text == "" and where in said and said.endswith("pass --search-layers 0-5 to search them."), said
    assert resolve_search("none", "detect", "cuda") == ("", None)
    assert resolve_search("2,4", "segment", "cpu") == ("2,4", None)
    assert resolve_cost("auto", "cuda") == ("full", None)
    cost, said = resolve_cost("auto", "cpu")
    assert cost == "bounded" and "pass --search-cost full" in said
    assert resolve_cost("full", "cpu") == ("full", None) and resolve_cost("bounded", "cuda") == ("bounded", None)
    with pytest.raises(QATError, match="--search-cost 'some': choose one of full, bounded or auto"):
        resolve_cost("some", "cpu")
    with pytest.raises(QATError, match="unknown --search-cost"):
        QuantConfig(search_cost="auto")
    assert resolve_lr(None, parse_layers("0-5"), 3e-5) == 1e-5
    assert resolve_lr(None, parse_layers(""), 3e-5) == 3e-5
    assert resolve_lr(2e-4, parse_layers("0-5"), 3e-5) == 2e-4


def test_search_layers_checked_and_recorded(calibrated):
    from utils.qat.quantize.config import QuantConfig, QuantInfo, parse_layers
    from utils.qat.quantize.head import check_layers
    from utils.qat.core.errors import QATError
    from utils.qat.quantize.head import span
    assert parse_layers("2-4, 7") == (2, 3, 4, 7) and parse_layers("") == ()
    assert span(parse_layers("7,2-4,9,10")) == "2-4,7,9-10"
    for bad in ("a", "4-2", "1-", "-3"):
        with pytest.raises(QATError, match="--search-layers"):
            parse_layers(bad)
    qmodel, _ = calibrated
    head = len(qmodel.model) - 1
    check_layers(qmodel, range(head))
    with pytest.raises(QATError, match=f"layers before its detect head are 0-{head - 1}"):
        check_layers(qmodel, [head])
    config = QuantConfig(search_layers=(4, 2, 2), head_amax="calibrated")
    assert config.search_layers == (2, 4) and config.searches
    assert QuantInfo.from_dict(QuantInfo(config).to_dict()).config.search_layers == (2, 4)
    assert QuantInfo.from_dict({"calib_method": "max"}).config.search_layers == ()  # older checkpoints
