"""Calibration sized for a CPU: histograms built from a bounded sample of each batch's activations
(``--calib-sample``, utils/qat/quantize/calib.py), the head search's FP targets taken from calibration's own pass
(utils/qat/quantize/head.py), and freed memory kept for the next tensors (utils/qat/core/device.py). On the embedded
GELAN-QS model and real COCO images."""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import real_images

REPO = Path(__file__).resolve().parents[1]
QS = REPO / "weights" / "gelan-qs-shapes.pt"
IMGSZ = 96


@pytest.fixture(scope="module")
def images(shared):
    return real_images(shared / "datasets" / "coco369" / "images" / "train2017", 4, IMGSZ)


def test_sample_values_bounded_and_spread(yolov9_tree):
    """About ``per_image`` values of each image, every k-th with k a prime set by the image's size (no column
    picked over and over; a last batch of one image sampled as densely as a full one), the same sample for the same
    tensor; an image within the budget is given whole."""
    from utils.qat.quantize.calib import sample_values
    g = torch.Generator().manual_seed(0)
    x = torch.nn.functional.silu(torch.randn(2, 8, 40, 40, generator=g) * 3)
    assert sample_values(x, 12800) is x and sample_values(x, 0) is x
    s = sample_values(x, 500)
    step = 29  # the least prime >= 12800 / 500
    assert torch.equal(s, x.reshape(-1)[::step]) and s.numel() <= 2 * 500
    assert torch.equal(s, sample_values(x.clone(), 500))
    one = sample_values(x[:1], 500)  # one image: the same stride
    assert torch.equal(one, x[:1].reshape(-1)[::step]) and one.numel() <= 500
    columns = {i % 40 for i in range(0, x.numel(), step)}
    assert len(columns) == 40  # a round stride (25, 40) would keep to a few columns
    channel_last = x.contiguous(memory_format=torch.channels_last)  # not contiguous: copied, same values
    assert torch.equal(sample_values(channel_last, 500), s)


def test_collect_sample_counts_the_sample_over_the_whole_range(yolov9_tree):
    """A sampled histogram has modelopt's bins for the whole tensor (its range from every value, extended by whole
    bins for a wider batch) and counts only the sample: the largest value is not counted when the stride passes it
    by; a tensor within the budget is counted whole, as modelopt counts it."""
    from modelopt.torch.quantization.calib import HistogramCalibrator
    from utils.qat.quantize.calib import collect_sample, sample_values
    g = torch.Generator().manual_seed(1)
    first = torch.nn.functional.silu(torch.randn(2, 8, 40, 40, generator=g) * 3)
    first[1, 5, 7, 9] = -50.0  # the largest magnitude, where a stride of 29 does not land
    wider = first * 1.5
    whole, sampled = HistogramCalibrator(num_bits=8, unsigned=False), HistogramCalibrator(num_bits=8, unsigned=False)
    for x in (first, wider):
        whole.collect(x)
        collect_sample(sampled, 500, x)
    assert torch.equal(sampled._calib_bin_edges, whole._calib_bin_edges) and float(whole._calib_bin_edges[-1]) >= 75
    counted = sum(sample_values(x, 500).numel() for x in (first, wider))
    assert float(sampled._calib_hist.sum()) == counted < float(whole._calib_hist.sum()) / 20
    assert float(sampled._calib_hist[-8:].sum()) == 0  # the two largest values (50, 75): not in the sample
    small = HistogramCalibrator(num_bits=8, unsigned=False)
    collect_sample(small, 12800, first)
    fresh = HistogramCalibrator(num_bits=8, unsigned=False)
    fresh.collect(first)
    assert torch.equal(small._calib_hist, fresh._calib_hist)


def test_sampled_histograms_bounded_and_close_to_every_value(yolov9_tree, images, monkeypatch):
    """With ``sample`` each histogram calibrator counts at most ``sample`` values per image of each tensor it is
    given (the bound on its cost), its range is the whole tensor's, and the amax it gives lies near the one from
    every value."""
    from modelopt.torch.quantization.calib import HistogramCalibrator
    from utils.qat.model import checkpoint
    from utils.qat.quantize import calib
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    batches = [images[:3], images[3:]]  # a last batch of one image, as calibration's usually is
    fp = checkpoint.load_fp(QS)
    whole, _ = quantize(fp, batches, QuantConfig(method="mse", head_amax="calibrated"))
    per_image = 4000
    bounds: dict[int, int] = {}  # per calibrator: what its calls may count (one more per call: a partial stride)
    collect = calib.collect_sample

    def bounded(c, budget, x):
        bounds[id(c)] = bounds.get(id(c), 0) + len(x) * min(x[0].numel(), budget) + 1
        return collect(c, budget, x)
    monkeypatch.setattr(calib, "collect_sample", bounded)
    sampled, info = quantize(fp, batches, QuantConfig(method="mse", head_amax="calibrated", sample=per_image))
    assert info.config.sample == per_image
    pairs = [(a, b) for a, b in zip(whole.modules(), sampled.modules())
             if isinstance(getattr(a, "_calibrator", None), HistogramCalibrator) and a.is_enabled]
    assert len(pairs) > 40 and len(bounds) == len(pairs)
    logs = []  # log(sampled amax / every value's) where the budget was binding
    for a, b in pairs:
        ca, cb = a._calibrator, b._calibrator
        counted, every = float(cb._calib_hist.sum()), float(ca._calib_hist.sum())
        assert counted <= bounds[id(cb)]
        assert float(cb._calib_bin_edges[-1]) == pytest.approx(float(ca._calib_bin_edges[-1]), rel=1e-6)
        if counted < every / 2:
            logs.append(math.log(float(b.amax) / float(a.amax)))
    assert len(logs) > 20  # the budget was binding for many of them
    logs = torch.tensor(logs)
    # close, and no bias: the largest value counted in every thin sample gave +17% on YOLOv9-t, 4096 per image
    assert float(logs.abs().median()) < 0.05 and abs(float(logs.mean())) < 0.05


