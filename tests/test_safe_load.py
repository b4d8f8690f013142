"""A checkpoint never runs code while it is loaded (utils/qat/model/safe_load.py).

Payloads written the way an attacker writes them (``__reduce__`` calling os.system, builtins.eval, subprocess.Popen,
each touching a marker file), on their own, hidden in ``opt`` of an otherwise genuine training checkpoint, and in a
nested dict of a real quantized checkpoint's modelopt state: every command that reads a .pt refuses each with one
sentence naming the global, and no marker appears. Files that name only allowed globals but *call* them (a model
class with a crafted cfg dict, a cfg path, a module name or an argument that parse_model evaluates;
DetectMultiBackend on a second file; the same call as the ``ema`` of a genuine checkpoint), a quantized
checkpoint whose yaml holds code, hooks and methods set where torch or the model would call them, and mutants of
real checkpoints' instruction streams (one use changed at a time) are refused alike. The table of uses is
regenerated from every genuine kind. Every genuine kind loads without a flag in a fresh process;
``--trust-weights`` loads a file with an unknown but harmless class. Models are TINY_GELAN variants (the reference
weights are only read), so building every kind costs a few seconds.
"""
from __future__ import annotations

import argparse
import builtins
import copy
import datetime
import importlib.util
import json
import os
import pickletools
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


def with_pickle(src: Path, dest: Path, data: bytes) -> Path:
    """``src``'s zip with ``data`` as its pickle (the records written by torch's own zip writer, as torch.save does)."""
    reader, writer = torch._C.PyTorchFileReader(str(src)), torch._C.PyTorchFileWriter(str(dest))
    for record in reader.get_all_records():
        body = data if record == "data.pkl" else reader.get_record(record)
        writer.write_record(record, body, len(body))
    writer.write_end_of_file()
    return dest


@pytest.fixture(scope="module")
def markers(tmp_path_factory) -> Path:
    global MARKERS
    MARKERS = tmp_path_factory.mktemp("markers")
    return MARKERS


def no_payload_ran(markers: Path) -> None:
    assert not list(markers.iterdir()), f"a payload ran: {sorted(p.name for p in markers.iterdir())}"


