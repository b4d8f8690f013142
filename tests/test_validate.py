"""Every numeric and choice flag of every CLI is checked before any work: one sentence naming the flag, the
value and the valid range, exit 2, no run folder. A label with a class id >= nc is refused by file and line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, cli_error, cli_module, run_tool

QS = REPO / "weights" / "gelan-qs-shapes.pt"


# (tool, arguments, the sentence's expected middle); every case also passes --weights/--onnx where needed.
OUT_OF_RANGE = [
    ("qat.py", "quantize --batch-size 0", "--batch-size 0 is out of range: it must be at least 1."),
    ("qat.py", "quantize --imgsz 0", "--imgsz 0 is out of range: it must be at least 32"),
    ("qat.py", "quantize --calib-method percentile --percentile 150",
     "--percentile 150 is out of range: it must be greater than 0 and at most 100"),
    ("qat.py", "quantize --iters 0", "--iters 0 is out of range: it must be at least 1 (for PTQ only, without "
                                     "fine-tuning, pass --ptq-only instead)."),
    ("qat.py", "quantize --epochs 0", "--epochs 0 is out of range: it must be at least 1 (for PTQ only"),
    ("qat.py", "quantize --lr 0", "--lr 0 is out of range: it must be greater than 0 and at most 1"),
    ("qat.py", "quantize --lr nan", "--lr nan is out of range"),
    ("qat.py", "quantize --calib-batches 0", "--calib-batches 0 is out of range"),
    ("qat.py", "quantize --workers -1", "--workers -1 is out of range: it must be at least 0."),
    ("qat.py", "quantize --seed -1", "--seed -1 is out of range: it must be between 0 and 4294967295."),
    ("qat.py", "quantize --supervision-stride 0", "--supervision-stride 0 is out of range"),
    ("qat.py", "quantize --ema 1", "--ema 1 is out of range: it must be at least 0 and less than 1"),
    ("qat.py", "quantize --weight-decay -0.1", "--weight-decay -0.1 is out of range: it must be between 0 and 1."),
    ("qat.py", "quantize --warmup -1", "--warmup -1 is out of range: it must be at least 0."),
    ("qat.py", "quantize --conf-thres 1.5", "--conf-thres 1.5 is out of range: it must be between 0 and 1."),
    ("qat.py", "quantize --iou-thres -0.1", "--iou-thres -0.1 is out of range"),
    ("qat.py", "sensitive --num-image 0", "--num-image 0 is out of range"),
    ("qat.py", "sensitive --top 0", "--top 0 is out of range"),
    ("qat.py", "eval --conf-thres 2", "--conf-thres 2 is out of range"),
    ("segment/qat_seg.py", "quantize --batch-size -4", "--batch-size -4 is out of range"),
    ("segment/qat_seg.py", "quantize --mask-gain -1", "--mask-gain -1 is out of range"),
    ("export_qat.py", "--imgsz 640 0", "--imgsz 0 is out of range"),
    ("export_qat.py", "--batch-size 0", "--batch-size 0 is out of range"),
    ("export_qat.py", "--opset 12", "--opset 12 is out of range: it must be between 13 and 20"),
    ("export_qat.py", "--opset 99", "--opset 99 is out of range"),
    ("export_yoloV9.py", "--size 0", "--size 0 is out of range"),
    ("export_yoloV9.py", "--batch 0", "--batch 0 is out of range"),
    ("val_trt.py", "--onnx x.onnx --batch-size 0", "--batch-size 0 is out of range"),
    ("val_trt.py", "--onnx x.onnx --imgsz 16", "--imgsz 16 is out of range"),
    ("val_trt.py", "--onnx x.onnx --max-det 0", "--max-det 0 is out of range"),
    ("val_trt.py", "--onnx x.onnx --num-image 0", "--num-image 0 is out of range"),
    ("reparameterization.py", "--model c --classes_num 0", "--classes_num 0 is out of range"),
    ("trtexec", "build m.onnx m.engine --min 0", "--min 0 is out of range"),
    ("trtexec", "build m.onnx m.engine --workspace-mib 0", "--workspace-mib 0 is out of range"),
    ("scripts/benchmark_trt.py", "--batch 1 0", "--batch 0 is out of range"),
    ("scripts/benchmark_trt.py", "--duration 0", "--duration 0 is out of range"),
    ("scripts/benchmark_cpu.py", "--model m a.onnx b.onnx --threads 0", "--threads 0 is out of range"),
    ("scripts/benchmark_cpu.py", "--model m a.onnx b.onnx --runs 0", "--runs 0 is out of range"),
    ("scripts/benchmark_cpu.py", "--model m a.onnx b.onnx --batch 1 0", "--batch 0 is out of range"),
]

CHOICES = [
    ("qat.py", "quantize --calib-method bogus", "--calib-method"),
    ("qat.py", "quantize --qat-loss kl", "--qat-loss"),
    ("qat.py", "quantize --optimizer lamb", "--optimizer"),
    ("export_qat.py", "--include tflite", "--include"),
    ("export_qat.py", "--nms bogus", "--nms"),
    ("val_trt.py", "--onnx x.onnx --backend bogus", "--backend"),
    ("val_trt.py", "--onnx x.onnx --task classify", "--task"),
    ("reparameterization.py", "--model z", "--model"),
]


def _args(tool: str, args: str) -> list[str]:
    weights = ["--weights", "nope.pt"] if tool not in ("val_trt.py", "trtexec", "scripts/benchmark_trt.py",
                                                       "scripts/benchmark_cpu.py") else []
    return args.split()[:1] + weights + args.split()[1:] if tool in ("qat.py", "segment/qat_seg.py") else \
        weights + args.split()


@pytest.mark.parametrize("tool,args,message", OUT_OF_RANGE, ids=[f"{t} {a}" for t, a, _ in OUT_OF_RANGE])
def test_out_of_range_named_before_any_work(yolov9_tree, tmp_path, tool, args, message):
    # run in tmp_path: nothing may be written there, nothing read (nope.pt does not exist)
    error = cli_error(yolov9_tree, tool, *_args(tool, args), cwd=tmp_path)
    assert message in error, error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tool,args,flag", CHOICES, ids=[f"{t} {a}" for t, a, _ in CHOICES])
def test_choices_named(yolov9_tree, capsys, tool, args, flag):
    with pytest.raises(SystemExit) as e:
        cli_module(yolov9_tree, tool).get_args_parser().parse_args(_args(tool, args))
    assert e.value.code == 2
    assert f"argument {flag}: invalid choice: '{args.split()[-1]}' (choose from" in capsys.readouterr().err


def test_range_sentences():
    from utils.qat.core.validate import Range, check_value
    assert str(Range(1)) == "at least 1" and str(Range(0, 1)) == "between 0 and 1"
    assert str(Range(0, 100, low_open=True)) == "greater than 0 and at most 100"
    assert str(Range(high=5, high_open=True)) == "less than 5"
    assert 1e-5 in Range(0, 1, low_open=True) and float("inf") not in Range(0) and float("nan") not in Range()
    check_value("--imgsz", [640, 480])
    check_value("--num-image", None)


def _one_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), r.stderr[-2000:]
    return lines[0]


def _quantize_args(shapes, tmp_path) -> list[str]:
    return ["--weights", str(QS), "--data", str(shapes), "--device", "cpu", "--project", str(tmp_path / "runs"),
            "--workers", "2", "--imgsz", "128"]


def test_cli_exits_2_and_creates_nothing(yolov9_tree, shapes, tmp_path):
    """The contract every CLI keeps through run_cli, as a user meets it: exit status 2, one line `error: <one
    sentence>.` on stderr, no run folder. (The other error tests run the CLIs' main in-process: cli_error.)"""
    common = _quantize_args(shapes, tmp_path)
    msg = _one_error(run_tool(yolov9_tree, "qat.py", "quantize", *common, "--batch-size", "0"))
    assert msg == "error: --batch-size 0 is out of range: it must be at least 1."
    assert not (tmp_path / "runs").exists()


def test_skip_layers_checked_before_the_origin_evaluation(yolov9_tree, shapes, tmp_path, capsys):
    common = _quantize_args(shapes, tmp_path)
    assert "999 is not a layer of this model" in cli_error(yolov9_tree, "qat.py", "quantize", *common,
                                                           "--skip-layers", "999")
    out = capsys.readouterr()
    assert "Origin" not in out.out + out.err
    assert not (tmp_path / "runs").exists()
    assert "--search-layers 'two': give layer indices and ranges" in cli_error(
        yolov9_tree, "qat.py", "quantize", *common, "--search-layers", "two")
    error = cli_error(yolov9_tree, "qat.py", "quantize", *common, "--search-layers", "3,40-41")
    assert error.startswith("--search-layers 40-41: this model's layers before its detect head are 0-"), error
    out = capsys.readouterr()
    assert "Origin" not in out.out + out.err
    assert not (tmp_path / "runs").exists()


def test_val_trt_sh_ranges(tmp_path):
    weights, data = tmp_path / "w.pt", tmp_path / "d.yaml"
    weights.write_bytes(b"x")
    data.write_text("val: images\n")
    sh = str(REPO / "scripts" / "val_trt.sh")
    r = subprocess.run(["bash", sh, str(weights), str(data), "16"], capture_output=True, text=True)
    assert _one_error(r) == "error: image size 16 is out of range: it must be an integer of at least 32 (e.g. 640)."
    r = subprocess.run(["bash", sh, str(weights), str(data), "640"], capture_output=True, text=True,
                       env={**os.environ, "VAL_TRT_MAX_BATCH": "0"})
    assert "VAL_TRT_MAX_BATCH=0 is out of range" in _one_error(r)


def test_label_class_beyond_nc_refused_by_file_and_line(yolov9_tree, shapes, tmp_path):
    """Upstream's loader takes class 99 of a 6-class dataset without a word ('0 corrupt'); refused here with
    the file and the line, before anything is evaluated or calibrated."""
    import shutil

    import yaml
    root = tmp_path / "shapes"
    shutil.copytree(shapes.parent, root, ignore=shutil.ignore_patterns("*.cache"))
    cfg = yaml.safe_load(shapes.read_text())
    (root / "bad.yaml").write_text(yaml.safe_dump({**cfg, "path": str(root)}))
    label = sorted((root / "labels" / "train").glob("*.txt"))[2]
    lines = label.read_text().splitlines()
    lines[1] = "99 " + lines[1].split(None, 1)[1]
    label.write_text("\n".join(lines) + "\n")
    error = cli_error(yolov9_tree, "qat.py", "quantize", "--weights", str(QS), "--data", str(root / "bad.yaml"),
                      "--device", "cpu", "--project", str(tmp_path / "runs"), "--workers", "2")
    assert error == (f"{label}:2 has class 99, but {root / 'bad.yaml'} has nc: 6 (classes 0-5); fix that label, or nc "
                     f"and names in the yaml.")
    assert not (tmp_path / "runs").exists()


def test_shell_and_dataset_script_ranges(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / "quickstart.sh"), str(tmp_path / "qs")], capture_output=True,
                       text=True, env={**os.environ, "QS_ITERS": "0"})
    assert _one_error(r) == "error: QS_ITERS=0 is out of range: it must be an integer of at least 1."
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_shapes_dataset.py"), "--out", str(tmp_path / "s"),
                        "--imgsz", "8"], capture_output=True, text=True)
    assert _one_error(r) == "error: --imgsz 8 is out of range: it must be at least 32."
    assert not list(tmp_path.iterdir())
