"""utils/qat/compat.py: each shim makes the upstream call that fails on today's stack work.

Each test shows the upstream symptom first where this stack has it (in a clean subprocess, without
the shims), then the same upstream call working with the shims applied. Missing packages
(pkg_resources, IPython) are simulated in a subprocess by an import hook that hides them.
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

# Prepended to subprocess scripts: make the packages named in HIDDEN impossible to import.
HIDE_PACKAGES = """
import sys

class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _Hide())
for _name in [m for m in sys.modules if m.split(".")[0] in HIDDEN]:
    del sys.modules[_name]
"""

# Prepended to subprocess scripts: any network access fails, and upstream's downloader is recorded.
NO_NETWORK = """
import socket
import torch

def _no_network(*args, **kwargs):
    raise OSError("network access attempted (blocked by the test)")

socket.create_connection = _no_network
socket.socket.connect = _no_network
DOWNLOADS = []

def _download(url, dst, *args, **kwargs):
    DOWNLOADS.append(url)
    raise OSError(f"download of {url} attempted (blocked by the test)")

torch.hub.download_url_to_file = _download
"""


def run_python(tree: Path, code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` with ``python3 -c`` inside the patched tree (a fresh interpreter: no shims applied)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tree, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# np.trapz (numpy >= 2.4): utils/metrics.py compute_ap

def test_compute_ap_without_np_trapz(yolov9_tree):
    proc = run_python(yolov9_tree, "import numpy; numpy.trapz")
    if proc.returncode == 0:
        pytest.skip(f"numpy {np.__version__} still has np.trapz: the shim is a no-op on this stack")
    assert "has no attribute 'trapz'" in proc.stderr  # what upstream's compute_ap calls

    from utils.metrics import ap_per_class, compute_ap  # shims applied by the yolov9_tree fixture
    recall = np.linspace(0.2, 1.0, 5)
    ap, _, _ = compute_ap(recall, np.ones(5))
    assert 0.99 < ap <= 1.0
    ap, _, _ = compute_ap(recall, np.full(5, 0.5))
    # precision 1 at recall 0 (upstream's sentinel), interpolated down to 0.5 at recall 0.2, then 0.5
    assert ap == pytest.approx(0.2 * 0.75 + 0.8 * 0.5, abs=0.005)
    # The full metric as val.py calls it.
    tp = np.array([[True], [True], [False], [True]])
    tp_ap = ap_per_class(tp, np.array([0.9, 0.8, 0.7, 0.6]), np.array([0, 0, 0, 1]), np.array([0, 0, 1]),
                         names={0: "a", 1: "b"})
    assert tp_ap[5].shape == (2, 1) and np.all((tp_ap[5] >= 0) & (tp_ap[5] <= 1))


# ---------------------------------------------------------------------------------------------
# FreeTypeFont.getsize (Pillow >= 10): utils/plots.py Annotator.box_label / text

def test_annotator_box_label_with_pil(yolov9_tree):
    from utils.qat import compat
    proc = run_python(yolov9_tree, f"""
        from PIL import ImageFont
        ImageFont.truetype({str(compat.local_font())!r}, 12).getsize("person")
    """)
    if proc.returncode == 0:
        pytest.skip("this Pillow still has FreeTypeFont.getsize: the shim is a no-op on this stack")
    assert "has no attribute 'getsize'" in proc.stderr  # what upstream's box_label calls

    from utils.plots import Annotator
    image = np.zeros((96, 128, 3), np.uint8)
    annotator = Annotator(image, pil=True, example="person")
    annotator.box_label([10, 40, 90, 80], "person 0.91", color=(255, 0, 0))
    annotator.text([2, 2], "label")
    result = annotator.result()
    assert result.shape == image.shape and result.any()
    assert (result[35:40, 10:60] != 0).any()  # the label's background sits above the box


# ---------------------------------------------------------------------------------------------
# torch.load weights_only=True (torch >= 2.6): models/experimental.py attempt_load,
# utils/general.py strip_optimizer

@pytest.fixture(scope="module")
def foreign_checkpoint(fresh_interpreter) -> Path:
    """An upstream-format checkpoint (a pickled nn.Module) that another process wrote: not trusted here."""
    return fresh_interpreter[1]


def test_attempt_load_of_a_named_checkpoint(yolov9_tree, gelan_c):
    import torch

    from models.experimental import attempt_load
    from utils.qat import compat
    compat.trust_checkpoint(gelan_c)
    model = attempt_load(str(gelan_c), device="cpu")
    assert len(model.names) == 80 and int(model.stride.max()) == 32
    with torch.no_grad():
        out = model(torch.zeros(1, 3, 64, 64))
    pred = out[0] if isinstance(out, (list, tuple)) else out
    pred = pred[0] if isinstance(pred, (list, tuple)) else pred
    assert pred.shape[:2] == (1, 84)


def test_untrusted_checkpoint_still_loads_weights_only(yolov9_tree, foreign_checkpoint, tmp_path):
    import torch

    from models.experimental import attempt_load
    from utils.qat import compat
    path = tmp_path / "copy.pt"  # trusted below; the module's foreign_checkpoint stays untrusted
    path.write_bytes(foreign_checkpoint.read_bytes())
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(path)
    with pytest.raises(pickle.UnpicklingError):
        attempt_load(str(path), device="cpu")
    compat.trust_checkpoint(path)
    assert isinstance(torch.load(path)["model"], torch.nn.Sequential)
    with pytest.raises(pickle.UnpicklingError):  # an explicit weights_only=True is honoured
        torch.load(path, weights_only=True)


def test_strip_optimizer_on_checkpoints_this_process_saved(yolov9_tree, foreign_checkpoint, tmp_path):
    # train.py saves last.pt / best.pt itself, then strip_optimizer() and attempt_load() read them back.
    import torch

    from utils.general import strip_optimizer
    ckpt = {"model": torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)).half(), "optimizer": {"state": 1},
            "best_fitness": 0.5, "ema": None, "updates": 3, "epoch": 7}
    last = tmp_path / "weights" / "last.pt"
    last.parent.mkdir()
    torch.save(ckpt, last)
    stripped = tmp_path / "weights" / "last_striped.pt"
    strip_optimizer(last, stripped)
    again = torch.load(stripped)
    assert again["optimizer"] is None and again["epoch"] == -1
    assert isinstance(again["model"], torch.nn.Sequential)

    with pytest.raises(pickle.UnpicklingError):  # a file someone else wrote is still not trusted
        strip_optimizer(foreign_checkpoint)


# ---------------------------------------------------------------------------------------------
# In a fresh interpreter (one, to keep the suite quick), with pkg_resources and IPython hidden and
# the network blocked: each upstream symptom alone, then the same calls with the shims.
# - pkg_resources missing (setuptools >= 81): utils/general.py imports it at module level
# - IPython missing: utils/general.py imports it at module level (to detect notebooks)
# - check_font downloads Arial.ttf at run time (fails offline): utils/general.py, utils/plots.py

@pytest.fixture(scope="module")
def fresh_interpreter(yolov9_tree, tmp_path_factory) -> tuple[str, Path]:
    """(what the script printed, a checkpoint it wrote)."""
    root = tmp_path_factory.mktemp("fresh")
    config, foreign = root / "config", root / "foreign.pt"
    script = "HIDDEN = {'pkg_resources', 'IPython'}\n" + HIDE_PACKAGES + NO_NETWORK + """