@pytest.fixture(scope="module")
def genuine(yolov9_tree, tmp_path_factory, gelan_c) -> dict[str, Path]:
    """Every genuine kind, by name: train.py checkpoints (FP16, FP32, stripped, and as Python 3.13 pickles its
    paths), a dual-head and a segmentation training checkpoint, a converted GELAN (reparameterization's writer), a
    quantized one, the reference weights."""
    from utils.qat.core import yolov9
    from utils.qat.model import checkpoint, safe_load
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
    paths["train-python3.13"] = with_pickle(paths["train-fp32"], d / "train-python3.13.pt", safe_load.pickle_of(
        paths["train-fp32"]).replace(b"cpathlib\nPosixPath\n", b"cpathlib._local\nPosixPath\n"))  # its opt's paths
    paths["converted"] = save_checkpoint(det, d / "converted.pt")
    x = torch.rand(4, 3, 64, 64)
    qmodel, info = quantize(det, [x[:2], x[2:]], QuantConfig(method="max", head_amax="calibrated"), example=x[:1])
    qmodel.names = det.names
    paths["quantized"] = checkpoint.save_quantized(d / "quantized.pt", qmodel, info, arguments={"weights": "w.pt"})
    paths["reference"] = gelan_c
    if tree_has(yolov9_tree, "ELAN1"):  # GELAN-S and YOLOv9-t are built of ELAN1 blocks, which the stand-in lacks
        paths["reference-s"] = gelan_c.with_name("gelan-s-coco334.pt")
        paths["reference-t"] = gelan_c.with_name("yolov9-t-coco.pt")
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
    assert got["train-fp16"]["opt"]["data"] == got["train-python3.13"]["opt"]["data"] == "PosixPath"
    assert got["train-fp32"]["optimizer"] == ["param_groups", "state"]
    assert got["train-dual"]["head"] == "DualDDetect" and got["reference"]["head"] == "DDetect"
    assert got.get("reference-t", {"head": "Detect"})["head"] == "Detect"
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
    "benchmarks/cost.py --mode fp16": ("cost", "--mode fp16 --weights W --data D --out bench"),
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
    ddp = {"benchmarks/cost.py --mode ddp": ("cost", "--mode ddp --weights W --data D --out o")}
    for command, (tool, line) in {**COMMANDS, **ddp}.items():
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
    """The allow-list comes from the modules: a block a fork adds in models/ loads; a class elsewhere does not, nor
    a fork's block with its own ``__setstate__`` (which unpickling would run); a callable that runs code stays
    refused even when offered to the table of globals (it has no uses there)."""
    from utils.qat.model import safe_load
    from utils.qat.core.errors import QATError
    fork = types.ModuleType("models.fork_blocks")
    fork.Block = type("Block", (torch.nn.Conv2d,), {"__module__": "models.fork_blocks"})
    fork.Helper = type("Helper", (), {"__module__": "models.fork_blocks"})  # not a layer: not allowed
    fork.Stateful = type("Stateful", (torch.nn.Conv2d,), {"__module__": "models.fork_blocks",
                                                          "__setstate__": lambda self, state: None})
    sys.modules["models.fork_blocks"] = fork
    try:
        torch.save({"model": torch.nn.Sequential(fork.Block(3, 4, 1))}, tmp_path / "fork.pt")
        assert type(safe_load.load(tmp_path / "fork.pt")["model"][0]) is fork.Block
        for name, obj in {"Helper": fork.Helper(), "Stateful": fork.Stateful(3, 4, 1)}.items():
            torch.save({"model": obj}, tmp_path / f"{name}.pt")
            with pytest.raises(QATError, match=f"it names models.fork_blocks.{name}, which YOLOv9 checkpoints do not "
                                               f"contain"):
                safe_load.load(tmp_path / f"{name}.pt")
    finally:
        del sys.modules["models.fork_blocks"]
    with pytest.raises(QATError, match="it names models.fork_blocks.Block, which this YOLOv9 tree does not define; "
                                       "run the command in the YOLOv9 tree"):
        safe_load.load(tmp_path / "fork.pt")
    torch.save({"model": PopenPayload(markers / "offered")}, tmp_path / "popen.pt")
    names = safe_load.Globals()
    names.table["subprocess.Popen"] = ("subprocess.Popen", subprocess.Popen)
    with pytest.raises(safe_load.Refused, match="names subprocess.Popen"):
        safe_load.scan(tmp_path / "popen.pt", names=names)
    assert safe_load.denied("posix.system") and safe_load.denied("builtins.exec") and not safe_load.denied("builtins.set")
    no_payload_ran(markers)


