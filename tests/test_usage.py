"""The commands users type: every command of README's Usage and of the reference project's README parses with
the flags as written, the reference user's `qat.py eval` without --data runs on the tree's data/coco.yaml, and
every relative link of the docs a user follows leads to a file."""
from __future__ import annotations

import importlib
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, cli_error, run_tool

QS = REPO / "weights" / "gelan-qs-shapes.pt"
TOOLS = {"qat.py": "qat", "segment/qat_seg.py": "segment.qat_seg", "export_qat.py": "export_qat",
         "export_yoloV9.py": "export_yoloV9", "reparameterization.py": "reparameterization", "val_trt.py": "val_trt"}

# levipereira/yolov9-qat README (its Usage, Reparameterize, Export and TensorRT sections), flags as written there,
# and the execution record of one of its users (qat.py eval without --data).
REFERENCE = [
    "python3 qat.py quantize --weights yolov9-c-converted.pt  --name yolov9_qat --exist-ok",
    "python3 qat.py quantize --weights yolov9-c-converted.pt --data data/coco.yaml --hyp data/hyps/hyp.scratch-high.yaml"
    " --device cuda:0 --batch-size 16 --imgsz 640 --project runs/qat --name yolov9_qat --exist-ok --iters 200 --seed 57"
    " --supervision-stride 1",
    "python3 qat.py quantize --weights runs/train/exp/weights/best-converted.pt --data custom_dataset.yaml"
    " --hyp data/hyps/hyp.scratch-high.yaml --device cuda:0 --batch-size 32 --imgsz 640 --project runs/qat"
    " --name custom_qat_experiment --exist-ok --iters 300 --supervision-stride 2 --no-eval-origin --no-eval-ptq",
    "python qat.py sensitive --weights yolov9-c.pt --data data/coco.yaml --hyp hyp.scratch-high.yaml",
    "python3 qat.py sensitive --weights runs/train/exp/weights/best.pt --data custom_dataset.yaml"
    " --hyp data/hyps/hyp.scratch-high.yaml --device cuda:0 --batch-size 32 --imgsz 640 --project runs/qat_sensitive"
    " --name custom_analysis --exist-ok --num-image 1000",
    "python3 qat.py eval --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt  --name eval_qat_yolov9",
    "python qat.py eval --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt"
    " --name eval_qat_yolov9_reparameterize",
    "python3 qat.py eval --weights runs/qat/custom_experiment/weights/qat_best_model.pt --data custom_dataset.yaml"
    " --device cuda:0 --batch-size 32 --imgsz 640 --conf-thres 0.25 --iou-thres 0.45 --project runs/qat_eval"
    " --name custom_eval --exist-ok",
    "python3 export_qat.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --include onnx --dynamic --simplify"
    " --inplace",
    "python3 export_qat.py  --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --include onnx_end2end",
    "python3 export_yoloV9.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --simplify",
    "python3 export_yoloV9.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --size 640 --dynamic --simplify",
    "python3 export_yoloV9.py --weights runs/qat/yolov9_qat/weights/qat_best_yolov9-c.pt --batch 4 --size 640 640",
    "python3 reparameterization.py --cfg models/detect/gelan-c.yaml --weights runs/train/exp/weights/best.pt --model c"
    " --device cuda:0 --classes_num 80 --save yolov9-c-converted.pt",
    "python3 reparameterization.py --weights runs/train/exp/weights/best.pt --model c --save yolov9-c-converted.pt",
    "./scripts/val_trt.sh runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt data/coco.yaml 640",
    "./scripts/val_trt.sh runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt data/coco.yaml 640 --generate-graph",
]


def readme_commands() -> list[str]:
    """The toolkit commands in README's bash blocks (continuation lines joined, optional [..] parts dropped)."""
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", re.sub(r"\[[^\]]*\]", "", line)).strip()
            if any(f" {tool} " in f" {line} " for tool in TOOLS) or "scripts/val_trt.sh" in line:
                commands.append(line)
    return commands


def _argv(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command)
    for i, word in enumerate(words):
        if word in TOOLS or word.endswith("val_trt.sh"):
            return word, words[i + 1:]
    raise AssertionError(f"no toolkit command in {command!r}")


def test_readme_lists_the_usage_commands():
    tools = {_argv(c)[0] for c in readme_commands()}
    assert set(TOOLS) <= tools and "./scripts/val_trt.sh" in tools


def _doc_links() -> list[tuple[str, str]]:
    """(document, target) for each relative Markdown link of README, docs/ and the result sets' READMEs."""
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "benchmarks" / "results").rglob("README.md"))]
    return [(str(doc.relative_to(REPO)), target) for doc in docs
            for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
            if not re.match(r"[a-z]+:", target)]


def test_every_relative_link_in_the_docs_resolves():
    links = _doc_links()
    assert len(links) > 100  # the README alone links dozens of result sets
    broken = [f"{doc} -> {target}" for doc, target in links if not (REPO / doc).parent.joinpath(target).exists()]
    assert not broken, "links to nothing: " + "; ".join(broken)