import sys
from pathlib import Path

from utils.qat import compat

torch.save({"model": torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1)), "epoch": 1}, __FOREIGN__)

def import_general():
    try:
        import utils.general
    except ModuleNotFoundError as e:
        return str(e)
    raise SystemExit("utils.general imported although a package it needs is hidden")

compat._shim_ipython()  # IPython stubbed: only pkg_resources is missing
print("WITHOUT PKG_RESOURCES:", import_general())
del sys.modules["IPython"]
compat._shim_pkg_resources()  # pkg_resources stubbed: only IPython is missing
print("WITHOUT IPYTHON:", import_general())
compat._shim_ipython()  # both stubbed: upstream's check_font as it is
from utils import general
assert general.CONFIG_DIR == Path(__CONFIG__), general.CONFIG_DIR
try:
    general.check_font("Arial.ttf")
except OSError:
    pass
print("UPSTREAM DOWNLOADS:", DOWNLOADS)
DOWNLOADS.clear()

compat.apply()  # every shim
import IPython, pkg_resources
assert getattr(pkg_resources, "__file__", None) is None and getattr(IPython, "__file__", None) is None

assert general.is_notebook() is False
print("IPYTHON OK")

assert general.check_version("2.4.1", "1.7.0") is True
assert general.check_version("1.7.0", "2.4.1") is False
assert general.check_version("1.7.0", "1.7.0", pinned=True) is True
try:
    general.check_version("1.7.0", "2.4.1", hard=True)
except AssertionError:
    pass
else:
    raise SystemExit("check_version(hard=True) did not fail")
pkg_resources.require("numpy>=1.0")
for bad, error in (("yolov9-qat-no-such-package", pkg_resources.DistributionNotFound),
                   ("numpy<1.0", pkg_resources.VersionConflict)):
    try:
        pkg_resources.require(bad)
    except error:
        pass
    else:
        raise SystemExit(f"require({bad!r}) did not raise {error.__name__}")
