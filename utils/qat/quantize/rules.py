"""Where the Q/DQ nodes go in a YOLOv9 model, and which of them must share one scale.

Placement follows what TensorRT needs to run a network fully in INT8:

* every Conv: INT8 weights per output channel, INT8 input per tensor (modelopt's own QuantConv2d);
* extra input quantizers where TensorRT needs Q/DQ to fuse: Concat inputs, Upsample input, both
  inputs of the residual Add in RepNBottleneck, the average pool of ADown / AConv, MaxPool;
* the detect head's DFL conv stays in floating point.

Scale sharing is derived from the model itself: one forward pass is traced and every tensor is
followed through the operations that leave its INT8 scale unchanged for TensorRT (concatenation,
chunk/split, max/avg pooling, nearest upsampling). All input quantizers that read a tensor of one
such connected set must carry one amax, otherwise TensorRT inserts INT8<->FP16 reformat layers.
This works for every model size, the dual-head yolov9-* models and custom yamls alike.
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from utils.qat.quantize.modelopt_import import mtq  # modelopt without its unused plugins: first
from modelopt.torch.quantization.nn import QuantModuleRegistry, TensorQuantizer

from models import common
from utils.qat.core.errors import QATError

ACTIVATION = {"num_bits": 8, "axis": None}  # per tensor, symmetric (zero point 0)
WEIGHT = {"num_bits": 8, "axis": 0}  # per output channel
ALWAYS_FP = ["*dfl*"]
UNQUANTIZED_PARENTS = ("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LeakyReLU")  # distribution focal loss decode conv of the detect heads

# Operations TensorRT lets an INT8 scale pass through unchanged.
SCALE_TRANSPARENT = {"cat", "concat", "concatenate", "chunk", "split", "tensor_split", "unbind",
                     "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "interpolate", "upsample_nearest2d",
                     "__getitem__", "contiguous", "clone"}


def int8_config(fp_patterns: Sequence[str] = ()) -> dict:
    """modelopt quantization config: INT8 everywhere TensorRT wants it, FP for ``fp_patterns``."""
    cfg = [{"quantizer_name": "*", "enable": False},
           {"quantizer_name": "*weight_quantizer", "cfg": dict(WEIGHT)},
           {"quantizer_name": "*input_quantizer", "cfg": dict(ACTIVATION)}]
    # modelopt also quantizes these by default; TensorRT fuses them into the conv before them instead
    cfg += [{"quantizer_name": "*", "parent_class": cls, "enable": False} for cls in UNQUANTIZED_PARENTS]
    cfg += [{"quantizer_name": p if p.endswith("quantizer") else f"{p}*", "enable": False}
            for p in [*ALWAYS_FP, *fp_patterns]]
    return {"quant_cfg": cfg, "algorithm": None}


# ---- quantized twins of YOLOv9 modules (joined through modelopt's registry) -------------------

class QuantConcat(common.Concat):
    """Concat with one input quantizer applied to every input: one scale for all of them."""

    def _setup(self):
        self.input_quantizer = TensorQuantizer()

    def forward(self, x):
        return torch.cat([self.input_quantizer(t) for t in x], self.d)


class QuantRepNBottleneck(common.RepNBottleneck):
    """Residual Add with Q/DQ on both inputs, so TensorRT fuses it into the conv in INT8."""

    def _setup(self):
        self.residual_input_quantizer = TensorQuantizer()
        self.branch_input_quantizer = TensorQuantizer()

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        if not self.add:
            return y
        return self.residual_input_quantizer(x) + self.branch_input_quantizer(y)


def quantized_avg_pool(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """ADown's and AConv's 2x2 average pool over their quantized input. With ``module.integer_pool`` set (by
    ``utils.qat.quantize.integer_conv.integer_form``, for scoring) it averages the integer codes, exactly, and scales
    once after, as an INT8 runtime does: the average of four float products otherwise rounds by its summation order."""
    quantizer = module.avgpool_input_quantizer
    x = quantizer(x)
    if not (getattr(module, "integer_pool", False) and quantizer.is_enabled and quantizer.amax is not None
            and quantizer.amax.numel() == 1):
        return F.avg_pool2d(x, 2, 1, 0, False, True)
    from utils.qat.quantize.qdq import qdq_scale
    scale = qdq_scale(quantizer.amax)
    return F.avg_pool2d(torch.round(x.float() / scale), 2, 1, 0, False, True) * scale


class QuantADown(common.ADown):
    def _setup(self):
        self.avgpool_input_quantizer = TensorQuantizer()
        self.maxpool_input_quantizer = TensorQuantizer()

    def forward(self, x):
        x = quantized_avg_pool(self, x)
        x1, x2 = x.chunk(2, 1)
        x1 = self.cv1(x1)
        x2 = self.cv2(F.max_pool2d(self.maxpool_input_quantizer(x2), 3, 2, 1))
        return torch.cat((x1, x2), 1)


class QuantAConv(common.AConv):
    def _setup(self):
        self.avgpool_input_quantizer = TensorQuantizer()

    def forward(self, x):
        return self.cv1(quantized_avg_pool(self, x))


class QuantUpsample(nn.Upsample):
    def _setup(self):
        self.input_quantizer = TensorQuantizer()

    def forward(self, x):
        return super().forward(self.input_quantizer(x))


TWINS = {common.Concat: QuantConcat, common.RepNBottleneck: QuantRepNBottleneck, common.ADown: QuantADown,
         common.AConv: QuantAConv, nn.Upsample: QuantUpsample}


def register_yolov9_modules() -> None:
    """Register the quantized twins and the QuantizeLinear-exact rounding with modelopt (idempotent;
    needed before quantize and restore)."""
    from utils.qat.quantize import qdq
    qdq.register()
    for original, twin in TWINS.items():
        if QuantModuleRegistry.get(original) is None:
            mtq.register(original_cls=original, quantized_cls=twin)


# ---- layers kept in floating point ------------------------------------------------------------

def fp_patterns(model: nn.Module, skip: Iterable[str | int]) -> list[str]:
    """Turn ``--skip-layers`` items (layer indices of ``model.model`` or module-name patterns) into
    module-name patterns. An index out of range or a pattern that matches nothing is an error."""
    layers = getattr(model, "model", None)
    n_layers = len(layers) if layers is not None else 0
    names = [n for n, _ in model.named_modules()]
    patterns = []
    for item in skip:
        item = str(item).strip()
        if not item:
            continue
        if item.lstrip("-").isdigit():
            i = int(item)
            if not 0 <= i < n_layers:
                from utils.qat.core.yolov9 import task_of_model
                script = "segment/qat_seg.py" if task_of_model(model) == "segment" else "qat.py"
                raise QATError(f"--skip-layers {i} is not a layer of this model (it has layers 0..{n_layers - 1}); "
                               f"run `{script} sensitive` to list the layers and their impact.")
            patterns.append(f"model.{i}.")
        else:
            if not any(fnmatch.fnmatch(n, item) or fnmatch.fnmatch(n, f"{item}.*") for n in names):
                raise QATError(f"--skip-layers pattern '{item}' matches no module of this model; "
                               "use a layer index or a module name such as 'model.22.*'.")
            patterns.append(item)
    return patterns


# ---- shared scales, derived from one traced forward pass ----------------------------------------

class _FlowRecorder(TorchFunctionMode):
    """Records which tensors a scale-transparent operation (one of ``transparent``) connects."""

    def __init__(self, transparent: set[str] = SCALE_TRANSPARENT):
        super().__init__()
        self.transparent = transparent
        self.links: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in self.transparent:
            self.links.append((flat_tensors((args, kwargs)), flat_tensors(out)))
        return out


def flat_tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a module's output (nested lists, tuples and dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in flat_tensors(o)]
    return []


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, a):
        self.parent.setdefault(a, a)
        while self.parent[a] != a:
            self.parent[a] = self.parent[self.parent[a]]
            a = self.parent[a]
        return a

    def union(self, a, b):
        self.parent[self.find(a)] = self.find(b)


def input_quantizers(model: nn.Module, enabled_only: bool = True) -> dict[str, TensorQuantizer]:
    return {n: m for n, m in model.named_modules()
            if isinstance(m, TensorQuantizer) and n.endswith("input_quantizer") and (m.is_enabled or not enabled_only)}


@torch.no_grad()
def scale_groups(model: nn.Module, example: torch.Tensor, shared_pool: bool = True) -> list[list[str]]:
    """Groups (of two or more) of enabled input-quantizer names that must share one amax. ``shared_pool=False``:
    an average pool's output is not tied to its input (its quantizer keeps its own calibrated amax)."""
    from utils.qat.quantize.state import quantizers_off
    quantizers = input_quantizers(model)
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in quantizers}
    keep: list[torch.Tensor] = []  # keeps traced tensors alive, so their ids stay unique
    hooks = [q.register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0])) for n, q in quantizers.items()]
    recorder = _FlowRecorder(SCALE_TRANSPARENT if shared_pool else SCALE_TRANSPARENT - {"avg_pool2d"})
    training = model.training
    try:
        model.eval()
        with quantizers_off(m for m in model.modules() if isinstance(m, TensorQuantizer)), recorder:
            keep.append(model(example))
    finally:
        for h in hooks:
            h.remove()
        model.train(training)

    uf = _UnionFind()
    for inputs, outputs in recorder.links:
        keep.extend(inputs + outputs)
        for t in inputs[1:] + outputs:
            uf.union(id(inputs[0]) if inputs else id(t), id(t))
    for name, tensors in seen.items():
        keep.extend(tensors)
        for t in tensors:
            uf.union(("q", name), id(t))
    groups: dict = {}
    for name in quantizers:
        groups.setdefault(uf.find(("q", name)), []).append(name)
    return [sorted(g) for g in groups.values() if len(g) > 1]


def tie_scales(model: nn.Module, groups: list[list[str]],
               group_amax: Callable[[list[str]], torch.Tensor | None] | None = None) -> int:
    """Give every quantizer of a group one amax: ``group_amax(group)`` where it gives one, else the group's
    largest. Returns the number of groups tied."""
    modules = dict(model.named_modules())
    for group in groups:
        amaxes = [modules[n].amax for n in group]
        if any(a is None for a in amaxes):
            missing = [n for n, a in zip(group, amaxes) if a is None]
            raise RuntimeError(f"quantizers without amax (not calibrated): {missing}")
        shared = group_amax(group) if group_amax is not None else None
        if shared is None:
            shared = torch.stack([a.detach().float().max() for a in amaxes]).max()
        shared = shared.to(amaxes[0].device)
        for n in group:
            modules[n].amax = shared.clone()
    return len(groups)
