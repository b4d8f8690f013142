"""What a quantization is made of, as plain data importable without modelopt or torch.

    config = QuantConfig(method="mse", skip=("22",))          # what the user chose
    qmodel, info = quantize(fp_model, batches, config)       # utils/qat/quantize/model_quant.py: info records the result

qat.py's argument parser needs the methods and defaults; importing modelopt starts CUDA (it asks
``torch.cuda.is_available()``), and in a multi-GPU run CUDA must not start before ``--device`` has narrowed
CUDA_VISIBLE_DEVICES (``utils/qat/core/device.py``). tests/test_quantize.py checks this module stays light.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from utils.qat.core.errors import QATError

CALIB_METHODS = ("max", "percentile", "mse", "entropy", "mse-image")  # mse-image: every image weighs alike
DEFAULT_CALIB_METHOD = "mse"  # detection models
# Per task, as measured (docs/QAT_CALIBRATION.md "`mse-image` on the GPU, and the calibration default per task"):
# mse-image keeps the shapes segmentation set's few outlier images from stretching the scales (QAT mask 0.8239 /
# 0.8230 against 0.8064 from mse); on the three detection models mse calibrates higher (PTQ +0.0003 to +0.0017) and
# GELAN-C ends higher from it.
DEFAULT_CALIB_METHODS = {"detect": DEFAULT_CALIB_METHOD, "segment": "mse-image"}
DEFAULT_PERCENTILE = 99.99
HEAD_AMAX = ("calibrated", "search")  # the detect head's input scales: as calibrated, or searched (head.py)
# GELAN-C and GELAN-S end best from the searched scales (docs/QAT_CALIBRATION.md "The head's scales searched, then QAT")
DEFAULT_HEAD_AMAX = "search"
TIES = ("max", "mse")  # one amax for a shared-scale group: its members' largest, or the group's least squared error
DEFAULT_TIE = "max"
# An average pool's output (AConv, ADown): on its input's scale, or calibrated on its own. ``own`` is the default: with
# the shared scale a quarter of the averages of INT8 values land exactly on a rounding tie, which each runtime (PyTorch
# on a GPU or a CPU, at any thread count, ONNX Runtime at each optimization level, OpenVINO, TensorRT) breaks its own
# way, so one model scored 0.4019-0.4072 on four of them (docs/RESULTS.md "One model, one score"). TensorRT runs
# DQ -> AveragePool -> Q as one INT8 pooling with an input and an output scale either way (docs/TENSORRT.md).
POOL_SCALES = ("shared", "own")
DEFAULT_POOL_SCALE = "own"
LEGACY_POOL_SCALE = "shared"  # checkpoints written before the key existed were all made with the shared scale
DEFAULT_HEAD_BATCHES = 4  # calibration batches the head search scores each candidate on

# ``--search-layers auto`` (the default): detection models calibrated on a GPU search their first layers' scales and
# fine-tune at SEARCHED_LR, measured so (docs/QAT_RECIPE.md "The search as the default on a GPU"): on YOLOv9-t, every
# searched calibration scored above every one without the search (PTQ 0.4009-0.4044 against 0.3992-0.3999), and its
# epochs and graphs met FP - 0.001 / 0.002; the memorised GELAN-C calibrates to the same mean with it and GELAN-S
# fine-tunes level. On a CPU, calibrated as a CPU calibrates (--calib-sample), it bought nothing: yolov9-t-coco's PTQ
# scored 0.3974-0.3998 with layers 0-2 searched (three ways, bounded and not) against 0.4001 without, for 20-80 s more
# (docs/QAT_CALIBRATION.md "Calibrating on a CPU"); segmentation has not been measured with it: none there either.
# ``--calib-sample auto``: on a CPU each activation histogram is built from about this many values of each image
# (calib.sample_values); on a GPU from all of them, as the published GPU figures were made.
CPU_SAMPLE = 1 << 14
AUTO_SEARCH = "0-5"
SEARCHED_LR = 1e-5
# ``--search-cost``: how many forward passes the searches may take. ``full`` scores every factor of every unit on
# ``head_batches`` batches (the published GPU figures); ``bounded`` (``auto`` on a CPU) walks each unit's factors
# downhill from 1 and scores a body layer's candidates on the first batch only (utils/qat/quantize/head.py).
SEARCH_COSTS = ("full", "bounded")


def resolve_search(text: str, task: str, device_type: str) -> tuple[str, str | None]:
    """``--search-layers`` with ``auto`` and ``none`` resolved to what is searched: layer text for
    :func:`parse_layers`, and the sentence saying what ``auto`` chose here (None when the user chose)."""
    if text == "none":
        return "", None
    if text != "auto":
        return text, None
    if task == "detect" and device_type == "cuda":
        return AUTO_SEARCH, (f"--search-layers auto: layers {AUTO_SEARCH} searched on this GPU (detection); pass "
                             f"--search-layers none to calibrate without the search.")
    where = "on the CPU (no gain measured there)" if device_type != "cuda" else "for segmentation (not measured with it)"
    return "", (f"--search-layers auto: no body layer searched {where}; pass --search-layers {AUTO_SEARCH} to "
                f"search them.")


def resolve_cost(text: str, device_type: str) -> tuple[str, str | None]:
    """``--search-cost``: ``auto`` (``bounded`` on a CPU, ``full`` on a GPU) or one of :data:`SEARCH_COSTS`; returns
    the cost and the sentence saying what ``auto`` chose (None when the user chose, or on a GPU)."""
    if text == "auto":
        if device_type == "cuda":
            return "full", None
        return "bounded", ("--search-cost auto: bounded on the CPU (each scale walked downhill from its calibrated "
                           "value, body layers scored on one batch); pass --search-cost full for every candidate.")
    if text not in SEARCH_COSTS:
        raise QATError(f"--search-cost '{text}': choose one of {', '.join(SEARCH_COSTS)} or auto.")
    return text, None


def resolve_sample(text: str, device_type: str) -> tuple[int, str | None]:
    """``--calib-sample``: ``auto`` (:data:`CPU_SAMPLE` on a CPU, every value on a GPU), ``all`` or a number of values
    per image; returns the number (0: all) and the sentence saying what ``auto`` chose (None when the user chose)."""
    if text == "auto":
        if device_type == "cuda":
            return 0, None
        return CPU_SAMPLE, (f"--calib-sample auto: each activation histogram built from {CPU_SAMPLE} values of each "
                            f"image on the CPU; pass --calib-sample all for every value (slower).")
    if text == "all":
        return 0, None
    if not text.isdigit() or int(text) < 1:
        raise QATError(f"--calib-sample '{text}': give a number of values per image (e.g. {CPU_SAMPLE}), all, or auto.")
    return int(text), None


def resolve_lr(lr: float | None, layers: tuple[int, ...], default: float) -> float:
    """``--lr`` as given, else :data:`SEARCHED_LR` where body layers are searched, else ``default``."""
    if lr is not None:
        return lr
    return SEARCHED_LR if layers else default


def parse_layers(text: str) -> tuple[int, ...]:
    """``--search-layers`` once resolved: layer indices and ranges, ``2-5`` or ``1,3,6-8`` (empty: none)."""
    layers: set[int] = set()
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        first, sep, last = item.partition("-")
        if not (first.isdigit() and (not sep or last.isdigit())) or (sep and int(last) < int(first)):
            raise QATError(f"--search-layers '{text}': give layer indices and ranges such as 2-5 or 1,3,6-8, or auto or "
                          f"none.")
        layers.update(range(int(first), int(last if sep else first) + 1))
    return tuple(sorted(layers))


@dataclass(frozen=True)
class QuantConfig:
    """The settings of a quantization: the activation calibration method (weights are always per-channel
    max), the percentile (``method="percentile"``) and the layers kept in FP (``--skip-layers`` items: layer
    indices of ``model.model`` or module-name patterns), and how the detect head's input scales are chosen
    (``head_amax``: ``calibrated`` like every other, or ``search``ed by the head's output error, scoring each
    candidate on ``head_batches`` calibration batches), the body layers whose activation scales are searched the
    same way first (``search_layers``: indices of ``model.model``), and how a shared-scale group gets its one amax
    (``tie``: ``max``, its members' largest; ``mse``, the value with the least squared error summed over the
    members' histograms), and whether an average pool's output shares its input's scale (``pool_scale="shared"``)
    or is calibrated on its own (``"own"``: its averages of INT8 values then stop landing on rounding ties, which
    each runtime's float arithmetic breaks its own way; docs/RESULTS.md "A checkpoint against its graph"), and how many
    values of each image's tensor an activation histogram is built from (``sample``; 0: all of them), and how many
    forward passes the searches may take (``search_cost``, :data:`SEARCH_COSTS`)."""
    method: str = DEFAULT_CALIB_METHOD
    percentile: float = DEFAULT_PERCENTILE
    skip: tuple[str, ...] = ()
    head_amax: str = DEFAULT_HEAD_AMAX
    tie: str = DEFAULT_TIE
    head_batches: int = DEFAULT_HEAD_BATCHES
    search_layers: tuple[int, ...] = ()
    pool_scale: str = DEFAULT_POOL_SCALE
    sample: int = 0
    search_cost: str = "full"

    @property
    def searches(self) -> bool:
        """Whether calibration ends with a search of scales (the head's, or body layers')."""
        return self.head_amax == "search" or bool(self.search_layers)

    def __post_init__(self) -> None:
        if self.method not in CALIB_METHODS:
            raise QATError(f"unknown calibration method '{self.method}'; choose one of {', '.join(CALIB_METHODS)}.")
        if self.head_amax not in HEAD_AMAX:
            raise QATError(f"unknown --head-amax '{self.head_amax}'; choose one of {', '.join(HEAD_AMAX)}.")
        if self.tie not in TIES:
            raise QATError(f"unknown --tie '{self.tie}'; choose one of {', '.join(TIES)}.")
        if self.pool_scale not in POOL_SCALES:
            raise QATError(f"unknown --pool-scale '{self.pool_scale}'; choose one of {', '.join(POOL_SCALES)}.")
        if self.search_cost not in SEARCH_COSTS:
            raise QATError(f"unknown --search-cost '{self.search_cost}'; choose one of {', '.join(SEARCH_COSTS)}.")
        if self.sample < 0:
            raise QATError(f"calibration sample {self.sample}: give a number of values per image, or 0 for all.")
        object.__setattr__(self, "skip", tuple(str(s).strip() for s in self.skip if str(s).strip()))
        object.__setattr__(self, "search_layers", tuple(sorted({int(i) for i in self.search_layers})))


@dataclass(frozen=True)
class QuantInfo:
    """What a quantized model was made with: its settings, and what was derived from them for this model
    (the module-name patterns kept in FP, the calibration's shared-scale groups, and with ``--head-amax
    search`` or ``--search-layers`` what the search chose: ``{"factors": {quantizer: multiple}, "loss_before", "loss_after",
    "batches"}``, and ``body`` with the body's own loss and batch count where ``--search-cost bounded`` scored it on
    fewer batches than the head). Travels in its checkpoint."""
    config: QuantConfig = field(default_factory=QuantConfig)
    fp_patterns: list[str] = field(default_factory=list)
    scale_groups: list[list[str]] = field(default_factory=list)
    head_search: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """The checkpoint's ``quant`` entry (flat, as checkpoints have always stored it)."""
        return {"calib_method": self.config.method, "percentile": self.config.percentile,
                "skip": list(self.config.skip), "head_amax": self.config.head_amax, "tie": self.config.tie,
                "head_batches": self.config.head_batches, "search_layers": list(self.config.search_layers),
                "pool_scale": self.config.pool_scale, "calib_sample": self.config.sample,
                "search_cost": self.config.search_cost, "fp_patterns": list(self.fp_patterns),
                "scale_groups": [list(g) for g in self.scale_groups], "head_search": dict(self.head_search)}

    @classmethod
    def from_dict(cls, d: dict) -> QuantInfo:
        config = QuantConfig(method=d.get("calib_method", DEFAULT_CALIB_METHOD),
                             percentile=d.get("percentile", DEFAULT_PERCENTILE), skip=tuple(d.get("skip", ())),
                             head_amax=d.get("head_amax", "calibrated"),  # older checkpoints: no search
                             tie=d.get("tie", "max"), head_batches=d.get("head_batches", DEFAULT_HEAD_BATCHES),
                             search_layers=tuple(d.get("search_layers", ())),
                             pool_scale=d.get("pool_scale", LEGACY_POOL_SCALE), sample=d.get("calib_sample", 0),
                             search_cost=d.get("search_cost", "full"))
        return cls(config, fp_patterns=list(d.get("fp_patterns", ())),
                   scale_groups=[list(g) for g in d.get("scale_groups", ())], head_search=dict(d.get("head_search", {})))
