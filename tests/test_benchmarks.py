"""The library parts of the benchmark scripts (their GPU runs are what docs/QAT.md reports)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QS = REPO / "weights" / "gelan-qs-shapes.pt"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quantizer_sensitivity_groups_fold_levels_and_cover_the_layer(yolov9_tree):
    """benchmarks/quantizer_sensitivity.py: one group per branch position (levels folded), inputs apart
    from weights, and the "all" groups hold exactly the layer's quantizers."""
    from utils.qat.quantize.model_quant import QuantConfig, prepare
    from utils.qat.quantize.state import enabled_quantizers
    from utils.qat import checkpoint
    bench = _module("quantizer_sensitivity")
    qmodel, _ = prepare(checkpoint.load_fp(QS), QuantConfig(method="max"))
    head = qmodel.model[-1]
    every = enabled_quantizers(head)
    groups = bench.quantizer_groups(head, "model.22", per_level=False)
    assert {id(q) for q in groups.pop("all inputs") + groups.pop("all weights")} == {id(q) for q in every}
    folded = [q for qs in groups.values() for q in qs]
    assert len(folded) == len(every) and len({id(q) for q in folded}) == len(every)  # each in one group
    assert all(re.fullmatch(r"model\.22\.cv[23]\.\*\.\d\.(input|weight)", name) for name in groups), list(groups)
    levels = len(head.cv2)
    assert all(len(qs) == levels for qs in groups.values())  # one quantizer per level in each group
    per_level = bench.quantizer_groups(head, "model.22", per_level=True)
    assert len(per_level) == len(every) + 2 and "model.22.cv3.0.2.input" in per_level
