"""qat.py quantize | sensitive | eval, run the way users run them, on the embedded model and data."""
from __future__ import annotations

import functools
import hashlib
import json

import pytest
import torch
import yaml

from conftest import REPO, cli_error, run_tool

QS = REPO / "weights" / "gelan-qs-shapes.pt"
IMGSZ = "128"


@pytest.fixture(scope="module")
def quantize_run(yolov9_tree, shapes, tmp_path_factory):
    project = tmp_path_factory.mktemp("runs")
    r = run_tool(yolov9_tree, "qat.py", "quantize", "--weights", str(QS), "--data", str(shapes),
                 "--device", "cpu", "--batch-size", "8",  # --hyp left out: the default augmentation
                 "--imgsz", IMGSZ, "--project", str(project), "--name", "qs", "--exist-ok", "--iters", "2",
                 "--epochs", "1", "--seed", "57", "--supervision-stride", "2", "--calib-batches", "2",
                 "--calib-method", "percentile", "--workers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return project / "qs", r


@pytest.mark.slow
@pytest.mark.e2e
def test_quantize_writes_every_file(quantize_run):
    run, r = quantize_run
    weights = sorted(p.name for p in (run / "weights").iterdir())
    assert [w for w in weights if w.startswith("ptq_ap_") and w.endswith("_gelan-qs-shapes.pt")]
    assert [w for w in weights if w.startswith("qat_ep_1_ap_")]
    assert "qat_best_gelan-qs-shapes.pt" in weights
    assert not [w for w in weights if w.endswith(".part")]
    for f in ("report.json", "report.md", "qat_ap.png"):
        assert (run / f).stat().st_size > 0
    assert (run / "qat_ap.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.e2e
def test_quantize_report(yolov9_tree, quantize_run):
    run, r = quantize_run
    report = json.loads((run / "report.json").read_text())
    names = [m["name"] for m in report["models"]]
    assert names == ["Origin", "PTQ", "QAT"]
    for m in report["models"]:
        assert set(m) >= {"name", "weights", "AP", "AP50", "Precision", "Recall", "seconds"}
        assert 0 <= m["AP"] <= m["AP50"] <= 1
    origin, ptq, qat = report["models"]
    assert origin["AP"] > 0.5  # the embedded model is good at 128 px too
    assert abs(ptq["AP"] - origin["AP"]) < 0.1
    assert qat["AP"] >= ptq["AP"]  # the best QAT checkpoint never loses to its starting point
    # every difference from FP carries its paired-bootstrap interval, kept in report.json and shown in report.md
    low, high = ptq["vs_origin"]["interval"]
    assert ptq["vs_origin"]["AP"] == pytest.approx(ptq["AP"] - origin["AP"], abs=2e-4) and low <= high
    assert f"[{low:+.4f}, {high:+.4f}]" in (run / "report.md").read_text()
    assert (run / "origin_images.npz").is_file()  # what val_trt.py --report pairs the graph's score with
    assert report["epochs"] and report["epochs"][0]["epoch"] == 1
    args = report["arguments"]  # the run records every argument it was given, in report.json and checkpoints
    assert args["cmd"] == "quantize" and args["task"] == "detect" and "calib_batches" in args and "lr" in args
    hyp = yolov9_tree / "data/hyps/hyp.scratch-high.yaml"  # the default, resolved in the tree, printed and recorded
    assert args["hyp"] == str(hyp)
    assert f"hyp: {hyp} (augmentation of the fine-tuning images; the default for detect)" in r.stdout
    # --search-layers auto on the CPU: no body search, the rate for that, the bounded search cost, recorded as they
    # ran, and said
    assert args["search_layers"] == "" and args["search_cost"] == "bounded" and args["lr"] == 3e-5
    assert "--search-layers auto: no body layer searched on the CPU (no gain measured there); pass --search-layers 0-5" in r.stdout
    assert "--search-cost auto: bounded on the CPU" in r.stdout
    from utils.qat import __version__
    from utils.qat.model import checkpoint
    from utils.qat.core.provenance import toolkit_commit
    assert checkpoint.read(run / "weights" / "qat_best_gelan-qs-shapes.pt")["args"] == args
    # provenance: the weights it started from (their sha256) and the toolkit, in report.json and every checkpoint
    assert report["provenance"] == {"weights": str(QS), "weights_sha256": hashlib.sha256(QS.read_bytes()).hexdigest(),
                                    "toolkit_version": __version__, "toolkit_commit": toolkit_commit()}
    for ckpt in (run / "weights").glob("*.pt"):
        assert checkpoint.read(ckpt)["provenance"] == report["provenance"], ckpt.name
    md = (run / "report.md").read_text()
    assert "| Origin |" in md and "INT8 QAT vs Origin" in md and "INT8 PTQ vs Origin" in md
    assert "INT8 QAT vs Origin" in r.stdout  # the console shows the same table
    # every stage scored on the two halves of the evaluation images too, and the selection block built from them
    stages = [origin, ptq, *report["epochs"]]
    assert all(set(s["halves"]) == {"even", "odd"} and all(0 <= v <= 1 for v in s["halves"].values()) for s in stages)
    _check_selection(report)
    assert "## Selection" in md and "| selection-free | even half | odd half |" in md
    assert "| best (`qat_best`) | all images |" in r.stdout and "| selection-free, mean |" in r.stdout
    # each dataset scan is one line; the val split is scanned once, for Origin: the later evaluations keep its loader
    for stage, times in (("Origin", 1), ("calibration", 1), ("PTQ", 0), ("QAT", 1), ("QAT epoch 1", 0)):
        scans = [line for line in r.stderr.replace("\r", "\n").splitlines() if line.startswith(f"{stage}: Scanning ")]
        assert len(scans) == times, (stage, scans)


@pytest.mark.slow
@pytest.mark.e2e
def test_quantize_times_its_stages(quantize_run):
    """report.json's ``stages``: the seconds of each stage of the run, from the process's start-up to the last
    epoch's save, none below 0, together no more than the run's total; quantize prints them as a table."""
    run, r = quantize_run
    rec = json.loads((run / "report.json").read_text())["stages"]
    seconds = rec["seconds"]
    rows = ("Origin", "PTQ", "QAT epoch 1")
    expected = ["start-up", "imports", "loading", "calibration", "amax search", "fine-tuning set-up",
                "training epoch 1", *(f"{what} {row}" for row in rows for what in ("scoring", "interval", "save"))]
    assert set(expected) <= set(seconds), sorted(seconds)
    assert all(s >= 0 for s in seconds.values()) and seconds["start-up"] > 0 and seconds["training epoch 1"] > 0
    assert sum(seconds.values()) <= rec["total"] + 0.005 * len(seconds)  # each to the hundredth
    assert "where the time went (report.json's stages):" in r.stdout and "| scoring QAT epoch 1 |" in r.stdout


def _check_selection(report: dict) -> None:
    """report.json's ``selection`` agrees with its rows and epochs: best is the stage qat_best holds (the QAT row's
    epoch), last the last epoch, each selection-free pick the first stage with the highest AP on its choosing half,
    scored with that stage's, Origin's and PTQ's AP on the other half, and the mean of both ways."""
    sel, named = report["selection"], {m["name"]: m for m in report["models"]}
    origin, ptq = named["Origin"], named["PTQ"]
    stages = [{"epoch": 0, **ptq}] + report["epochs"]
    assert sel["best"]["epoch"] == named["QAT"]["epoch"] and sel["best"]["AP"] == named["QAT"]["AP"]
    assert sel["best"]["chosen_on"] == sel["best"]["scored_on"] == "all"  # chosen on the images it is scored on
    assert sel["last"]["epoch"] == report["epochs"][-1]["epoch"] and sel["last"]["AP"] == report["epochs"][-1]["AP"]
    free = sel["selection_free"]
    for chosen, scored in (("even", "odd"), ("odd", "even")):
        pick = free[f"{chosen}_to_{scored}"]
        top = max(stages, key=lambda s: s["halves"][chosen])
        assert pick["epoch"] == top["epoch"] and pick["AP"] == top["halves"][scored]
        assert pick["Origin"] == origin["halves"][scored] and pick["PTQ"] == ptq["halves"][scored]
    for key in ("AP", "Origin", "PTQ"):
        assert free["mean"][key] == pytest.approx((free["even_to_odd"][key] + free["odd_to_even"][key]) / 2, abs=1e-4)


def test_halves_split_the_per_image_stats():
    """The halves alternate over the images sorted by path, and each half is scored from its own images' stats:
    a perfect image in the even half and a wrong-class one in the odd half give AP 0.995 (upstream's 101-point
    AP of one perfect detection) and 0, the whole set lies between."""
    from utils.qat.evaluation.evaluate import ImageStats, half_of, score_images, split_halves
    assert half_of(["b.jpg", "a.jpg", "c.jpg", "b.jpg"]) == ["odd", "even", "even", "odd"]
    hit = torch.ones(1, 10, dtype=torch.bool)
    images = [ImageStats("im/b.jpg", (~hit, torch.tensor([0.9]), torch.tensor([1.0]), torch.tensor([0.0]))),
              ImageStats("im/a.jpg", (hit, torch.tensor([0.8]), torch.tensor([0.0]), torch.tensor([0.0]))),
              ImageStats("im/c.jpg")]  # no prediction, no label: counted as an image, adds no stats
    names = {0: "zero", 1: "one"}
    halves = split_halves(images, names, masks=False)
    assert halves["even"].images == 2 and halves["odd"].images == 1
    assert halves["even"].mAP50_95 == pytest.approx(0.995) and halves["odd"].mAP50_95 == 0
    assert 0 < score_images(images, names, masks=False).mAP50_95 < 0.995
    seg = split_halves([ImageStats(i.path, i.box, i.box) for i in images], names, masks=True)
    assert seg["even"].mask.mAP50_95 == pytest.approx(0.995) and seg["even"].mAP50_95 == seg["even"].mask.mAP50_95


def test_selection_on_hand_made_reports(tmp_path):
    """reports.selection: PTQ competes (qat_best may hold it: epoch 0), ties go to the earlier stage, a choice on
    one half is scored on the other beside Origin and PTQ there; without an evaluated PTQ model the epochs alone
    compete and the PTQ columns stay empty. val_trt.py's add_row keeps the block and its table."""
    from utils.qat.run import reports
    scores = {"AP50": 0.6, "Precision": 0.7, "Recall": 0.4}
    origin = {"name": "Origin", "AP": 0.50, **scores, "halves": {"even": 0.52, "odd": 0.48}}
    ptq = {"name": "PTQ", "AP": 0.47, **scores, "halves": {"even": 0.49, "odd": 0.45}}
    epochs = [{"epoch": 1, "AP": 0.46, "halves": {"even": 0.50, "odd": 0.44}},
              {"epoch": 2, "AP": 0.46, "halves": {"even": 0.47, "odd": 0.46}},
              {"epoch": 3, "AP": 0.45, "halves": {"even": 0.50, "odd": 0.46}}]
    sel = reports.selection([origin, ptq], epochs, best_epoch=0)
    assert (sel["best"]["stage"], sel["best"]["AP"]) == ("PTQ", 0.47) and sel["last"]["epoch"] == 3
    even, odd = sel["selection_free"]["even_to_odd"], sel["selection_free"]["odd_to_even"]
    assert (even["epoch"], even["AP"], even["Origin"], even["PTQ"]) == (1, 0.44, 0.48, 0.45)  # 1 ties 3: earlier
    assert (odd["epoch"], odd["AP"], odd["Origin"], odd["PTQ"]) == (2, 0.47, 0.52, 0.49)
    assert sel["selection_free"]["mean"] == {"AP": 0.455, "Origin": 0.5, "PTQ": 0.47}
    table = reports.selection_table(sel)
    assert "| selection-free | even half | odd half | QAT epoch 1 | 0.4400 | 0.4800 | 0.4500 | -0.0400 | -0.0100 |" in table
    no_ptq = reports.selection([origin], epochs, best_epoch=1)
    assert no_ptq["best"]["PTQ"] is None and no_ptq["selection_free"]["even_to_odd"]["epoch"] == 1
    assert "| best (`qat_best`) | all images | all images | QAT epoch 1 | 0.4600 | 0.5000 |  | -0.0400 |  |" in \
        reports.selection_table(no_ptq)
    assert reports.selection([origin, ptq], [], best_epoch=0) is None  # --ptq-only: nothing was selected
    reports.write_report(tmp_path, [origin, ptq], epochs, "t", selection=sel)
    reports.add_row(tmp_path / "report.json", {"name": "INT8 onnxruntime", "AP": 0.46, **scores})
    assert json.loads((tmp_path / "report.json").read_text())["selection"] == sel
    assert table in (tmp_path / "report.md").read_text()


def test_halves_equal_evaluating_each_half(shapes, tmp_path):
    """A half's AP from the one evaluation equals evaluating that half's images alone (batch 1, so that no
    image's letterbox depends on the others)."""
    import os

    from utils.qat.evaluation.backends import TorchBackend
    from utils.qat.evaluation.data import load_data_yaml
    from utils.qat.evaluation.evaluate import evaluate, half_of
    from utils.qat.model import checkpoint
    model = checkpoint.load_fp(QS)
    data = load_data_yaml(shapes)
    run = functools.partial(evaluate, TorchBackend(model, torch.device("cpu")), imgsz=64, batch_size=1, workers=0)
    whole = run(data)
    images = sorted((shapes.parent / "images" / "val").iterdir())
    for half in ("even", "odd"):
        folder = tmp_path / half / "images" / "val"
        folder.mkdir(parents=True)
        (tmp_path / half / "labels").mkdir()
        os.symlink(shapes.parent / "labels" / "val", tmp_path / half / "labels" / "val")
        for image, h in zip(images, half_of([str(p) for p in images])):
            if h == half:
                (folder / image.name).symlink_to(image)
        alone = run({**data, "val": str(folder)})
        assert alone.images == whole.halves[half].images == len(images) // 2
        assert alone.mAP50_95 == pytest.approx(whole.halves[half].mAP50_95, abs=1e-9), half


@pytest.mark.slow
@pytest.mark.e2e
def test_eval_reproduces_report(yolov9_tree, shapes, quantize_run, tmp_path):
    """The run's QAT checkpoint re-scored by ``qat.py eval`` in a fresh process, with one CPU thread and with two: the
    figures its run recorded, to the last digit. With the average pools on their own scale (the default) no value the
    model quantizes lands on a rounding tie, so the order of a float sum (threads, kernels) decides nothing; with the
    shared scale this agreed in four runs of five (docs/RESULTS.md "One model, one score")."""
    run, _ = quantize_run
    report = json.loads((run / "report.json").read_text())
    qat = next(m for m in report["models"] if m["name"] == "QAT")
    best = run / "weights" / "qat_best_gelan-qs-shapes.pt"
    for threads in ("1", "2"):
        r = run_tool(yolov9_tree, "qat.py", "eval", "--weights", str(best),
                     "--data", str(shapes), "--device", "cpu", "--batch-size", "8", "--imgsz", IMGSZ,
                     "--project", str(tmp_path), "--name", f"e{threads}", "--workers", "2",
                     env={"OMP_NUM_THREADS": threads})
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads((tmp_path / f"e{threads}" / "results.json").read_text())
        assert (result["AP"], result["AP50"]) == (qat["AP"], qat["AP50"]), (threads, result, qat)
    sha = hashlib.sha256(best.read_bytes()).hexdigest()  # the file it scored, printed and recorded
    assert f"scored {best} (sha256 {sha})" in r.stdout and result["provenance"]["weights_sha256"] == sha


@pytest.mark.slow
@pytest.mark.e2e
def test_graph_scores_as_its_checkpoint(yolov9_tree, shapes, quantize_run, tmp_path):
    """The run's QAT checkpoint exported (export_qat.py) and scored on ONNX Runtime by val_trt.py, which computes a
    Q/DQ graph in the checkpoint's arithmetic (integer convolutions, a SiLU rounded once): the figures the run
    recorded, to the last digit; run as the file is (--ort-arithmetic float) it is scored too, in ONNX Runtime's own
    float convolutions."""
    run, _ = quantize_run
    report = json.loads((run / "report.json").read_text())
    qat = next(m for m in report["models"] if m["name"] == "QAT")
    best = tmp_path / "qat_best.pt"
    best.write_bytes((run / "weights" / "qat_best_gelan-qs-shapes.pt").read_bytes())
    r = run_tool(yolov9_tree, "export_qat.py", "--weights", str(best), "--include", "onnx", "--dynamic",
                 "--imgsz", IMGSZ)
    assert r.returncode == 0, r.stderr[-3000:]
    common = ["--onnx", str(best.with_suffix(".onnx")), "--data", str(shapes), "--imgsz", IMGSZ, "--batch-size", "8",
              "--device", "cpu", "--workers", "2", "--project", str(tmp_path)]
    r = run_tool(yolov9_tree, "val_trt.py", *common, "--name", "integer")
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads((tmp_path / "integer" / "results.json").read_text())
    assert (got["AP"], got["AP50"]) == (qat["AP"], qat["AP50"]), (got, qat)
    r = run_tool(yolov9_tree, "val_trt.py", *common, "--name", "float", "--ort-arithmetic", "float")
    assert r.returncode == 0, r.stderr[-3000:]  # the file as ONNX Runtime runs it: scored, in its own arithmetic
    plain = json.loads((tmp_path / "float" / "results.json").read_text())
    assert plain["images"] == got["images"] and abs(plain["AP"] - got["AP"]) < 0.05, (plain, got)


@pytest.mark.slow
@pytest.mark.e2e
def test_eval_fp_needs_allow_fp(yolov9_tree, shapes, tmp_path):
    args = ["qat.py", "eval", "--weights", str(QS), "--data", str(shapes), "--device", "cpu", "--imgsz", IMGSZ,
            "--project", str(tmp_path), "--workers", "2"]
    error = cli_error(yolov9_tree, *args)
    assert "floating-point checkpoint" in error and "--allow-fp" in error
    assert not (tmp_path / "exp").exists()
    r = run_tool(yolov9_tree, *args, "--allow-fp", "--num-image", "8")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "exp" / "results.json").read_text())["images"] == 8


