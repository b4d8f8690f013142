"""utils/qat/core/compat.py: each shim makes an upstream call that a toolkit command reaches work on today's stack.

Each test shows the upstream symptom first where this stack has it (in a clean subprocess, without
the shims), then the same upstream call working with the shims applied. Missing packages
(pkg_resources, IPython) are simulated in a subprocess by an import hook that hides them. What no toolkit
command reaches (torch.load's weights_only default, Pillow's getsize, the font download) stays unpatched.
The tests that show a symptom of the tree are marked ``compat``: skipped on a tree modernised where upstream breaks
(the yolo9 stand-in; ``conftest.modernised``).
"""
from __future__ import annotations

import os
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

def run_python(tree: Path, code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run ``code`` with ``python3 -c`` inside the patched tree (a fresh interpreter: no shims applied)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tree, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})})


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# np.trapz (numpy >= 2.4): utils/metrics.py compute_ap

@pytest.mark.compat
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
# In a fresh interpreter (one, to keep the suite quick), with pkg_resources and IPython hidden:
# each upstream symptom alone, then the same calls with the shims.
# - pkg_resources missing (setuptools >= 81): utils/general.py imports it at module level, and
#   utils/torch_utils.py calls check_version (pkg.parse_version) at import
# - IPython missing (README's quickstart install leaves out upstream's requirements.txt): utils/general.py and
#   models/common.py import it at module level (to detect notebooks)
# and what compat.apply() leaves alone: torch.load / torch.save, Pillow, upstream's check_font, the config dir.

@pytest.fixture(scope="module")
def fresh_interpreter(yolov9_tree, tmp_path_factory) -> str:
    """What the script printed."""
    config = tmp_path_factory.mktemp("fresh") / "config"
    script = "HIDDEN = {'pkg_resources', 'IPython'}\n" + HIDE_PACKAGES + """
import sys
from pathlib import Path

import torch
from PIL import ImageFont

from utils.qat.core import compat

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
compat._shim_ipython()  # both stubbed
from utils import general
assert general.CONFIG_DIR == Path(__CONFIG__), general.CONFIG_DIR
before = (torch.load, torch.save, general.check_font, vars(ImageFont.FreeTypeFont).copy())

compat.apply()  # every shim
import IPython, pkg_resources
assert getattr(pkg_resources, "__file__", None) is None and getattr(IPython, "__file__", None) is None

assert general.is_notebook() is False
import models.common, utils.torch_utils  # noqa: E401 (both import IPython / call check_version at import)
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

after = (torch.load, torch.save, general.check_font, vars(ImageFont.FreeTypeFont).copy())
assert after == before, "compat.apply() patched something no toolkit command needs"
assert not Path(__CONFIG__).exists() or not any(Path(__CONFIG__).iterdir()), list(Path(__CONFIG__).iterdir())
print("UNTOUCHED OK")
""".replace("__CONFIG__", repr(str(config)))
    return ok(run_python(yolov9_tree, script, env={"YOLOV5_CONFIG_DIR": str(config)}))


@pytest.mark.compat
def test_utils_general_without_pkg_resources(fresh_interpreter):
    out = fresh_interpreter
    assert "WITHOUT PKG_RESOURCES: No module named 'pkg_resources'" in out  # the upstream symptom
    assert "PKG_RESOURCES OK" in out  # imported, and check_version / require work


@pytest.mark.compat
def test_utils_general_without_ipython(fresh_interpreter):
    out = fresh_interpreter
    assert "WITHOUT IPYTHON: No module named 'IPython'" in out  # the upstream symptom
    assert "IPYTHON OK" in out  # imported, and is_notebook works


@pytest.mark.compat
def test_apply_patches_nothing_else(fresh_interpreter):
    """torch.load / torch.save (weights_only default), Pillow's FreeTypeFont, upstream's check_font: as they were, and
    nothing written to upstream's config dir (no toolkit command reaches them; compat's docstring says how we know)."""
    assert "UNTOUCHED OK" in fresh_interpreter


# ---------------------------------------------------------------------------------------------
# Thread settings: upstream's utils/general.py writes OMP_NUM_THREADS into os.environ, which the processes a toolkit
# command starts inherit.

THREADS_SCRIPT = """
import os, subprocess, sys
__APPLY__
import utils.general
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('OMP_NUM_THREADS'))"],
                       capture_output=True, text=True).stdout.strip()
print(f"{os.environ.get('OMP_NUM_THREADS')} {os.environ.get('NUMEXPR_MAX_THREADS')} {child} "
      f"{utils.general.NUM_THREADS}")
"""


@pytest.mark.compat
@pytest.mark.parametrize("given", [None, "3"])
def test_thread_settings_kept_for_the_processes_started(yolov9_tree, given):
    """Upstream sets OMP_NUM_THREADS to min(8, CPUs - 1) when imported (1 on a 2-core machine), and a process it
    starts inherits that; with the shims the environment keeps what it was given (unset, or the user's value), and
    upstream's own NUM_THREADS is still computed."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NUMEXPR_MAX_THREADS")}
    if given:
        env["OMP_NUM_THREADS"] = given
    apply = "from utils.qat.core import compat; compat.apply()"
    upstream = min(8, max(1, os.cpu_count() - 1))

    def run(script: str) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", script], cwd=yolov9_tree, capture_output=True, text=True,
                              timeout=300, env={**env, "PYTHONDONTWRITEBYTECODE": "1"})
        return ok(proc).split()[-4:]
    assert run(THREADS_SCRIPT.replace("__APPLY__", "")) == [str(upstream), str(upstream), str(upstream),
                                                           str(upstream)]  # the upstream behaviour
    kept = given or "None"
    assert run(THREADS_SCRIPT.replace("__APPLY__", apply)) == [kept, "None", kept, str(upstream)]


# ---------------------------------------------------------------------------------------------
# Known third-party noise (utils/qat/core/noise.py) is silenced by its exact text; real warnings still show.

def test_known_noise_silenced_real_warnings_kept(yolov9_tree):
    proc = run_python(yolov9_tree, """
        import logging, warnings
        from utils.qat.core import compat
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
