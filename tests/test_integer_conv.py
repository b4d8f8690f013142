"""The integer form a quantized model is evaluated in (utils/qat/quantize/integer_conv.py): convolutions summed from
integer codes, exactly, so that neither the kernel nor the thread count moves a bit of the output."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
QS = REPO / "weights" / "gelan-qs-shapes.pt"


@pytest.fixture(scope="module")
def quantized(shapes):
    """The embedded model, calibrated on 4 of its images at 128 px, and 4 more images to run it on."""
    import yaml

    from helpers import real_images
    from utils.qat.model import checkpoint
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    train = Path(yaml.safe_load(shapes.read_text())["train"])
    train = train if train.is_absolute() else shapes.parent / train
    images = real_images(train, 8, 128)
    fp = checkpoint.load_fp(QS)
    qmodel, _ = quantize(fp, [images[:4]], QuantConfig(method="max", head_amax="calibrated"), example=images[:1])
    return qmodel.eval(), images[4:]


def _threads(n: int, fn):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


def test_integer_form_is_the_same_at_every_thread_count(quantized):
    """Every quantized convolution becomes an IntegerConv2d; its output is the fake-quantized convolution's to within
    float32 rounding of the same products, and the head's maps (every quantized layer's work) are the same in every
    bit with one thread and with two. The floating-point decode after them (the DFL convolution, left in float) may
    differ in the last bit, 1e-4 px here."""
    from utils.qat.quantize.integer_conv import IntegerConv2d, convertible, integer_form
    qmodel, images = quantized
    exact = integer_form(qmodel)
    converted = [m for m in exact.modules() if isinstance(m, IntegerConv2d)]
    left = [n for n, m in exact.named_modules() if convertible(m)]
    assert len(converted) > 50 and not left
    assert any(isinstance(m, torch.nn.Conv2d) and not isinstance(m, IntegerConv2d) for m in exact.modules())  # DFL
    assert sum(type(m).__name__ == "IntegerConv2d" for m in qmodel.modules()) == 0  # the model itself unchanged
    with torch.no_grad():
        one = _threads(1, lambda: exact(images))
        two = _threads(2, lambda: exact(images))
        assert all(torch.equal(a, b) for a, b in zip(one[1], two[1]))  # the head's three maps
        assert torch.allclose(one[0], two[0], rtol=1e-6, atol=1e-3)
        conv = next(m for m in qmodel.modules() if convertible(m))
        x = torch.randn(2, conv.in_channels, 16, 16) * conv.input_quantizer.amax
        fake, integer = conv(x), IntegerConv2d(conv)(x)
        assert torch.allclose(fake, integer, rtol=0, atol=1e-5 * fake.abs().max().item())


def test_integer_sums_are_exact_and_wide_where_float32_could_round():
    """The sum of codes equals the float64 sum of the same codes; a convolution whose partial sums could pass 2**24
    sums in float64 instead (and rounds back), with the same result."""
    from utils.qat.quantize.modelopt_import import mtq  # modelopt without its unused plugins: first
    from utils.qat.quantize import qdq
    from utils.qat.quantize.integer_conv import IntegerConv2d
    from utils.qat.quantize.rules import int8_config, register_yolov9_modules
    register_yolov9_modules()
    torch.manual_seed(0)
    for channels, wide in ((16, False), (2048, True)):  # 16 x 9 x 127 x 128 < 2**24 < 2048 x 9 x 127 x 128
        net = torch.nn.Sequential(torch.nn.Conv2d(channels, 4, 3, padding=1))
        net[0].weight.data = torch.randn_like(net[0].weight)
        net[0].weight.data[:, :, 0, 0] = 10.0  # every weight code of the first tap 127: the bound is reached
        batches = [torch.rand(2, channels, 6, 6) * 4]
        config = {**int8_config(), "algorithm": "max"}
        qnet = mtq.quantize(net, config, forward_loop=lambda m: [m(b) for b in batches])
        qdq.use_qdq_rounding(qnet)
        conv = IntegerConv2d(qnet[0])
        assert conv.float32_exact is not wide
        x = batches[0]
        with torch.no_grad():
            codes = torch.round(qnet[0].input_quantizer(x) / qdq.qdq_scale(qnet[0].input_quantizer.amax))
            reference = torch.nn.functional.conv2d(codes.double(), conv.weight_codes.double(), padding=1)
            expected = reference.float() * (qdq.qdq_scale(qnet[0].input_quantizer.amax) * conv.weight_scale)
            assert torch.equal(conv(x), expected + conv.bias)


def test_exact_silu_rounds_once_and_the_jitter_is_one_step_on_half():
    """ExactSiLU is ``x * float32(sigmoid64(x))``; with a UlpJitter (measurement only) a random half of the sigmoids
    moves one float32 step, up or down alike, and the same seed draws the same steps again."""
    from utils.qat.quantize.integer_conv import ExactSiLU, UlpJitter
    x = torch.linspace(-20, 20, 100_001)
    exact = ExactSiLU()(x)
    sigmoid = (1 / (1 + torch.exp(-x.double()))).float()
    assert torch.equal(exact, x * sigmoid)
    assert torch.allclose(exact, torch.nn.functional.silu(x), rtol=1e-6, atol=1e-7)
    jittered = UlpJitter(3)(sigmoid)
    assert torch.equal(jittered, UlpJitter(3)(sigmoid)) and not torch.equal(jittered, UlpJitter(4)(sigmoid))
    moved = jittered != sigmoid
    steps = (jittered.double() - sigmoid.double())[moved]
    up, down = torch.nextafter(sigmoid, torch.tensor(2.0)), torch.nextafter(sigmoid, torch.tensor(0.0))
    assert torch.all((jittered[moved] == up[moved]) | (jittered[moved] == down[moved]))
    assert 0.47 < moved.float().mean() < 0.53 and 0.45 < (steps > 0).float().mean() < 0.55
    assert torch.equal(ExactSiLU(UlpJitter(3))(x), x * jittered)