print("PKG_RESOURCES OK")

from PIL import ImageFont
import numpy as np
from utils import plots
for name in ("Arial.ttf", "Arial.Unicode.ttf"):
    assert (Path(__CONFIG__) / name).read_bytes() == compat.local_font().read_bytes(), name
    general.check_font(name)
font = plots.check_pil_font("Arial.ttf", size=14)
assert isinstance(font, ImageFont.FreeTypeFont) and font.path == str(Path(__CONFIG__) / "Arial.ttf"), font
annotator = plots.Annotator(np.zeros((64, 64, 3), np.uint8), pil=True, example="猫")  # non-latin: Arial.Unicode
annotator.box_label([5, 20, 40, 50], "猫 0.9")
assert DOWNLOADS == [], DOWNLOADS
print("FONT OK")
""".replace("__CONFIG__", repr(str(config))).replace("__FOREIGN__", repr(str(foreign)))
    return ok(run_python(yolov9_tree, script, env={"YOLOV5_CONFIG_DIR": str(config)})), foreign


def test_utils_general_without_pkg_resources(fresh_interpreter):
    out = fresh_interpreter[0]
    assert "WITHOUT PKG_RESOURCES: No module named 'pkg_resources'" in out  # the upstream symptom
    assert "PKG_RESOURCES OK" in out  # imported, and check_version / require work


def test_utils_general_without_ipython(fresh_interpreter):
    out = fresh_interpreter[0]
    assert "WITHOUT IPYTHON: No module named 'IPython'" in out  # the upstream symptom
    assert "IPYTHON OK" in out  # imported, and is_notebook works


def test_check_font_never_downloads(fresh_interpreter):
    out = fresh_interpreter[0]
    assert "UPSTREAM DOWNLOADS: ['https://ultralytics.com/assets/Arial.ttf']" in out  # the upstream symptom
    assert "FONT OK" in out  # a local font where upstream looks, PIL labels drawn with it, no download


# ---------------------------------------------------------------------------------------------
# Known third-party noise (utils/qat/noise.py) is silenced by its exact text; real warnings still show.

def test_known_noise_silenced_real_warnings_kept(yolov9_tree):
    proc = run_python(yolov9_tree, """
        import logging, warnings
        from utils.qat import compat
        compat.apply()
        import modelopt.torch.quantization  # imports torch.utils.cpp_extension and torch.jit.script's user
        warnings.warn("`torch.jit.script` is deprecated. Please switch to `torch.compile`", FutureWarning)
        logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/x")
        warnings.warn("a real FutureWarning", FutureWarning)
        warnings.warn("a real UserWarning")
        logging.getLogger("torch.utils.cpp_extension").warning("a real cpp_extension warning")
        print("DONE")
    """)
    assert ok(proc).strip().endswith("DONE")
    assert "torch.jit.script" not in proc.stderr and "No CUDA runtime" not in proc.stderr, proc.stderr
    for real in ("a real FutureWarning", "a real UserWarning", "a real cpp_extension warning"):
        assert real in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# All together: upstream val.py on real photos, the way a user evaluates (compute_ap, the plots in
# threads with box labels, attempt_load of the named checkpoint, fonts), offline.

def test_upstream_val_runs_with_the_shims(yolov9_tree, small_data, gelan_c, tmp_path):
    config = tmp_path / "config"
    project = tmp_path / "runs"
    proc = run_python(yolov9_tree, NO_NETWORK + f"""
import runpy, sys
from utils.qat import compat
compat.apply()
compat.trust_checkpoint({str(gelan_c)!r})
sys.argv = ["val.py", "--data", {str(small_data)!r}, "--weights", {str(gelan_c)!r}, "--img", "160",
            "--batch", "8", "--device", "cpu", "--workers", "0", "--project", {str(project)!r}, "--name", "val"]
runpy.run_path("val.py", run_name="__main__")
assert DOWNLOADS == [], DOWNLOADS
""", env={"YOLOV5_CONFIG_DIR": str(config)})
    ok(proc)
    log = proc.stdout + proc.stderr
    assert "Exception in thread" not in log and "Traceback" not in log, log[-3000:]
    (summary,) = [line.split() for line in log.splitlines() if line.split()[:1] == ["all"]]
    assert summary[1:3] == ["8", str(sum(1 for p in (small_data.parent / "coco334/labels/val2017").iterdir()
                                         for _ in p.read_text().splitlines()))]
    assert 0.0 < float(summary[5]) <= 1.0  # mAP50 through compute_ap
    for name in ("val_batch0_labels.jpg", "val_batch0_pred.jpg", "PR_curve.png", "confusion_matrix.png"):
        assert (project / "val" / name).stat().st_size > 0, name