@pytest.mark.parametrize("command", readme_commands() + REFERENCE)
def test_command_parses_as_written(yolov9_tree, command):
    tool, argv = _argv(command)
    if tool.endswith(".sh"):  # its arguments parse: it gets as far as the files it was given
        r = subprocess.run(["bash", str(REPO / "scripts" / "val_trt.sh"), *argv], capture_output=True, text=True)
        assert r.returncode == 2 and "usage" not in r.stderr and "not found" in r.stderr, r.stderr
        return
    args = importlib.import_module(TOOLS[tool]).get_args_parser().parse_args(argv)
    if "--data" not in argv and hasattr(args, "data"):
        assert args.data is None  # the tree's data/coco.yaml (tested below)


@pytest.fixture(scope="module")
def reference_tree(yolov9_tree, tmp_path_factory):
    """A copy of the patched tree whose data/coco.yaml is a small shapes dataset (8 train, 4 val images: the
    commands below run at their default 640 px), with the reference's file names: yolov9-c-converted.pt (the
    embedded model) and, quantized from it, runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt."""
    root = tmp_path_factory.mktemp("reference")
    tree = root / "yolov9"
    shutil.copytree(yolov9_tree, tree, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "runs"))
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_shapes_dataset.py"), "--out", str(root / "shapes"),
                    "--train", "8", "--val", "4", "--imgsz", "256"], check=True, capture_output=True)
    shutil.copyfile(root / "shapes" / "shapes.yaml", tree / "data" / "coco.yaml")
    shutil.copyfile(QS, tree / "yolov9-c-converted.pt")
    from helpers import real_images
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.model import checkpoint
    fp = checkpoint.load_fp(QS)
    # a quick PTQ stands in for the reference's quantize run
    qmodel, info = quantize(fp, [real_images(root / "shapes" / "images" / "train", 8, 128)],
                            QuantConfig(method="max", head_amax="calibrated"))
    qmodel.names = fp.names
    checkpoint.save_quantized(tree / "runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt", qmodel, info)
    return tree


@pytest.mark.slow
@pytest.mark.e2e
def test_reference_users_eval_without_data(reference_tree):
    """The execution record's command, exactly: no --data, no --device, every other default."""
    r = run_tool(reference_tree, "qat.py", "eval", "--weights",
                 "runs/qat/yolov9_qat/weights/qat_best_yolov9-c-converted.pt", "--name", "eval_qat_yolov9_reparameterize")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "data: data/coco.yaml (--data not given: the default)" in r.stdout
    result = json.loads((reference_tree / "runs/qat_eval/eval_qat_yolov9_reparameterize/results.json").read_text())
    assert result["images"] == 4 and result["AP"] > 0.3


def test_default_data_without_coco_says_how_to_get_it(yolov9_tree, tmp_path, capsys):
    """With upstream's own data/coco.yaml and no COCO beside the tree: one sentence naming the yaml used."""
    error = cli_error(yolov9_tree, "qat.py", "quantize", "--weights", str(QS), "--name", "yolov9_qat", "--exist-ok",
                      "--project", str(tmp_path / "runs"), "--device", "cpu")
    assert "data: data/coco.yaml (--data not given: the default)" in capsys.readouterr().out
    assert error.startswith("the 'train' images of ") and "data/coco.yaml were not found at" in error, error
    assert "download the dataset first" in error and "scripts/get_coco.sh" in error
    assert not (tmp_path / "runs").exists()


def test_hyp_by_bare_name(yolov9_tree, monkeypatch, tmp_path, capsys):
    """`--hyp hyp.scratch-high.yaml`, as the reference's README types it, is the tree's data/hyps file, and so is
    the default `data/hyps/...` from another folder; `none` is no augmentation."""
    from utils.qat.evaluation.data import hyp_argument, load_hyp
    monkeypatch.chdir(tmp_path)
    assert load_hyp("hyp.scratch-high.yaml")["lr0"] > 0
    shown, hyp = hyp_argument("hyp.scratch-high.yaml")
    assert shown == str(yolov9_tree / "data/hyps/hyp.scratch-high.yaml") and hyp["mosaic"] > 0
    assert hyp_argument(None, "detect")[0] == shown  # the detection default, from outside the tree
    assert hyp_argument("none", "detect") == ("none", None) and hyp_argument(None, "segment") == ("none", None)
    out = capsys.readouterr().out
    assert f"hyp: {shown} (augmentation of the fine-tuning images)\n" in out
    assert f"hyp: {shown} (augmentation of the fine-tuning images; the default for detect)" in out
    assert "hyp: none (no augmentation of the fine-tuning images; the default for segment)" in out


@pytest.mark.parametrize("script, default", [("qat.py", "data/hyps/hyp.scratch-high.yaml"),
                                             ("segment/qat_seg.py", "none")])
def test_quantize_help_shows_the_hyp_default(yolov9_tree, script, default):
    """The measured recipe is the default: `quantize --help` names the augmentation it fine-tunes with."""
    r = run_tool(yolov9_tree, script, "quantize", "--help")
    assert r.returncode == 0, r.stderr
    help_text = " ".join(r.stdout.split())
    assert f"(default: {default}, as measured for this task in docs/QAT.md)" in help_text, help_text
