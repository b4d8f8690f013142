"""The library parts of the benchmark scripts (their GPU runs are what docs/QAT.md reports)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

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
    from utils.qat.model import checkpoint
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


def _main(tree, name: str, *argv: str) -> dict:
    """benchmarks/NAME.py's main in this process, from the top of the tree (as it is run)."""
    import os
    here = os.getcwd()
    os.chdir(tree)
    try:
        bench = _module(name)
        return bench.main(bench.get_args_parser().parse_args(list(argv)))
    finally:
        os.chdir(here)


def _cost(tree, *argv: str) -> dict:
    return _main(tree, "cost", *argv)


def test_qat_step_table_per_mode(yolov9_tree, tmp_path):
    """benchmarks/qat_step.py on the CPU at a tiny size: a row per model with each mode timed and counted, the
    speed-ups eager's time over each mode's, json and md written."""
    import json

    import yaml
    from helpers import TINY_GELAN
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(TINY_GELAN))
    out = tmp_path / "out"
    doc = _main(yolov9_tree, "qat_step", "--cfg", str(tiny), "--imgsz", "32", "--batch-size", "2", "--steps", "2",
                "--warmup", "1", "--impl", "eager", "graph", "--out", str(out))
    assert json.loads((out / "qat_step.json").read_text()) == doc
    (row,) = doc["rows"]
    assert row["model"] == "tiny" and row["quantizers"] > 0 and "triton" not in row
    for mode in ("eager", "graph"):
        assert 0 < row[mode]["seconds_per_step"] < 60 and row[mode]["aten_ops"] > 100
        assert row[mode]["gpu_kernels"] is None and row[mode]["gpu_ms"] is None  # no GPU here
    assert row["speedup_graph"] == round(row["eager"]["seconds_per_step"] / row["graph"]["seconds_per_step"], 3)
    md = (out / "qat_step.md").read_text()
    assert "| eager s/step |" in md and "| graph GPU ms |" in md and "| speed-up graph |" in md
    assert md.count("| tiny |") == 1


def test_cost_table_times_fp_and_qat_on_the_same_batches(yolov9_tree, small_data, tmp_path):
    """benchmarks/cost.py end to end on the CPU at a tiny size: both loops timed, the ratio their quotient, every
    requested calibration timed, evaluation and the loader measured, a model the tree cannot build skipped with a
    note, and json + md + png written. Leaves out the slow methods (entropy, mse, head search: their own tests)."""
    import json

    import torch
    import yaml
    from helpers import TINY_GELAN
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(TINY_GELAN))
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump({**TINY_GELAN, "backbone": [[-1, 1, "NoSuchBlock", [16]], *TINY_GELAN["backbone"][1:]]}))
    out = tmp_path / "out"
    result = _cost(yolov9_tree, "--models", str(tiny), str(broken), "--data", str(small_data), "--imgsz", "64",
                   "--batch-size", "2", "--warmup", "1", "--steps", "2", "--calib-batches", "1", "--methods", "max",
                   "--workers", "0", "--loader-batches", "2", "--device", "cpu", "--out", str(out), "--tag", "test")
    assert json.loads((out / "cost-test.json").read_text()) == result
    assert result["complete"] and result["machine"]["torch"] == torch.__version__
    assert result["settings"]["imgsz"] == 64 and result["settings"]["batch_size"] == 2
    assert list(result["skipped"]) == ["broken"] and "cannot build" in result["skipped"]["broken"]
    assert result["loader"]["images_per_second"] > 0
    (r,) = result["models"]
    assert r["model"] == "tiny" and r["parameters"] > 0 and r["quantizers"] > 0 and "error" not in r
    fp, qat = r["fp"]["seconds_per_step"], r["qat"]["seconds_per_step"]
    for step in (fp, qat):
        assert step["steps"] == 2 and 0 < step["median"] < 60 and 0 < step["mean"] < 60
    assert r["ratio"] == pytest.approx(qat["mean"] / fp["mean"], abs=1e-3)
    assert r["fp"]["peak_memory_gib"] is None  # the CPU has no peak counter
    assert list(r["calibration_seconds"]) == ["max"] and r["calibration_seconds"]["max"] > 0
    assert r["qat"]["objective"] == "head" and r["qat"]["calibration"] == "max"
    assert r["qat"]["graph_steps"] == 0 and "qat_eager" not in r  # the CPU records no graph: one QAT loop
    assert r["eval_images_per_second"]["fp"] > 0 and r["eval_images_per_second"]["fake_quant"] > 0
    md = (out / "cost-test.md").read_text()
    assert "| tiny | 1.2 | " in md and "broken skipped" in md and f"{r['ratio']:.2f}x" in md
    assert (out / "cost-test.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, says", [
    (["--methods", "head-search"], "has no calibration method"),
    (["--warmup", "0"], "--warmup 0 is out of range"),
    (["--synthetic", "--loader-batches", "5"], "--synthetic has none"),
    (["--models", "gelan-x"], "gelan-x.yaml not found"),
])
def test_cost_refuses_bad_flags_in_one_sentence(yolov9_tree, small_data, tmp_path, argv, says):
    from utils.qat.core.errors import QATError
    data = [] if "--synthetic" in argv else ["--data", str(small_data)]
    with pytest.raises(QATError, match=re.escape(says)) as e:
        _cost(yolov9_tree, *data, *argv, "--device", "cpu", "--out", str(tmp_path))
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())
