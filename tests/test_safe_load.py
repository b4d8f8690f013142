"""A checkpoint never runs code while it is loaded (utils/qat/model/safe_load.py).

Payloads written the way an attacker writes them (``__reduce__`` calling os.system, builtins.eval, subprocess.Popen,
each touching a marker file), on their own, hidden in ``opt`` of an otherwise genuine training checkpoint, and in a
nested dict of a real quantized checkpoint's modelopt state: every command that reads a .pt refuses each with one
sentence naming the global, and no marker appears. Every genuine kind loads without a flag in a fresh process;
``--trust-weights`` loads a file with an unknown but harmless class. Models are TINY_GELAN variants (the reference
GELAN-C and GELAN-S weights are only read), so building every kind costs a few seconds.
"""
from __future__ import annotations

import argparse
import builtins
import copy
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, cli_error, cli_module, run_main, run_tool, tree_has
from helpers import TINY_GELAN, build

MARKERS: Path | None = None  # where the payloads would write; set by the `markers` fixture


class SystemPayload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class EvalPayload(SystemPayload):
    def __reduce__(self):
        return builtins.eval, (f"open({str(self.marker)!r}, 'w')",)


class PopenPayload(SystemPayload):
    def __reduce__(self):
        return subprocess.Popen, (["touch", str(self.marker)],)


PAYLOADS = {"os.system": (SystemPayload, "posix.system" if os.name != "nt" else "nt.system"),
            "builtins.eval": (EvalPayload, "builtins.eval"),
            "subprocess.Popen": (PopenPayload, "subprocess.Popen")}
SEG_CFG = {**TINY_GELAN, "head": TINY_GELAN["head"][:-1] + [[[15, 18, 21], 1, "Segment", ["nc", 8, 32]]]}
DUAL_CFG = {**TINY_GELAN, "head": TINY_GELAN["head"][:-1] + [[[15, 18, 21, 15, 18, 21], 1, "DualDDetect", ["nc"]]]}


def train_checkpoint(model: torch.nn.Module, half: bool = True) -> dict:
    """What upstream train.py / train_dual.py save every epoch (its keys and value types)."""
    from utils.metrics import fitness
    from utils.torch_utils import smart_optimizer
    model = copy.deepcopy(model)
    model.hyp, model.class_weights = {"lr0": 0.01, "box": 7.5}, torch.ones(int(model.yaml["nc"]))
    optimizer = smart_optimizer(model, "SGD", 0.01, 0.937, 5e-4)
    opt = argparse.Namespace(weights="", cfg="models/detect/gelan-c.yaml", data=Path("data/coco.yaml"),
                             project=Path("runs/train"), save_dir="runs/train/exp", hyp={"lr0": 0.01}, epochs=3,
                             imgsz=640, device="", evolve=None, resume=False)
    cast = (lambda m: m.half()) if half else (lambda m: m)
    return {"epoch": 2, "best_fitness": fitness(np.array([[0.5, 0.4, 0.3, 0.2]])), "model": cast(copy.deepcopy(model)),
            "ema": cast(copy.deepcopy(model)), "updates": 12, "optimizer": optimizer.state_dict(), "opt": vars(opt),
            "git": {"remote": "https://github.com/WongKinYiu/yolov9", "branch": "main", "commit": "5b1ea9a"},
            "date": datetime.datetime.now().isoformat()}


@pytest.fixture(scope="module")
def markers(tmp_path_factory) -> Path:
    global MARKERS
    MARKERS = tmp_path_factory.mktemp("markers")
    return MARKERS


def no_payload_ran(markers: Path) -> None:
    assert not list(markers.iterdir()), f"a payload ran: {sorted(p.name for p in markers.iterdir())}"


