"""The library parts of the benchmark scripts (their GPU runs are what docs/RESULTS.md and docs/QAT_*.md report)."""
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


def test_cost_step_mode_table_per_implementation(yolov9_tree, tmp_path):
    """benchmarks/cost.py --mode step on the CPU at a tiny size: a row per model with each implementation timed and
    counted, the speed-ups eager's time over each implementation's, json and md written."""
    import json

    import yaml
    from helpers import TINY_GELAN
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(yaml.safe_dump(TINY_GELAN))
    out = tmp_path / "out"
    doc = _cost(yolov9_tree, "--mode", "step", "--models", str(tiny), "--imgsz", "32", "--batch-size", "2",
                "--steps", "2", "--warmup", "1", "--impl", "eager", "graph", "--out", str(out), "--tag", "test")
    assert json.loads((out / "qat-step-test.json").read_text()) == doc
    (row,) = doc["rows"]
    assert row["model"] == "tiny" and row["quantizers"] > 0 and "triton" not in row
    for mode in ("eager", "graph"):
        assert 0 < row[mode]["seconds_per_step"] < 60 and row[mode]["aten_ops"] > 100
        assert row[mode]["gpu_kernels"] is None and row[mode]["gpu_ms"] is None  # no GPU here
    assert row["speedup_graph"] == round(row["eager"]["seconds_per_step"] / row["graph"]["seconds_per_step"], 3)
    md = (out / "qat-step-test.md").read_text()
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
    (["--mode", "step"], "--mode step runs on one random batch: drop --data"),
    (["--mode", "fp16"], "--mode fp16 scores a quantized checkpoint's two graphs: pass --weights"),
])
def test_cost_refuses_bad_flags_in_one_sentence(yolov9_tree, small_data, tmp_path, argv, says):
    from utils.qat.core.errors import QATError
    data = [] if "--synthetic" in argv else ["--data", str(small_data)]
    with pytest.raises(QATError, match=re.escape(says)) as e:
        _cost(yolov9_tree, *data, *argv, "--device", "cpu", "--out", str(tmp_path))
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


# ---- benchmarks/cli_results.py ---------------------------------------------------------------------------------

FAKE_CLI = '''#!{python}
"""Stands in for qat.py / export_qat.py / val_trt.py: writes what each writes, after a pause, with its start and
end times in its log; quantize of weights named broken.pt fails."""
import json, os, pathlib, sys, time
argv = sys.argv[1:]
flag = lambda name: argv[argv.index(name) + 1]
print("start", time.time(), flush=True)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0.4")))
if argv[0] == "qat.py":
    weights, seed = pathlib.Path(flag("--weights")), int(flag("--seed"))
    if weights.stem == "broken":
        sys.exit(2)
    import yaml
    assert yaml.safe_load(open(flag("--data")))["path"].startswith("/")
    run = pathlib.Path(flag("--project")) / flag("--name")
    (run / "weights").mkdir(parents=True, exist_ok=True)
    half = lambda ap: {{"even": ap + 0.01, "odd": ap - 0.01}}
    ap = 0.5 + seed / 1000
    pick = lambda c, s, epoch, x: {{"chosen_on": c, "scored_on": s, "stage": f"QAT epoch {{epoch}}", "epoch": epoch,
                                   "AP": x, "Origin": 0.6, "PTQ": 0.4}}
    report = {{"models": [{{"name": "Origin", "AP": 0.6, "halves": half(0.6)}}, {{"name": "PTQ", "AP": 0.4, "halves": half(0.4)}},
                          {{"name": "QAT", "AP": ap + 0.02, "epoch": 1}}],
              "epochs": [{{"epoch": 1, "AP": ap + 0.02, "halves": half(ap + 0.02), "loss": 0.1, "steps": 4, "train_seconds": 2.0,
                          "weights": str(run / "weights" / "qat_ep_1.pt")}},
                         {{"epoch": 2, "AP": ap, "halves": half(ap), "loss": 0.1, "steps": 4, "train_seconds": 2.0,
                          "weights": str(run / "weights" / "qat_ep_2.pt")}}],
              "selection": {{"halves": "alternately", "best": pick("all", "all", 1, ap + 0.02), "last": pick("none", "all", 2, ap),
                            "selection_free": {{"mean": {{"AP": ap, "Origin": 0.6, "PTQ": 0.4}}}}}},
              "calibration_seconds": 1.5, "arguments": {{"imgsz": 64, "batch_size": 8, "conf_thres": 0.001, "iou_thres": 0.7}}}}
    (run / "report.json").write_text(json.dumps(report))
elif argv[0] == "export_qat.py":
    pathlib.Path(flag("--weights")).with_suffix(".onnx").write_text("graph")
else:
    out = pathlib.Path(flag("--project")) / flag("--name")
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({{"AP": 0.45 if "ep_2" in flag("--onnx") else 0.47, "images": 16}}))
print("end", time.time(), flush=True)
'''


