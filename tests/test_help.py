"""Every command a user is told to run answers --help: exit status 0 and a usage text saying what it does and what it
takes. The Python CLIs run from the top of the patched tree, as users run them (several import the tree's modules);
the shell scripts from this checkout. A command whose usage names subcommands ({a,b}) is asked for each one's help
too. The commands run in parallel, once, in a fixture; each then is a test of its own."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import REPO

# The CLIs at the top of the tree and in its segment/ and scripts/ (the overlay copies them there).
TREE_CLIS = ("qat.py", "export_qat.py", "export_yoloV9.py", "reparameterization.py", "val_trt.py",
             "segment/qat_seg.py", *sorted(f"scripts/{p.name}" for p in (REPO / "scripts").glob("*.py")))
BENCHMARKS = sorted(f"benchmarks/{p.name}" for p in (REPO / "benchmarks").glob("*.py"))
SHELL = (*sorted(f"scripts/{p.name}" for p in (REPO / "scripts").glob("*.sh")), "install_dependencies.sh",
         "patch_yolov9.sh")
EXTRA = (("benchmarks/cli_results.py", "custom-model"),)  # a subcommand outside argparse's subparsers


def _argv(command: tuple[str, ...]) -> list[str]:
    script, *sub = command
    if script.endswith(".sh"):
        return ["bash", str(REPO / script), *sub, "--help"]
    path = str(REPO / script) if script.startswith("benchmarks/") else script
    return [sys.executable, path, *sub, "--help"]


def _run(tree, command: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(_argv(command), cwd=tree, capture_output=True, text=True, timeout=300, env=env)


def _subcommands(text: str) -> list[str]:
    """The subcommands a usage line names, e.g. ``qat.py [-h] {quantize,sensitive,eval} ...``."""
    usage = text.split("\n\n")[0]
    found = re.search(r"(?:^|\s)\{([\w,-]+)\} \.\.\.", usage)  # a subparser; not an option's choices
    return found.group(1).split(",") if found else []


@pytest.fixture(scope="module")
def helps(yolov9_tree) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    top = [(c,) for c in (*TREE_CLIS, *BENCHMARKS, *SHELL)] + list(EXTRA)
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        done = dict(zip(top, pool.map(lambda c: _run(yolov9_tree, c), top)))
        subs = [(c[0], s) for c, r in done.items() if len(c) == 1 for s in _subcommands(r.stdout)]
        done.update(zip(subs, pool.map(lambda c: _run(yolov9_tree, c), subs)))
    return done


COMMANDS = ([(c,) for c in (*TREE_CLIS, *BENCHMARKS, *SHELL)] + list(EXTRA)
            + [("qat.py", s) for s in ("quantize", "sensitive", "eval")]
            + [("segment/qat_seg.py", s) for s in ("quantize", "sensitive", "eval")]
            + [("benchmarks/diagnose.py", s) for s in ("calib-sample", "ov-profile", "ptq-spread", "silu-probe")]
            + [("scripts/trtexec_cli.py", s) for s in ("build", "find", "check", "parse")])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_command_answers_help(helps, command):
    r = helps[command]
    shown = " ".join(_argv(command)[1:])
    assert r.returncode == 0, f"{shown}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    text = r.stdout
    assert text.lstrip().lower().startswith("usage:"), f"{shown}: no usage line first:\n{text[:500]}"
    prose = [line for line in text.splitlines()[1:] if len(line.split()) >= 6]  # sentences, not just the synopsis
    assert len(prose) >= 2, f"{shown}: the usage text does not say what the command does and takes:\n{text[:1500]}"


def test_every_subcommand_is_asked(helps):
    """The list above holds every subcommand the commands' usage lines name (a new one joins it)."""
    asked = {c for c in COMMANDS if len(c) == 2}
    named = {c for c in helps if len(c) == 2}
    assert named <= asked, f"subcommands without a --help test: {sorted(named - asked)}"


def test_install_dependencies_help_names_what_dev_installs(helps):
    text = helps[("install_dependencies.sh",)].stdout
    dev = [re.split(r"[\s<>=!~;\[]", line.strip())[0]
           for line in (REPO / "requirements-dev.txt").read_text().splitlines()
           if line.strip() and not line.lstrip().startswith("#")]
    assert "nncf" in dev and "pytest" in dev
    section = text[text.index("\n  --dev"):text.index("\n  --openvino")]
    assert all(re.search(rf"\b{re.escape(p)}\b", section) for p in dev), (dev, section)


def test_benchmark_cpu_help_names_the_default_precision_and_the_ir(helps):
    text = " ".join(helps[("scripts/benchmark_cpu.py",)].stdout.split())
    assert "default precision" in text and "bf16" in text  # the FP32 graph timed at OpenVINO's default, a column
    assert "OpenVINO IR (.xml" in text


def test_quickstart_refuses_an_unknown_option_in_one_sentence(tmp_path):
    r = subprocess.run(["bash", str(REPO / "scripts" / "quickstart.sh"), "-x"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: unknown option -x;") and not list(tmp_path.iterdir())