@pytest.fixture(scope="module")
def genuine(yolov9_tree, tmp_path_factory, gelan_c) -> dict[str, Path]:
    """Every genuine kind, by name: train.py checkpoints (FP16, FP32, stripped), a dual-head and a segmentation
    training checkpoint, a converted GELAN (reparameterization's writer), a quantized one, the reference weights."""
    from utils.qat.core import yolov9
    from utils.qat.model import checkpoint
    from utils.qat.quantize.model_quant import QuantConfig, quantize
    from utils.qat.model.reparam import save_checkpoint
    d = tmp_path_factory.mktemp("genuine")
    det, dual = build(TINY_GELAN), build(DUAL_CFG)
    seg = yolov9.build(SEG_CFG, task="segment")
    seg.names = {i: f"class{i}" for i in range(4)}
    kinds = {"train-fp16": train_checkpoint(det), "train-fp32": train_checkpoint(det, half=False),
             "train-dual": train_checkpoint(dual), "train-segment": train_checkpoint(seg)}
    stripped = {**train_checkpoint(det), "optimizer": None, "ema": None, "updates": None, "epoch": -1}
    kinds["stripped"] = {**stripped, "best_fitness": np.float64(0.61)}  # a numpy scalar, as other YOLO versions keep
    paths = {name: d / f"{name}.pt" for name in kinds}
    for name, ckpt in kinds.items():
        torch.save(ckpt, paths[name])
    paths["converted"] = save_checkpoint(det, d / "converted.pt")
    x = torch.rand(4, 3, 64, 64)
    qmodel, info = quantize(det, [x[:2], x[2:]], QuantConfig(method="max", head_amax="calibrated"), example=x[:1])
    qmodel.names = det.names
    paths["quantized"] = checkpoint.save_quantized(d / "quantized.pt", qmodel, info, arguments={"weights": "w.pt"})
    paths["reference"] = gelan_c
    if tree_has(yolov9_tree, "ELAN1"):  # GELAN-S is built of ELAN1 blocks, which the stand-in tree lacks
        paths["reference-s"] = gelan_c.with_name("gelan-s-coco334.pt")
    return paths