@pytest.mark.slow
@pytest.mark.e2e
def test_sensitive(yolov9_tree, shapes, tmp_path):
    r = run_tool(yolov9_tree, "qat.py", "sensitive", "--weights", str(QS), "--data", str(shapes),
                 "--hyp", "data/hyps/hyp.scratch-high.yaml", "--device", "cpu", "--imgsz", IMGSZ,
                 "--batch-size", "8", "--num-image", "8", "--calib-batches", "1", "--project", str(tmp_path),
                 "--name", "analysis", "--exist-ok", "--workers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "analysis"
    summary = json.loads((out / "summary-sensitive-analysis.json").read_text())
    assert summary["num_image"] == 8
    assert summary["provenance"]["weights_sha256"] == hashlib.sha256(QS.read_bytes()).hexdigest()
    layers = summary["layers"]
    assert len(layers) >= 20 and all({"layer", "module", "AP", "gain"} <= set(l) for l in layers)
    assert [l["AP"] for l in layers] == sorted((l["AP"] for l in layers), reverse=True)
    assert (out / "sensitivity.png").read_bytes()[:4] == b"\x89PNG"
    assert "--skip-layers" in r.stdout and "| Layer |" in r.stdout
    skip = summary["suggested_skip_layers"]
    assert all(s.isdigit() for s in skip.split(",") if s)


@pytest.mark.slow
@pytest.mark.e2e
def test_ptq_only_and_no_eval_flags(yolov9_tree, shapes, tmp_path):
    r = run_tool(yolov9_tree, "qat.py", "quantize", "--weights", str(QS), "--data", str(shapes), "--device", "cpu",
                 "--imgsz", IMGSZ, "--batch-size", "8", "--calib-batches", "1", "--calib-method", "max",
                 "--project", str(tmp_path), "--name", "p", "--no-eval-origin", "--no-eval-ptq", "--ptq-only",
                 "--skip-layers", "22", "--pool-scale", "own", "--workers", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [p.name for p in (tmp_path / "p" / "weights").iterdir()] == ["ptq_gelan-qs-shapes.pt"]
    assert json.loads((tmp_path / "p" / "report.json").read_text())["models"] == []
    said = "No model was evaluated in this run (--no-eval-origin, --no-eval-ptq)"
    assert said in r.stdout and said in (tmp_path / "p" / "report.md").read_text() and "| Model |" not in r.stdout
    from utils.qat.model import checkpoint
    ckpt = checkpoint.read(tmp_path / "p" / "weights" / "ptq_gelan-qs-shapes.pt")
    assert ckpt["quant"]["skip"] == ["22"] and ckpt["quant"]["calib_method"] == "max"
    assert ckpt["quant"]["pool_scale"] == "own"


def _error(tree, tmp_path, *args) -> str:
    return cli_error(tree, "qat.py", *args, "--device", "cpu", "--imgsz", IMGSZ, "--project", str(tmp_path),
                     "--workers", "2")


@pytest.mark.slow
def test_errors(yolov9_tree, shapes, quantize_run, tmp_path):
    run, _ = quantize_run
    qbest = str(run / "weights" / "qat_best_gelan-qs-shapes.pt")
    data = str(shapes)
    assert "weights file not found" in _error(yolov9_tree, tmp_path, "quantize", "--weights", "nope.pt", "--data", data)
    junk = tmp_path / "junk.pt"
    junk.write_text("hello")
    assert "not a PyTorch checkpoint" in _error(yolov9_tree, tmp_path, "eval", "--weights", str(junk), "--data", data)
    assert "quantized" in _error(yolov9_tree, tmp_path, "quantize", "--weights", qbest, "--data", data)
    assert "quantized" in _error(yolov9_tree, tmp_path, "sensitive", "--weights", qbest, "--data", data)
    assert "dataset yaml not found" in _error(yolov9_tree, tmp_path, "quantize", "--weights", str(QS), "--data", "x.yaml")
    cfg = yaml.safe_load(shapes.read_text())
    bad = tmp_path / "noval.yaml"
    bad.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k != "val"}))
    assert "no 'val:'" in _error(yolov9_tree, tmp_path, "eval", "--weights", qbest, "--data", str(bad))
    bad.write_text(yaml.safe_dump({**cfg, "nc": 7}))
    assert "nc: 7" in _error(yolov9_tree, tmp_path, "eval", "--weights", qbest, "--data", str(bad))
    empty = tmp_path / "empty" / "images"
    empty.mkdir(parents=True)
    bad.write_text(yaml.safe_dump({**cfg, "path": str(tmp_path / "empty"), "val": "images"}))
    assert "holds no images" in _error(yolov9_tree, tmp_path, "eval", "--weights", qbest, "--data", str(bad))
    if not torch.cuda.is_available():
        error = cli_error(yolov9_tree, "qat.py", "eval", "--weights", qbest, "--data", data, "--device", "cuda:0",
                          "--project", str(tmp_path))
        assert "no CUDA GPU" not in error and "none is available" in error
    assert not list(tmp_path.glob("exp*")), "a failed command must not leave a run folder behind"


