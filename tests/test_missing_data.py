"""Tests that cannot find their data say so in one sentence naming YOLOV9_QAT_SHARED and exit non-zero, under
README's command (pytest -n: several worker processes) and without it, and no worker crashes; a selection that
needs no data runs without it. Each case is a pytest run of its own on a two-test file, with this conftest."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

TESTS = '''
def test_needs_the_data(shared):
    pass


def test_needs_nothing():
    pass
'''


def _pytest(tmp_path, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_tiny.py").write_text(TESTS)
    env = {**os.environ, "YOLOV9_QAT_SHARED": str(tmp_path / "no-such-folder"),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run in a worker
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rs",
                           "--rootdir", str(tmp_path), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [["-n", "2", "--dist", "loadfile"], ["-n", "0"]], ids=["n2", "n0"])
def test_a_run_without_its_data_stops_in_one_sentence(tmp_path, workers):
    r = _pytest(tmp_path, "test_tiny.py", *workers)
    out = r.stdout + r.stderr
    sentence = f"test data not found at {tmp_path / 'no-such-folder'}: set YOLOV9_QAT_SHARED to the shared/ folder"
    assert r.returncode == 2, out[-3000:]
    assert out.count(sentence) == 1, out[-3000:]
    for crash in ("crashed", "keyboard-interrupt", "Traceback", "replacing"):
        assert crash not in out, out[-3000:]
    assert "passed" not in out.splitlines()[-1], out[-3000:]  # it stopped before any test


@pytest.mark.slow
def test_a_selection_that_needs_no_data_runs_without_it(tmp_path):
    r = _pytest(tmp_path, "test_tiny.py::test_needs_nothing", "-n", "2")
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