@pytest.fixture(scope="module")
def payloads(genuine, markers, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """``"<payload> in <place>"`` -> (file, the global it must be refused for)."""
    d = tmp_path_factory.mktemp("payloads")
    train = torch.load(genuine["train-fp32"], map_location="cpu", weights_only=False)
    quantized = torch.load(genuine["quantized"], map_location="cpu", weights_only=False)
    out = {}
    for kind, (cls, name) in PAYLOADS.items():
        slug = kind.replace(".", "-")
        places = {"alone": {"model": cls(markers / f"{slug}-alone")},
                  "opt": {**train, "opt": {**train["opt"], "cache": cls(markers / f"{slug}-opt")}}}
        q = copy.deepcopy(quantized)
        q["modelopt_state"]["modelopt_state_dict"][0][1]["metadata"]["extra"] = {"x": cls(markers / f"{slug}-mto")}
        places["modelopt state"] = q
        for place, ckpt in places.items():
            path = d / f"{slug}-{place.replace(' ', '-')}.pt"
            torch.save(ckpt, path)
            out[f"{kind} in {place}"] = (path, name)
    return out


def test_genuine_kinds_load_without_the_flag_in_a_fresh_process(yolov9_tree, genuine):
    """Each kind read by checkpoint.read in a new process (no class imported beforehand by the test), and what it
    holds is usable: the models, upstream's opt and best_fitness, the segmentation head's method, the quantized
    model rebuilt."""
    script = textwrap.dedent("""
        import json, sys, types
        from utils.qat.core import compat
        compat.apply()
        from utils.qat.model import checkpoint
        out = {}
        for name, path in json.loads(sys.argv[1]).items():
            ckpt = checkpoint.read(path)
            if checkpoint.is_quantized(ckpt):
                model = checkpoint.load_quantized(path, ckpt=ckpt)[0]
            else:
                model = checkpoint.load_fp(path, task=checkpoint.task_of(ckpt), ckpt=ckpt)
            head = model.model[-1]
            out[name] = {"model": type(model).__name__, "head": type(head).__name__,
                         "detect": isinstance(getattr(head, "detect", None), types.FunctionType),
                         "opt": {k: type(v).__name__ for k, v in (ckpt.get("opt") or {}).items()},
                         "best_fitness": type(ckpt.get("best_fitness")).__name__,
                         "optimizer": sorted(ckpt.get("optimizer") or {})}
        print(json.dumps(out))
        """)
    r = run_tool(yolov9_tree, "-c", script, json.dumps({k: str(v) for k, v in genuine.items()}))
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(got) == set(genuine)
    assert got["train-fp16"]["best_fitness"] == "ndarray" and got["stripped"]["best_fitness"] == "float64"
    assert got["train-fp16"]["opt"]["data"] == "PosixPath" and got["train-fp32"]["optimizer"] == ["param_groups", "state"]
    assert got["train-dual"]["head"] == "DualDDetect" and got["reference"]["head"] == "DDetect"
    assert got["train-segment"] == {**got["train-segment"], "model": "SegmentationModel", "head": "Segment",
                                    "detect": True}  # upstream's Segment keeps Detect.forward: getattr, restricted
    assert got["quantized"]["model"] == "DetectionModel"


@pytest.mark.parametrize("kind", PAYLOADS)
def test_each_payload_is_refused_before_it_runs(yolov9_tree, payloads, markers, kind):
    from utils.qat.model import safe_load
    from utils.qat.core.errors import QATError
    for where in ("alone", "opt", "modelopt state"):
        path, name = payloads[f"{kind} in {where}"]
        with pytest.raises(QATError) as e:
            safe_load.load(path)
        assert str(e.value) == (f"{path} was not loaded: it names {name}, which runs code; if you trust the file, "
                                f"pass --trust-weights to load it with the full pickle.")
    no_payload_ran(markers)


def _benchmark(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# command -> (its script or benchmark, its arguments; W: the weights, D: a data yaml), run from a scratch folder
COMMANDS = {
    "qat.py quantize": ("qat.py", "quantize --weights W --data D --device cpu --project runs"),
    "qat.py sensitive": ("qat.py", "sensitive --weights W --data D --device cpu --project runs"),
    "qat.py eval": ("qat.py", "eval --weights W --data D --device cpu --project runs"),
    "segment/qat_seg.py eval": ("segment/qat_seg.py", "eval --weights W --data D --device cpu --project runs"),
    "export_qat.py": ("export_qat.py", "--weights W --imgsz 64"),
    "export_yoloV9.py": ("export_yoloV9.py", "--weights W --size 64"),
    "reparameterization.py": ("reparameterization.py", "--weights W --model c --save converted.pt"),
    "benchmarks/quantizer_sensitivity.py": ("quantizer_sensitivity", "--weights W --data D --out bench --device cpu"),
    "benchmarks/qat_recipes.py": ("qat_recipes", "--weights W --data D --out bench --device cpu --recipes head:lr=1e-5"),
    "benchmarks/autocast.py": ("autocast", "--weights W --data D --out bench"),
    "benchmarks/reference.py": ("reference", "--weights W --data D --out bench --stages fp --device cpu"),
}


def command_error(tree: Path, command: str, weights: Path, data: Path, cwd: Path) -> str:
    """The QATError sentence ``command`` fails with on ``weights`` (in this process, from ``cwd``)."""
    from utils.qat.core.errors import QATError
    tool, line = COMMANDS[command]
    args = [{"W": str(weights), "D": str(data)}.get(a, a) for a in line.split()]
    if tool.endswith(".py"):
        return cli_error(tree, tool, *args, cwd=cwd)
    module = _benchmark(tool)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with pytest.raises(QATError) as e:
            module.main(module.get_args_parser().parse_args(args))
    finally:
        os.chdir(here)
    return str(e.value)


def files_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("*") if p.is_file() or p.is_symlink())


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_every_payload(yolov9_tree, payloads, markers, small_data, tmp_path, command, capsys):
    """Each command x payload x place: the sentence names the file and the global; nothing ran, nothing written."""
    for label, (path, name) in payloads.items():
        message = command_error(yolov9_tree, command, path, small_data, tmp_path)
        assert message.startswith(f"{path} was not loaded: it names {name}, which runs code;"), (label, message)
        assert message.endswith("pass --trust-weights to load it with the full pickle."), message
        with capsys.disabled():
            print(f"\n[{command}] {label}: error: {message}", end="")
    no_payload_ran(markers)
    assert files_in(tmp_path) == []


def test_the_flag_is_on_every_command_that_reads_weights(yolov9_tree):
    for command, (tool, line) in {**COMMANDS, "benchmarks/ddp.py": ("ddp", "--weights W --data D --out o")}.items():
        module = cli_module(yolov9_tree, tool) if tool.endswith(".py") else _benchmark(tool)
        assert module.get_args_parser().parse_args([*line.split(), "--trust-weights"]).trust_weights, command


@pytest.fixture(scope="module")
def harmless(genuine, tmp_path_factory) -> Path:
    """A genuine FP checkpoint whose 'date' is a datetime object: a class no YOLOv9 checkpoint has, harmless."""
    ckpt = torch.load(genuine["train-fp32"], map_location="cpu", weights_only=False)
    path = tmp_path_factory.mktemp("harmless") / "dated.pt"
    torch.save({**ckpt, "date": datetime.datetime(2026, 11, 30, 12, 0)}, path)
    return path


def test_trust_weights_loads_an_unknown_harmless_class(yolov9_tree, harmless, tmp_path, capsys):
    message = cli_error(yolov9_tree, "export_qat.py", "--weights", str(harmless), "--imgsz", "64")
    assert message == (f"{harmless} was not loaded: it names datetime.datetime, which YOLOv9 checkpoints do not "
                       f"contain (unpickling it could run code); if you trust the file, pass --trust-weights to load "
                       f"it with the full pickle.")
    weights = tmp_path / harmless.name
    weights.symlink_to(harmless)
    capsys.readouterr()
    run_main(yolov9_tree, "export_qat.py", "--weights", str(weights), "--imgsz", "64", "--trust-weights")
    out = capsys.readouterr().out
    assert out.count("notice: --trust-weights: loading") == 1, out
    assert (tmp_path / "dated.onnx").is_file()


def test_only_the_trees_model_classes_are_allowed_and_a_forks_blocks_join(yolov9_tree, markers, tmp_path):
    """The allow-list comes from the modules: a block a fork adds in models/ loads; a class elsewhere does not; a
    callable that runs code stays refused even when offered to the allow-list (the denylist, second guard)."""
    from utils.qat.model import safe_load
    from utils.qat.core.errors import QATError
    fork = types.ModuleType("models.fork_blocks")
    fork.Block = type("Block", (torch.nn.Conv2d,), {"__module__": "models.fork_blocks"})
    fork.Helper = type("Helper", (), {"__module__": "models.fork_blocks"})  # not a layer: not allowed
    sys.modules["models.fork_blocks"] = fork
    try:
        torch.save({"model": torch.nn.Sequential(fork.Block(3, 4, 1))}, tmp_path / "fork.pt")
        assert type(safe_load.load(tmp_path / "fork.pt")["model"][0]) is fork.Block
        torch.save({"model": fork.Helper()}, tmp_path / "helper.pt")
        with pytest.raises(QATError, match="it names models.fork_blocks.Helper, which YOLOv9 checkpoints do not "
                                           "contain"):
            safe_load.load(tmp_path / "helper.pt")
    finally:
        del sys.modules["models.fork_blocks"]
    with pytest.raises(QATError, match="it names models.fork_blocks.Block, which this YOLOv9 tree does not define; "
                                       "run the command in the YOLOv9 tree"):
        safe_load.load(tmp_path / "fork.pt")
    torch.save({"model": PopenPayload(markers / "offered")}, tmp_path / "popen.pt")
    assert safe_load.first_foreign(tmp_path / "popen.pt", [*safe_load.allowed(), subprocess.Popen]) == "subprocess.Popen"
    assert safe_load.denied("posix.system") and safe_load.denied("builtins.exec") and not safe_load.denied("builtins.set")
    no_payload_ran(markers)


def test_getattr_is_a_method_lookup_only_and_other_pickles_are_refused(yolov9_tree, markers, tmp_path):
    """builtins.getattr on anything but a public method of an allowed class, and a pickle with opcodes torch.save
    never writes (protocol 4's STACK_GLOBAL), are refused before any call."""
    import models.common
    from utils.qat.model import safe_load
    from utils.qat.core.errors import QATError

    class Reach:
        def __reduce__(self):
            return getattr, (models.common.Conv, "__init__")

    torch.save({"model": Reach()}, tmp_path / "reach.pt")
    with pytest.raises(QATError, match=r"it names builtins.getattr, which runs code"):
        safe_load.load(tmp_path / "reach.pt")
    torch.save({"model": SystemPayload(markers / "proto4")}, tmp_path / "proto4.pt", pickle_protocol=4)
    with pytest.raises(QATError, match=r"proto4.pt was not loaded: its pickle uses instructions torch.save never "
                                       r"writes \(.*\); if you trust the file, pass --trust-weights"):
        safe_load.load(tmp_path / "proto4.pt")
    no_payload_ran(markers)


# one real process per command family: exit 2, one `error:` line, no payload run, nothing written
FAMILIES = {"qat.py": ("os.system in alone", ["qat.py", "eval", "--device", "cpu"]),
            "export_qat.py": ("os.system in opt", ["export_qat.py", "--imgsz", "64"]),
            "export_yoloV9.py": ("builtins.eval in opt", ["export_yoloV9.py", "--size", "64"]),
            "reparameterization.py": ("subprocess.Popen in opt", ["reparameterization.py", "--model", "c"]),
            "benchmarks": ("builtins.eval in modelopt state", [str(REPO / "benchmarks" / "autocast.py")])}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_a_refusal_as_users_meet_it(yolov9_tree, payloads, markers, small_data, tmp_path, family):
    label, argv = FAMILIES[family]
    path, name = payloads[label]
    weights = tmp_path / path.name  # beside it is where the exporters would write
    weights.symlink_to(path)
    extra = ["--data", str(small_data), "--project", str(tmp_path / "runs")] if family == "qat.py" else []
    extra += ["--data", str(small_data), "--out", str(tmp_path / "bench")] if family == "benchmarks" else []
    extra += ["--save", str(tmp_path / "converted.pt")] if family == "reparameterization.py" else []
    r = run_tool(yolov9_tree, *argv[:2 if family == "qat.py" else 1], "--weights", str(weights),
                 *argv[2 if family == "qat.py" else 1:], *extra, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"error: {weights} was not loaded: it names {name}, which runs code; if you trust the file, "
                     f"pass --trust-weights to load it with the full pickle."], r.stderr
    no_payload_ran(markers)
    assert files_in(tmp_path) == [weights.name]