def _fake_setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A tree the fake CLIs run in, a data yaml with upstream's placeholder path and its dataset, the fake python."""
    import sys
    tree = tmp_path / "tree"
    (tree / "models").mkdir(parents=True)
    (tree / "models" / "yolo.py").write_text("")
    (tree / "qat.py").write_text("")
    root = tmp_path / "datasets"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
    data = tmp_path / "data.yaml"
    data.write_text("path: /ABSOLUTE/PATH/TO/shared/datasets\ntrain: images/train\nval: images/val\nnames: {0: a}\n")
    fake = tmp_path / "fake-python"
    fake.write_text(FAKE_CLI.format(python=sys.executable))
    fake.chmod(0o755)
    return tree, data, fake


def test_cli_results_runs_at_once_and_records_failures(tmp_path):
    """benchmarks/cli_results.py with stand-in commands: --jobs 2 runs two pipelines at once (their quantize commands
    overlap) and the outputs flag the times as shared; a run whose quantize fails is recorded and starts nothing more,
    the others finish; best and last are exported and scored apart when they differ; the summary is the mean and
    range over seeds; --dataset-root fills the yaml's path:."""
    import json
    tree, data, fake = _fake_setup(tmp_path)
    for w in ("good.pt", "broken.pt"):
        (tmp_path / w).write_bytes(b"")
    bench = _module("cli_results")
    args = bench.get_args_parser().parse_args([
        "--tree", str(tree), "--patched", "--weights", str(tmp_path / "good.pt"), str(tmp_path / "broken.pt"),
        "--data", str(data), "--dataset-root", str(tmp_path / "datasets"), "--seeds", "57", "1", "--jobs", "2",
        "--python", str(fake), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--label", "fake"])
    result = bench.main(args)
    text = (tmp_path / "out" / "fake.json").read_text()
    assert json.loads(text) == json.loads(bench.cleaner(result["settings"])(json.dumps(result)))
    # the result set names no path of this machine: the tree, the work folder and the rest are placeholders
    logs = [p.read_text() for p in (tmp_path / "out").rglob("*.log")]
    for written in [text, *logs, (tmp_path / "out" / "fake.md").read_text()]:
        assert str(tmp_path) not in written and "$WORK/runs/good-s57" in text, written[:2000]
    assert json.loads(text)["settings"]["tree"] == "$YOLOV9_DIR"
    assert json.loads(text)["runs"][0]["commands"][0]["command"].startswith("python3 qat.py quantize --weights $TMPDIR/")
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["good-s57", "good-s1", "broken-s57", "broken-s1"]
    for name in ("broken-s57", "broken-s1"):
        assert [c["step"] for c in runs[name]["commands"]] == ["quantize"] and runs[name]["errors"]
        assert runs[name]["commands"][0]["returncode"] == 2
    assert len(result["failed"]) == 2
    good = runs["good-s57"]
    assert [c["step"] for c in good["commands"]] == ["quantize", "export-best", "val_trt-best", "export-last",
                                                     "val_trt-last"]
    assert all(c["returncode"] == 0 and c["seconds"] >= 0.4 for c in good["commands"])
    assert good["onnxruntime"]["best"]["AP"] == 0.47 and good["onnxruntime"]["last"]["AP"] == 0.45
    assert good["onnxruntime"]["last"]["epoch"] == 2 and "qat_ep_2" in good["onnxruntime"]["last"]["onnx"]

    def span(run):
        lines = (tmp_path / "out" / "fake-logs" / run / "quantize.log").read_text().split()
        return float(lines[1]), float(lines[3])
    (a0, a1), (b0, b1) = span("good-s57"), span("good-s1")
    assert a0 < b1 and b0 < a1  # the two runs' quantize commands overlapped
    s = result["summary"][str(tmp_path / "good.pt")]
    assert s["best"] == {"mean": 0.549, "min": 0.521, "max": 0.577, "n": 2}
    assert s["INT8 ORT last"]["n"] == 2 and s["s per QAT step"]["mean"] == 0.5
    assert s["selection-free - PTQ (halves)"]["min"] == pytest.approx(0.101)
    assert result["summary"][str(tmp_path / "broken.pt")]["best"] is None
    md = (tmp_path / "out" / "fake.md").read_text()
    assert "**Timing**: 2 runs at once" in md and "| quantize command s * |" in md and "| `quantize` | 0 | " in md
    assert "**Failed**: quantize: exit 2" in md and "| INT8 ONNX Runtime, last | all images | epoch 2 |" in md
    assert (tmp_path / "out" / "fake.png").read_bytes()[:4] == b"\x89PNG"
    used = Path(result["settings"]["data"])
    assert used.parent == tmp_path / "work" and f"path: {tmp_path / 'datasets'}" in used.read_text()


def test_cli_results_sigterm_stops_the_commands_and_keeps_the_record(tmp_path):
    """SIGTERM to the script ends its running command (SIGTERM), starts no more, writes the result set with the
    command's exit status, and exits 128 + 15 with one line."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    tree, data, fake = _fake_setup(tmp_path)
    (tmp_path / "w.pt").write_bytes(b"")
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "cli_results.py"), "--tree", str(tree), "--patched",
                             "--weights", str(tmp_path / "w.pt"), "--data", str(data), "--dataset-root",
                             str(tmp_path / "datasets"), "--python", str(fake), "--out", str(tmp_path / "out"),
                             "--work", str(tmp_path / "work"), "--label", "stop"],
                            env={**os.environ, "FAKE_SLEEP": "120"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    log = tmp_path / "out" / "stop-logs" / "w-s57" / "quantize.log"
    deadline = time.time() + 60
    while not (log.is_file() and log.read_text().startswith("start")) and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "error: stopped by SIGTERM; what was done is in the result set."
    (run,) = json.loads((tmp_path / "out" / "stop.json").read_text())["runs"]
    assert [(c["step"], c["returncode"]) for c in run["commands"]] == [("quantize", -signal.SIGTERM)]


@pytest.mark.parametrize("change, says", [
    ({}, "pass --dataset-root"),  # upstream's placeholder path: left in the yaml
    ({"path": "datasets"}, "relative path"),
    ({"jobs": 0}, "--jobs 0 is out of range"),
    ({"extra": "--device 0 --name x"}, "--extra --name: this script sets"),
])
def test_cli_results_refuses_before_running(tmp_path, change, says):
    tree, data, fake = _fake_setup(tmp_path)
    if "path" in change:
        data.write_text(data.read_text().replace("/ABSOLUTE/PATH/TO/shared/datasets", change["path"]))
    (tmp_path / "w.pt").write_bytes(b"")
    bench = _module("cli_results")
    args = bench.get_args_parser().parse_args([
        "--tree", str(tree), "--patched", "--weights", str(tmp_path / "w.pt"), "--data", str(data), "--python",
        str(fake), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--jobs", str(change.get("jobs", 1)),
        "--extra", change.get("extra", "")])
    with pytest.raises(bench.Refused, match=re.escape(says)) as e:
        bench.main(args)
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists() and not (tmp_path / "work").exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_cli_results_runs_the_real_commands(yolov9_tree, shapes, tmp_path):
    """benchmarks/cli_results.py end to end on the CPU at a tiny size (GELAN-QS on shapes, 64 px, one epoch of one
    step): a copy of the tree patched, quantize / export_qat / val_trt run and logged, every figure read back from
    the files they wrote; INT8 ONNX Runtime near the fake-quant score of the same checkpoint."""
    import json
    out, work = tmp_path / "out", tmp_path / "work"
    result = _main(yolov9_tree, "cli_results", "--tree", str(yolov9_tree), "--weights", str(QS), "--data", str(shapes),
                   "--seeds", "57", "--extra", "--device cpu --imgsz 64 --batch-size 8 --epochs 1 --iters 1 "
                   "--calib-batches 1 --calib-method max --head-amax calibrated --workers 0 --hyp none",
                   "--export-flags", "--include onnx --dynamic", "--val-extra", "--device cpu --workers 0",
                   "--out", str(out), "--work", str(work), "--label", "qs")
    assert not result["failed"] and (work / "yolov9" / ".yolov9-qat-manifest").is_file()
    (run,) = result["runs"]
    report = json.loads((work / "runs" / "gelan-qs-shapes-s57" / "report.json").read_text())
    assert run["report"]["models"] == report["models"] and run["report"]["selection"] == report["selection"]
    steps = [c["step"] for c in run["commands"]]
    best, last = report["selection"]["best"], report["selection"]["last"]
    assert steps == ["quantize", "export-best", "val_trt-best"] + (["export-last", "val_trt-last"] if best["epoch"] != 1 else [])
    for c in run["commands"]:
        assert c["returncode"] == 0 and c["seconds"] > 0 and (out / c["log"]).stat().st_size > 0
    assert "results in" in (out / run["commands"][0]["log"]).read_text()  # quantize's own last lines
    ort = run["onnxruntime"]
    assert abs(ort["best"]["AP"] - best["AP"]) < 0.02 and abs(ort["last"]["AP"] - last["AP"]) < 0.02
    assert ort["best"]["images"] == report["models"][0]["images"] == 16
    md = (out / "qs.md").read_text()
    assert "## gelan-qs-shapes.pt, seed 57" in md and "| QAT epoch 1 |" in md and "**Timing**" not in md
    assert "| selection-free, mean of both |" in md and "| INT8 ONNX Runtime, best |" in md
    assert (out / "qs.png").read_bytes()[:4] == b"\x89PNG"


def test_ckpt_vs_graph_same_detections():
    """Two images' statistics hold the same detections when they keep as many, of the same classes, with
    confidences within the tolerance and the same matches, in whatever order they were kept."""
    import numpy as np
    bench = _module("ckpt_vs_graph")
    correct = np.array([[True, False], [False, False], [True, True]])
    a = (correct, np.array([0.9, 0.5, 0.7]), np.array([1.0, 2.0, 1.0]), np.array([1.0]))
    reordered = (correct[[2, 0, 1]], a[1][[2, 0, 1]] + 1e-4, a[2][[2, 0, 1]], a[3])
    assert bench.same_detections(a, reordered, 1e-3) and bench.same_detections(None, None, 1e-3)
    assert not bench.same_detections(a, (correct, a[1] + 0.01, a[2], a[3]), 1e-3)  # a confidence moved
    assert not bench.same_detections(a, (~correct, a[1], a[2], a[3]), 1e-3)  # matched otherwise
    assert not bench.same_detections(a, (correct[:2], a[1][:2], a[2][:2], a[3]), 1e-3)  # one fewer kept
    assert not bench.same_detections(a, None, 1e-3)


def test_ckpt_vs_graph_scores_a_checkpoint_and_its_graph(yolov9_tree, shapes, tmp_path):
    """benchmarks/ckpt_vs_graph.py on a quickly calibrated embedded model (shapes, 64 px): the checkpoint in PyTorch
    on the CPU with every thread and with one, and its exported graph on ONNX Runtime as val_trt.py scores it, all
    score the same to the last digit, with the same detections on every image (a spread of 0); the graph as ONNX
    Runtime runs the file itself scores near it, its difference carried with its interval, outside the spread. A
    second run into the same set adds arithmetics to the row and keeps the scores it had, and scores the checkpoint
    twice more with its SiLUs one step off (--silu-ulp-draws); a floating-point checkpoint is refused in one
    sentence, before anything is written."""
    import yaml

    from helpers import quantized_checkpoint, real_images
    from utils.qat.core.errors import QATError
    from utils.qat.model import checkpoint
    train = Path(yaml.safe_load(shapes.read_text())["train"])
    train = train if train.is_absolute() else shapes.parent / train
    _, pt = quantized_checkpoint(checkpoint.load_fp(QS), real_images(train, 4, 64), tmp_path / "q.pt")
    out = tmp_path / "out"
    common = ["--data", str(shapes), "--imgsz", "64", "--batch-size", "8", "--workers", "0", "--out", str(out),
              "--label", "qs"]
    _main(yolov9_tree, "ckpt_vs_graph", "--weights", str(pt), "--arithmetics", "cpu", "cpu1", "ort", *common)
    doc = _main(yolov9_tree, "ckpt_vs_graph", "--weights", str(pt), "--arithmetics", "ort-float", "ort-basic",
                "--silu-ulp-draws", "2", *common)
    (row,) = doc["rows"]
    scores, vs = row["scores"], row["vs_reference"]
    assert set(scores) == {"cpu", "cpu1", "ort", "ort-float", "ort-basic"} and row["reference"] == "cpu"
    assert scores["cpu"]["images"] == 16 and 0.1 < scores["cpu"]["AP"] <= 1  # 4 calibration images at 64 px: ~0.19
    for a in ("cpu1", "ort"):
        assert scores[a]["AP"] == scores["cpu"]["AP"] and vs[a]["AP"] == 0 and vs[a]["same_detections"] == 16, a
    for a in ("ort-float", "ort-basic"):
        d = vs[a]
        assert abs(scores[a]["AP"] - scores["cpu"]["AP"]) < 0.02 and 0 <= d["same_detections"] <= 16
        assert abs(d["AP"] - (scores[a]["AP"] - scores["cpu"]["AP"])) < 2e-4
        assert d["interval"][0] <= d["interval"][1] and d["tie"] == (d["interval"][0] <= 0 <= d["interval"][1])
    assert row["spread"] == 0
    draws = row["silu_ulp"]
    assert draws["on"] == "cpu" and len(draws["AP"]) == 2
    assert all(abs(d - scores["cpu"]["AP"]) < 0.05 for d in draws["AP"])
    assert {p.name for p in (out / "qs-images").iterdir()} == {f"q.{a}.npz" for a in scores}
    md = (out / "qs.md").read_text()
    assert "## q.pt" in md and "| PyTorch, CPU, 1 thread |" in md and "| ONNX Runtime, float |" in md
    assert "With every SiLU one float32 step off on a random half of its outputs (2 draws, PyTorch, CPU)" in md
    with pytest.raises(QATError, match="is a floating-point checkpoint; pass a quantized one"):
        _main(yolov9_tree, "ckpt_vs_graph", "--weights", str(QS), *common[:-4], "--out", str(tmp_path / "fp"))
    assert not (tmp_path / "fp").exists()
    with pytest.raises(QATError, match="was scored at imgsz 64, batch_size 8, num_image None; score at the same"):
        _main(yolov9_tree, "ckpt_vs_graph", "--weights", str(pt), "--arithmetics", "cpu", *common[:2], "--imgsz", "96",
              *common[4:])


def test_cli_results_renders_a_budget_set(tmp_path):
    """A committed --max-drop set (benchmarks/results/custom-budget0-h200.json, every step run) rendered again from its
    JSON: one table row per step with its held-out figure, bound and (kept steps) evaluation figure, the evaluation
    spread and the graph's line; the plot draws the steps, not the epochs."""
    import json
    bench = _module("cli_results")
    result = json.loads((REPO / "benchmarks" / "results" / "custom-budget0-h200.json").read_text())
    budget = result["runs"][0]["report"]["budget"]
    md = bench.render(result)
    assert "Budget --max-drop 0 at 90% confidence: 41 held-out training images" in md
    rows = [line for line in md.splitlines() if re.match(r"\| [1-4] \| ", line)]
    assert len(rows) == len(budget["steps"]) and all(line.count("|") == 10 for line in rows)
    step1 = budget["steps"][0]
    assert rows[0].startswith(f"| 1 | calibration | {step1['tried']} | {step1['holdout_AP']:.4f} | "
                              f"{-step1['drop']:+.4f} | {-step1['drop_bound']:+.4f} | yes |")
    assert f"+/- {budget['evaluation_spread']:.4f} over bootstrap draws" in md and "The exported graph" in md
    bench.plot(result, tmp_path / "budget.png")
    assert (tmp_path / "budget.png").read_bytes()[:4] == b"\x89PNG"


def test_ptq_spread_groups_the_committed_runs(tmp_path):
    """benchmarks/diagnose.py ptq-spread on the qat.py reports it was written for
    (benchmarks/results/ptq-spread-h200/logs): runs grouped by model and setting, a run whose calibration equals
    another's counted once, the table and plot written; a file that is not a quantize report refused in one
    sentence."""
    import json
    import subprocess
    import sys

    bench = _module("diagnose").subcommand("ptq-spread")
    logs = REPO / "benchmarks" / "results" / "ptq-spread-h200" / "logs"
    result = bench.main(bench.get_args_parser().parse_args([str(logs), "--out", str(tmp_path), "--label", "s"]))
    t = result["yolov9-t-coco"]
    assert set(t) == {"mse, head searched", "mse, head searched, layers 0-5 searched"}
    searched = t["mse, head searched, layers 0-5 searched"]
    assert [r["name"] for r in searched["duplicates"]] == ["t-s05-cb30"]
    assert searched["duplicates"][0]["same_as"] == "t-s05"
    aps = sorted(r["AP"] for r in searched["runs"])
    assert aps == [0.4009, 0.4028, 0.4036, 0.4044] and searched["mean"] == pytest.approx(sum(aps) / 4)
    assert searched["min"] > t["mse, head searched"]["max"]  # every searched run above every default one
    md = (tmp_path / "s.md").read_text()
    assert "| c-def-cb30 (= c-def, counted once) |" in md and "## gelan-c-coco334" in md
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "s.json").read_text())["gelan-c-coco334"].keys() == result["gelan-c-coco334"].keys()
    bad = tmp_path / "bad" / "report.json"
    bad.parent.mkdir()
    bad.write_text("{}")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "diagnose.py"), "ptq-spread", str(bad), "--out",
                        str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "is not a qat.py report.json" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_cpu_deploy_shared_checks_its_files_and_the_tree_before_any_work(yolov9_tree, tmp_path):
    """benchmarks/cpu_deploy.py --shared (docs/CPU.md's tables in one command): a shared folder without the models
    and data, or a tree without ELAN1 (yolov9-t's), is refused in one sentence, before anything is written."""
    from conftest import SHARED, tree_has
    from utils.qat.core.errors import QATError
    out = tmp_path / "out"
    with pytest.raises(QATError, match="gelan-c-coco334.pt not found; pass the shared/ folder") as e:
        _main(yolov9_tree, "cpu_deploy", "--shared", str(tmp_path / "none"), "--out", str(out))
    assert "\n" not in str(e.value) and not out.exists()
    if (SHARED / "datasets" / "coco334").is_dir() and not tree_has(yolov9_tree, "ELAN1"):
        with pytest.raises(QATError, match="this YOLOv9 tree has no ELAN1, which yolov9-t needs"):
            _main(yolov9_tree, "cpu_deploy", "--shared", str(SHARED), "--out", str(out))
        assert not out.exists()