def test_getattr_is_a_method_lookup_only_and_other_pickles_are_refused(yolov9_tree, markers, tmp_path):
    """builtins.getattr of anything but ``forward`` of a model class, and a pickle with opcodes torch.save never
    writes (protocol 4's FRAME and STACK_GLOBAL), or from torch before 1.6, are refused before any call."""
    import models.common
    from utils.qat.model import safe_load
    from utils.qat.core.errors import QATError

    class Reach:
        def __reduce__(self):
            return getattr, (models.common.Conv, "__init__")

    torch.save({"model": Reach()}, tmp_path / "reach.pt")
    with pytest.raises(QATError, match=r"it calls builtins.getattr\(models.common.Conv, '__init__'\), which YOLOv9 "
                                       r"checkpoints never do"):
        safe_load.load(tmp_path / "reach.pt")
    torch.save({"model": SystemPayload(markers / "proto4")}, tmp_path / "proto4.pt", pickle_protocol=4)
    with pytest.raises(QATError, match=r"proto4.pt was not loaded: its pickle is not one torch.save writes "
                                       r"\(opcode b'\\x95' at byte 2\); if you trust the file, pass --trust-weights"):
        safe_load.load(tmp_path / "proto4.pt")
    torch.save({"model": torch.nn.Conv2d(3, 4, 1)}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    with pytest.raises(QATError, match=r"old.pt was not loaded: it is in torch's format from before 1.6, whose models "
                                       r"only the full pickle reads; if you trust the file, pass --trust-weights"):
        safe_load.load(tmp_path / "old.pt")
    no_payload_ran(markers)


# one real process per command family: exit 2, one `error:` line, no payload run, nothing written
FAMILIES = {"qat.py": ("os.system in alone", ["qat.py", "eval", "--device", "cpu"]),
            "export_qat.py": ("os.system in opt", ["export_qat.py", "--imgsz", "64"]),
            "export_yoloV9.py": ("builtins.eval in opt", ["export_yoloV9.py", "--size", "64"]),
            "reparameterization.py": ("subprocess.Popen in opt", ["reparameterization.py", "--model", "c"]),
            "benchmarks": ("builtins.eval in modelopt state", [str(REPO / "benchmarks" / "cost.py"), "--mode", "fp16"])}


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


# ---- calls of allowed globals, hooks, methods, a quantized checkpoint's yaml, mutants -------------------------------

class Call:
    """Unpickled as ``fn(*args)``: what a hostile file does with a global that genuine checkpoints only rebuild."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _touch(marker: Path) -> str:
    return f"__import__('os').system('touch {marker}')"


@pytest.fixture(scope="module")
def hostile_calls(genuine, markers, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The shapes of a call hidden in a .pt that names only allowed globals: ``shape`` -> (file, what it calls, as
    the sentence shows it). Each would touch its marker if called: a cfg dict whose activation, module name or
    argument parse_model evaluates, a cfg path (the same yaml on disk), DetectMultiBackend on a second file
    (upstream's attempt_load opens it with the full pickle where TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1, which the
    test sets), and the first shape as the ``ema`` of a genuine training checkpoint."""
    import yaml

    from models.common import DetectMultiBackend
    from models.yolo import DetectionModel
    d = tmp_path_factory.mktemp("calls")

    def cfg(marker: str, where: str) -> dict:
        c = copy.deepcopy(TINY_GELAN)
        if where == "activation":
            c["activation"] = f"{_touch(markers / marker)} or nn.SiLU()"
        elif where == "module":
            c["backbone"][0][2] = f"{_touch(markers / marker)} or Conv"
        else:
            c["backbone"][0][3][0] = f"{_touch(markers / marker)} or 16"
        return c

    (d / "evil.yaml").write_text(yaml.safe_dump(cfg("shape-cfg-path", "activation")))
    torch.save({"model": SystemPayload(markers / "shape-second-file")}, d / "second.pt")
    train = torch.load(genuine["train-fp32"], map_location="cpu", weights_only=False)
    made = {"cfg dict": ({"model": Call(DetectionModel, cfg("shape-cfg-dict", "activation"))}, "(dict)"),
            "cfg path": ({"model": Call(DetectionModel, str(d / "evil.yaml"))}, f"({str(d / 'evil.yaml')!r})"),
            "module name": ({"model": Call(DetectionModel, cfg("shape-module-name", "module"))}, "(dict)"),
            "argument": ({"model": Call(DetectionModel, cfg("shape-argument", "argument"))}, "(dict)"),
            "DetectMultiBackend": ({"model": Call(DetectMultiBackend, str(d / "second.pt"))},
                                   f"({str(d / 'second.pt')!r})"),
            "in ema": ({**train, "ema": Call(DetectionModel, cfg("shape-ema", "activation"))}, "(dict)")}
    out = {}
    for shape, (ckpt, args) in made.items():
        path = d / f"{shape.replace(' ', '-')}.pt"
        torch.save(ckpt, path)
        cls = "models.common.DetectMultiBackend" if shape == "DetectMultiBackend" else "models.yolo.DetectionModel"
        out[shape] = (path, f"{cls}{args}")
    return out


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_refuses_every_call(yolov9_tree, hostile_calls, markers, small_data, tmp_path, command, capsys,
                                          monkeypatch):
    """Each command x shape: one sentence naming the file, the class and what it is called with; nothing ran (not
    even with upstream's full-pickle switch on), nothing written."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    for shape, (path, call) in hostile_calls.items():
        message = command_error(yolov9_tree, command, path, small_data, tmp_path)
        assert message == (f"{path} was not loaded: it calls {call}, which YOLOv9 checkpoints never do; if you trust "
                           f"the file, pass --trust-weights to load it with the full pickle."), (shape, message)
        with capsys.disabled():
            print(f"\n[{command}] {shape}: error: {message}", end="")
    no_payload_ran(markers)
    assert files_in(tmp_path) == []


def test_the_uses_are_what_genuine_checkpoints_do(yolov9_tree, genuine, shared):
    """The table of uses, regenerated from every genuine kind, every shared reference checkpoint (those whose
    classes this tree lacks too: the table does not depend on the tree) and the embedded models, equals the one in
    the code."""
    from utils.qat.model import safe_load
    names = safe_load.Globals()
    learned: dict[str, set[str]] = {}
    for path in {*genuine.values(), *(shared / "weights").glob("*.pt"), *(REPO / "weights").glob("*.pt")}:
        for group, use in safe_load.scan(path, learn=True, names=names).uses:
            learned.setdefault(group, set()).add(use)
    assert learned == {group: set(uses) for group, uses in safe_load.USES.items()}


def test_hooks_and_methods_where_something_would_call_them_are_refused(yolov9_tree, tmp_path):
    """A module's hook dict that holds a hook (a module, a looked-up method) and a method set over one the class
    defines are refused; the same method as a plain attribute (upstream's Segment keeps ``detect``) loads."""
    import models.common
    import models.yolo
    from utils.qat.core.errors import QATError
    from utils.qat.model import safe_load

    def conv(**attributes):
        m = models.common.Conv(3, 4)
        m.__dict__.update(attributes)
        return m

    hooked = conv()
    hooked.register_forward_hook(torch.nn.Identity())
    pre = conv()
    pre.register_forward_pre_hook(models.yolo.Detect.forward)
    files = {"forward hook": ({"model": hooked}, "puts a hook in the '_forward_hooks' of a models.common.Conv object"),
             "forward pre-hook": ({"model": pre}, "puts a hook in the '_forward_pre_hooks' of a models.common.Conv "
                                                  "object"),
             "hooks as a list": ({"model": conv(_backward_hooks=[])}, "sets the '_backward_hooks' of a "
                                                                      "models.common.Conv object to a list"),
             "method": ({"model": conv(forward=models.yolo.Detect.forward)},
                        "sets 'forward' of a models.common.Conv object, which its class defines, to what "
                        "builtins.getattr returned (models.yolo.Detect.forward)"),
             "module": ({"model": conv(forward_fuse=torch.nn.Identity())},
                        "sets 'forward_fuse' of a models.common.Conv object, which its class defines, to a "
                        "torch.nn.modules.linear.Identity object"),
             "method in a dict": ({"model": conv(), "x": {"y": models.yolo.Detect.forward}},
                                  "stores what builtins.getattr returned (models.yolo.Detect.forward) elsewhere than "
                                  "in a module's attributes")}
    for name, (ckpt, action) in files.items():
        path = tmp_path / f"{name.replace(' ', '-')}.pt"
        torch.save(ckpt, path)
        with pytest.raises(QATError) as e:
            safe_load.load(path)
        assert str(e.value) == (f"{path} was not loaded: it {action}, which YOLOv9 checkpoints never do; if you "
                                f"trust the file, pass --trust-weights to load it with the full pickle."), name
    torch.save({"model": conv(detect=models.yolo.Detect.forward)}, tmp_path / "attribute.pt")
    assert safe_load.load(tmp_path / "attribute.pt")["model"].detect is models.yolo.Detect.forward


@pytest.fixture(scope="module")
def code_in_yaml(genuine, markers, tmp_path_factory) -> dict[str, Path]:
    """A genuine quantized checkpoint whose model yaml holds code where parse_model evaluates strings."""
    quantized = torch.load(genuine["quantized"], map_location="cpu", weights_only=False)
    d = tmp_path_factory.mktemp("yaml")
    out = {}
    for where in ("activation", "module", "argument"):
        q = copy.deepcopy(quantized)
        code = _touch(markers / f"yaml-{where}")
        if where == "activation":
            q["yaml"]["activation"] = f"{code} or nn.SiLU()"
        elif where == "module":
            q["yaml"]["backbone"][0][2] = f"{code} or Conv"
        else:
            q["yaml"]["backbone"][0][3][0] = f"{code} or 16"
        out[where] = d / f"yaml-{where}.pt"
        torch.save(q, out[where])
    return out


def test_code_in_a_quantized_checkpoints_yaml_never_runs(yolov9_tree, code_in_yaml, markers, small_data, tmp_path,
                                                          capsys):
    """The yaml a quantized checkpoint is rebuilt from is plain data to the pickle, but parse_model evaluates its
    strings: the commands that rebuild it refuse it with one sentence; the others refuse the file for what it is."""
    from utils.qat.core import yolov9
    assert yolov9.code_in_cfg(TINY_GELAN) is None and yolov9.code_in_cfg({**TINY_GELAN, "activation": "nn.ReLU()"}) \
        is None and yolov9.code_in_cfg({**TINY_GELAN, "activation": "nn.LeakyReLU(0.1)"}) is None
    for where, path in code_in_yaml.items():
        code = yolov9.code_in_cfg(torch.load(path, weights_only=False)["yaml"])
        assert code.startswith(f"{where} ") and "__import__('os').system('touch " in code, code
        for command in COMMANDS:
            message = command_error(yolov9_tree, command, path, small_data, tmp_path)
            if command in ("qat.py eval", "export_qat.py", "export_yoloV9.py", "benchmarks/cost.py --mode fp16"):
                assert message == (f"{path} was not loaded: its model yaml has {code}, which building the model "
                                   f"would run as Python code; if you trust the file, pass --trust-weights to build "
                                   f"it anyway."), (command, message)
            with capsys.disabled():
                print(f"\n[{command}] yaml {where}: error: {message}", end="")
    no_payload_ran(markers)
    assert files_in(tmp_path) == []


# Mutations of one instruction of a real checkpoint's pickle: (name, the instructions it applies to, the bytes that
# replace that instruction: a function of the instruction's own bytes, or None to keep them, and what goes after).
MUTATIONS = [
    ("NEWOBJ -> REDUCE (the class called)", ("NEWOBJ",), lambda b: b"R", b""),
    ("REDUCE -> NEWOBJ", ("REDUCE",), lambda b: b"\x81", b""),
    ("an extra REDUCE on the result", ("REDUCE", "NEWOBJ"), None, b")R"),
    ("a second BUILD", ("BUILD",), None, b"}b"),
    ("the class given an argument", ("NEWOBJ",), "argument", b""),
    ("BUILD on the class itself", ("NEWOBJ",), "no call", b""),
    ("the callee swapped for a model class", ("REDUCE",), "callee", b""),
    ("getattr of __init__", ("REDUCE",), "getattr", b""),
    ("an entry added to an OrderedDict", ("REDUCE",), "fill", b""),
]


def _sites(data: bytes) -> tuple[list, list]:
    """The instructions of a pickle and, for each REDUCE, NEWOBJ and BUILD, (index, name, label): the global a call
    calls or a BUILD's object was made by (a stack walk of its own, independent of safe_load's)."""
    ops = list(pickletools.genops(data))
    stack: list = []
    meta: list = []
    memo: dict = {}
    sites = []
    for i, (op, arg, _) in enumerate(ops):
        n = op.name
        if n == "GLOBAL":
            stack.append(("global", arg.replace(" ", ".").replace("__builtin__.", "builtins."), i))
        elif n == "MARK":
            meta.append(stack)
            stack = []
        elif n == "TUPLE":
            items, stack = stack, meta.pop()
            stack.append(("tuple", tuple(items), i))
        elif n in ("SETITEMS", "APPENDS"):
            stack = meta.pop()
        elif n in ("TUPLE1", "TUPLE2", "TUPLE3"):
            k = int(n[-1])
            items = tuple(stack[-k:])
            del stack[-k:]
            stack.append(("tuple", items, i))
        elif n in ("BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif n in ("BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif n in ("REDUCE", "NEWOBJ"):
            args, f = stack.pop(), stack.pop()
            sites.append((i, n, f[1] if f[0] == "global" else "?", f, args))
            stack.append(("made", f[1], i))
        elif n == "BUILD":
            stack.pop()
            sites.append((i, n, stack[-1][1], None, None))
        elif n == "SETITEM":
            del stack[-2:]
        elif n == "APPEND":
            stack.pop()
        elif n == "BINPERSID":
            stack[-1] = ("made", "storage", i)
        elif n not in ("PROTO", "STOP"):
            stack.append(("value", arg, i))
    return ops, sites


def _mutants(data: bytes, per_site: int = 1):
    """(description, mutated pickle) for each mutation at the first ``per_site`` instructions of each label."""
    ops, sites = _sites(data)
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    seen: dict = {}
    for i, n, label, callee, args in sites:
        for name, applies, replace, after in MUTATIONS:
            if n not in applies or seen.get((name, label), 0) >= per_site:
                continue
            start, end = ops[i][2], ends[i]
            if replace == "callee":  # the GLOBAL a REDUCE calls
                if callee is None or callee[0] != "global":
                    continue
                start, end, new = ops[callee[2]][2], ends[callee[2]], b"cmodels.yolo\nDetectionModel\n"
            elif replace == "getattr":
                if label != "builtins.getattr":
                    continue
                j = args[1][1][2]  # the BINUNICODE of the attribute's name
                start, end, new = ops[j][2], ends[j], b"X\x08\x00\x00\x00__init__"
            elif replace == "fill":
                if label != "collections.OrderedDict":
                    continue
                new, after = data[start:end], b"K\x00Ns"  # {0: None}
            elif replace in ("argument", "no call"):  # the EMPTY_TUPLE before the NEWOBJ, and the NEWOBJ
                if ops[i - 1][0].name != "EMPTY_TUPLE":
                    continue
                start, new = ops[i - 1][2], b"X\x09\x00\x00\x00yolo.yaml\x85\x81" if replace == "argument" else b""
            elif replace is None:
                new = data[start:end]
            else:
                new = replace(data[start:end])
            seen[name, label] = seen.get((name, label), 0) + 1
            yield f"{name} at {label}", data[:start] + new + after + data[end:]


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all()) and a.requires_grad == b.requires_grad
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.nn.Module) or hasattr(a, "__dict__") and not callable(a):
        return _same(vars(a), vars(b))
    return a == b


def test_mutants_of_real_checkpoints_are_refused_or_load_unchanged(yolov9_tree, genuine, tmp_path, capsys):
    """One use changed at a time in real instruction streams (the reference GELAN-C as upstream's train.py wrote it,
    a segmentation training checkpoint with getattr, numpy and paths, a quantized one), at the first instruction of
    each global: every mutant is refused by the scan, or loads to the identical object without any call into the
    tree's code."""
    from utils.qat.core.errors import QATError
    from utils.qat.model import safe_load
    names = safe_load.Globals()
    counts: dict[str, dict[str, int]] = {}
    for kind in ("reference", "train-segment", "quantized"):
        data = safe_load.pickle_of(genuine[kind])
        original = None
        for label, mutant in _mutants(data):
            mutation = label.split(" at ")[0]
            try:
                safe_load.scan_pickle(mutant, names)
                outcome = None
            except (safe_load.Refused, safe_load.Malformed) as e:
                outcome = "refused" if isinstance(e, safe_load.Refused) else "malformed"
            if outcome is None:
                path = with_pickle(genuine[kind], tmp_path / f"mutant{len(counts)}.pt", mutant)
                calls: list[str] = []
                sys.setprofile(lambda frame, event, _: event == "call" and str(yolov9_tree) in frame.f_code.co_filename
                               and calls.append(frame.f_code.co_name))
                try:
                    loaded = safe_load.load(path)
                except QATError:
                    loaded = None
                finally:
                    sys.setprofile(None)
                original = original or safe_load.load(genuine[kind])
                assert loaded is None or _same(loaded, original) and not calls, (kind, label, calls)
                outcome = "loaded unchanged" if loaded is not None else "refused by torch"
            counts.setdefault(mutation, {}).setdefault(outcome, 0)
            counts[mutation][outcome] += 1
    with capsys.disabled():
        print(f"\nmutants: {sum(sum(c.values()) for c in counts.values())}", end="")
        for mutation, outcomes in counts.items():
            print(f"\n  {mutation}: {outcomes}", end="")
    assert set(counts) == {name for name, *_ in MUTATIONS}  # every mutation found its sites


@pytest.mark.slow
@pytest.mark.e2e
def test_a_refused_call_as_users_meet_it(yolov9_tree, hostile_calls, markers, small_data, tmp_path):
    """DetectMultiBackend on a second file, with upstream's full-pickle switch on, through ``qat.py eval`` in its own
    process: exit 2, one ``error:`` line, nothing ran, nothing written."""
    path, call = hostile_calls["DetectMultiBackend"]
    weights = tmp_path / path.name
    weights.symlink_to(path)
    r = run_tool(yolov9_tree, "qat.py", "eval", "--weights", str(weights), "--data", str(small_data), "--device",
                 "cpu", "--project", str(tmp_path / "runs"), env={"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == [
        f"error: {weights} was not loaded: it calls {call}, which YOLOv9 checkpoints never do; if you trust the file, "
        f"pass --trust-weights to load it with the full pickle."], r.stderr
    no_payload_ran(markers)
    assert files_in(tmp_path) == [weights.name]