@pytest.mark.slow
def test_wrong_task_named(yolov9_tree, shapes, tmp_path):
    from models.yolo import SegmentationModel
    seg = SegmentationModel(cfg=str(yolov9_tree / "models" / "segment" / "gelan-c-seg.yaml"), ch=3, nc=6)
    torch.save({"model": seg.half(), "epoch": 0}, tmp_path / "seg.pt")
    msg = _error(yolov9_tree, tmp_path, "quantize", "--weights", str(tmp_path / "seg.pt"), "--data", str(shapes))
    assert "segment model" in msg and "segment/qat_seg.py" in msg


@pytest.mark.slow
@pytest.mark.e2e
def test_imgsz_rounded_and_run_dir_incremented(yolov9_tree, shapes, tmp_path):
    args = ["qat.py", "eval", "--weights", str(QS), "--allow-fp", "--data", str(shapes), "--device", "cpu",
            "--imgsz", "100", "--num-image", "4", "--project", str(tmp_path), "--name", "e", "--workers", "2"]
    for _ in range(2):
        r = run_tool(yolov9_tree, *args)
        assert r.returncode == 0, r.stderr[-2000:]
    assert "not a multiple of the model stride 32; using 128" in r.stdout
    assert (tmp_path / "e" / "results.json").exists() and (tmp_path / "e2" / "results.json").exists()