def test_portable_writes_a_machines_paths_from_their_folders(tmp_path, monkeypatch):
    """benchmarks/parts/portable.py: a path under a known folder is written from its placeholder, the longest folder
    first (a tree copied into the work folder is the tree), whole path components only, after a terminal colour
    code too; a command drops its interpreter and runs as python3."""
    import sys
    import tempfile
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from parts import portable
    monkeypatch.setenv("YOLOV9_QAT_SHARED", str(tmp_path / "shared"))
    work, tree = tmp_path / "work", tmp_path / "work" / "yolov9"
    text = (f"--weights {tmp_path}/shared/weights/t.pt --project {work}/runs in {tree}/data/hyps "
            f"{work}x/a \x1b[1m{work}/b\x1b[0m {REPO}/weights/q.pt")
    beside = (work.parent / "workx").relative_to(Path(tempfile.gettempdir()).resolve())  # not the work folder
    assert portable.text(text, work=work, tree=tree) == (
        f"--weights $SHARED/weights/t.pt --project $WORK/runs in $YOLOV9_DIR/data/hyps $TMPDIR/{beside}/a "
        "\x1b[1m$WORK/b\x1b[0m $REPO/weights/q.pt")
    assert portable.command(["/opt/venv/bin/python3", "qat.py", "--weights", f"{REPO}/weights/q.pt"]) == \
        "python3 qat.py --weights $REPO/weights/q.pt"
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "peers.py"), "--out", str(work)])
    assert portable.command(work=work) == "python3 $REPO/benchmarks/peers.py --out $WORK"