def test_calib_sample_auto_samples_on_a_cpu_only():
    """``--calib-sample auto`` (the default): every value on a GPU (where the published GPU figures were made),
    :data:`CPU_SAMPLE` values per image on a CPU, said in a sentence naming the flag; numbers and ``all`` as given;
    anything else refused with a sentence; the choice travels in QuantInfo (older checkpoints: every value)."""
    from utils.qat.core.errors import QATError
    from utils.qat.quantize.config import CPU_SAMPLE, QuantConfig, QuantInfo, resolve_sample
    assert resolve_sample("auto", "cuda") == (0, None)
    value, said = resolve_sample("auto", "cpu")
    assert value == CPU_SAMPLE and said.startswith("--calib-sample auto:") and "--calib-sample all" in said
    assert resolve_sample("all", "cpu") == (0, None) and resolve_sample("5000", "cuda") == (5000, None)
    for bad in ("0", "-3", "many", "1e6"):
        with pytest.raises(QATError, match="--calib-sample"):
            resolve_sample(bad, "cpu")
    with pytest.raises(QATError, match="calibration sample"):
        QuantConfig(sample=-1)
    info = QuantInfo(QuantConfig(sample=4096))
    assert QuantInfo.from_dict(info.to_dict()).config.sample == 4096
    assert QuantInfo.from_dict({"calib_method": "mse"}).config.sample == 0


def test_search_targets_come_from_calibrations_pass(yolov9_tree, images, monkeypatch):
    """calibrate() keeps the head's inputs of the batches the search scores on, as its own pass gave them (its
    quantizers collect and do not quantize: the FP network); the search makes its FP targets from them instead of
    running the body again: the same choices, losses and amax in every bit, one body pass fewer per batch."""
    import dataclasses

    from utils.qat.model import checkpoint
    from utils.qat.quantize import head
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.quantize.state import amax_state
    batches = [images[:2], images[2:]]
    fp = checkpoint.load_fp(QS)
    runs = {"n": 0}
    body_run = head._HeadInputs.run

    def counted(self, model, x):
        runs["n"] += 1
        return body_run(self, model, x)
    monkeypatch.setattr(head._HeadInputs, "run", counted)
    config = QuantConfig(method="mse", head_batches=2)
    searched, info = quantize(fp, batches, config)
    assert runs["n"] == len(batches)  # the quantized body's run per batch; none for the FP targets
    plain, plain_info = quantize(fp, batches, dataclasses.replace(config, head_amax="calibrated"))
    runs["n"] = 0
    again = head.search_head_amax(plain, batches, plain_info.scale_groups)
    assert runs["n"] == 2 * len(batches)
    assert again == info.head_search and again["factors"]
    want, got = amax_state(plain), amax_state(searched)
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_freed_memory_is_kept_for_the_next_tensor(tmp_path):
    """After ``keep_freed_memory`` a large tensor freed and allocated again comes back without page faults (once
    glibc has settled); before it, glibc unmapped it and every page faulted in again (glibc Linux; elsewhere it says it did nothing)."""
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(REPO)!r})
        import torch
        from utils.qat.core.device import keep_freed_memory

        def faults():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(4):
                torch.ones(64 << 18)  # 64 MiB, freed at once
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        faults()
        unmapped = faults()
        kept = keep_freed_memory()
        faults(), faults()  # glibc settles into reusing the block within a few rounds
        print(unmapped, faults() if kept else -1)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    unmapped, kept = (int(v) for v in out.stdout.split())
    import platform
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        assert kept == -1
        return
    assert unmapped > 4 * 16000 * 0.9  # every 4 KiB page of each 64 MiB tensor, each time
    assert 0 <= kept < unmapped / 20
