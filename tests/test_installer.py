"""install_dependencies.sh: which pip commands each flag combination runs, and its refusals.

The script really runs, with ``--dry-run`` (it prints the pip commands instead of running them)
and ``--python`` pointing at a fresh virtual environment in which a fake torch (and, where a
case needs it, a fake TensorRT) stands in for the real thing: the CUDA of "the installed torch"
is whatever a case says. Two cases run pip for real, offline, in a copy of the script.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALLER = REPO / "install_dependencies.sh"
SHARED = Path(os.environ.get("YOLOV9_QAT_SHARED", REPO.parent / "shared")).resolve()
TREX_URL = "git+https://github.com/NVIDIA/TensorRT.git@v11.0#subdirectory=tools/experimental/trt-engine-explorer"

# YOLOv9's requirements.txt (as upstream ships it), used where ../shared is not at hand.
UPSTREAM_REQUIREMENTS = """\
# Base ------------------------------------------------------------------------
gitpython
ipython
matplotlib>=3.2.2
numpy>=1.18.5
opencv-python>=4.1.1
Pillow>=7.1.2
psutil
PyYAML>=5.3.1
requests>=2.23.0
scipy>=1.4.1
thop>=0.1.1
torch>=1.7.0
torchvision>=0.8.1
tqdm>=4.64.0
tensorboard>=2.4.1
pandas>=1.1.4
seaborn>=0.11.0
albumentations>=1.0.3
pycocotools>=2.0
"""


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    """A fresh virtual environment: this interpreter's pip (linked in: quicker than ensurepip), no torch."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    proc = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        pytest.skip(f"cannot create a virtual environment here: {proc.stderr.strip()[-300:]}")
    python = root / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    pip_dir = Path(importlib.util.find_spec("pip").submodule_search_locations[0])
    (site / "pip").symlink_to(pip_dir)
    for info in pip_dir.parent.glob(f"pip-{importlib.metadata.version('pip')}.dist-info"):
        (site / info.name).symlink_to(info)
    return python


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def dist_info(site: Path, name: str, version: str) -> None:
    write(site / f"{name}-{version}.dist-info" / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def fake_python(tmp_path: Path, venv_python: Path, *, cuda: str | None = "12.8", torch: bool = True,
                tensorrt: str | None = None, trex: bool = False, openvino: str | None = None) -> Path:
    """An interpreter (a wrapper around the venv's) that sees the fake packages asked for."""
    site = tmp_path / "fake-site"
    if torch:
        local = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
        write(site / "torch" / "__init__.py", f'__version__ = "2.9.1+{local}"\nfrom . import version\n')
        write(site / "torch" / "version.py", f"cuda = {cuda!r}\n")
        dist_info(site, "torch", "2.9.1")
        write(site / "torchvision" / "__init__.py", '__version__ = "0.24.1"\n')
        dist_info(site, "torchvision", "0.24.1")
    if tensorrt:
        write(site / "tensorrt" / "__init__.py", f'__version__ = "{tensorrt}"\n')
    if trex:
        write(site / "trex" / "__init__.py", "")
    if openvino:  # openvino.get_version() as the real one spells it: VERSION-BUILD-HASH-BRANCH
        write(site / "openvino" / "__init__.py", f'def get_version():\n    return "{openvino}-22982-e213a147257-releases"\n')
    site.mkdir(parents=True, exist_ok=True)
    wrapper = tmp_path / "python-under-test"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={shlex.quote(str(site))} exec {shlex.quote(str(venv_python))} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def install(*args, script: Path = INSTALLER, env: dict[str, str | None] | None = None, cwd: Path | None = None):
    full_env = {**os.environ, **(env or {})}
    full_env = {key: value for key, value in full_env.items() if value is not None}  # None: unset
    return subprocess.run(["bash", str(script), *map(str, args)], capture_output=True, text=True, timeout=600,
                          env=full_env, cwd=cwd)


def pip_commands(proc) -> list[list[str]]:
    """The commands the script printed ('+ cmd ...'), split like the shell would."""
    return [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]


def assert_one_error(proc, *fragments: str, code: int = 1) -> None:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and lines[0].endswith("."), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture
def yolov9_dir(tmp_path) -> Path:
    tree = tmp_path / "yolov9"
    src = SHARED / "yolov9-data" / "requirements.txt"
    write(tree / "requirements.txt", src.read_text() if src.is_file() else UPSTREAM_REQUIREMENTS)
    return tree


def test_default_installs_the_toolkit_requirements_only(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    proc = install("--dry-run", "--python", py)
    assert proc.returncode == 0, proc.stderr
    commands = pip_commands(proc)
    assert len(commands) == 1, proc.stdout
    cmd = commands[0]
    assert cmd[:4] == [str(py), "-m", "pip", "install"]
    assert cmd[cmd.index("-r") + 1] == str(REPO / "requirements.txt")
    assert "-c" in cmd  # torch and torchvision pinned as installed
    assert "keeping torch==2.9.1, torchvision==0.24.1 as installed" in proc.stdout
    assert "==> TensorRT" not in proc.stdout and "==> OpenVINO" not in proc.stdout
    assert "TensorRT: not installed" in proc.stdout
    assert "OpenVINO: not installed (needed only to run the ONNX on CPUs with INT8 kernels: rerun with --openvino)" \
        in proc.stdout
    assert "dry run: nothing was installed." in proc.stdout


def test_requirements_pin_what_must_be_pinned():
    lines = (REPO / "requirements.txt").read_text().splitlines()
    reqs = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    assert "setuptools>=80,<81" in reqs and "nvidia-modelopt==0.47.0" in reqs
    for pin in ("setuptools>=80,<81", "nvidia-modelopt==0.47.0"):
        index = lines.index(pin)
        assert lines[index - 1].startswith("# "), f"{pin} has no reason comment above it"
    names = {req.split("=")[0].split(">")[0].split("<")[0].lower().replace("_", "-") for req in reqs}
    assert {"onnx", "onnxslim", "onnxruntime", "pycocotools", "tqdm", "huggingface-hub", "requests"} <= names
    assert "torch" not in names and "torchvision" not in names and "pytorch-quantization" not in names


def test_yolov9_requirements_without_torch_lines(tmp_path, venv_python, yolov9_dir):
    py = fake_python(tmp_path, venv_python)
    proc = install("--dry-run", "--python", py, "--yolov9", yolov9_dir)
    assert proc.returncode == 0, proc.stderr
    (cmd,) = pip_commands(proc)
    files = [cmd[i + 1] for i, arg in enumerate(cmd) if arg == "-r"]
    assert files[0] == str(REPO / "requirements.txt") and len(files) == 2
    assert files[1] != str(yolov9_dir / "requirements.txt")  # a filtered copy, resolved together with ours
    assert "leaving out of" in proc.stdout
    for dropped in ("torch>=1.7.0 (torch 2.9.1+cu128 is installed and is kept)", "torchvision>=0.8.1",
                    "opencv-python>=4.1.1 (opencv-python-headless provides cv2)"):
        assert dropped in proc.stdout, dropped
    (would,) = [line for line in proc.stdout.splitlines() if line.startswith("would install from")]
    kept = would.split(": ", 1)[1].split(", ")
    assert "gitpython" in kept and "pycocotools>=2.0" in kept and "numpy>=1.18.5" in kept
    assert not [req for req in kept if req.lower().startswith(("torch", "opencv-python>"))], kept


def test_yolov9_keeps_torch_lines_when_torch_is_missing(tmp_path, venv_python, yolov9_dir):
    py = fake_python(tmp_path, venv_python, torch=False)
    proc = install("--dry-run", "--python", py, "--yolov9", yolov9_dir)
    assert proc.returncode == 0, proc.stderr
    assert "torch is not installed" in proc.stdout
    (would,) = [line for line in proc.stdout.splitlines() if line.startswith("would install from")]
    assert "torch>=1.7.0" in would and "torchvision>=0.8.1" in would
    assert "-c" not in pip_commands(proc)[0]  # nothing to keep


@pytest.mark.parametrize("case", ["missing", "file", "no-requirements"])
def test_yolov9_dir_must_be_a_tree(tmp_path, venv_python, case):
    py = fake_python(tmp_path, venv_python)
    target = tmp_path / "target"
    if case == "file":
        target.write_text("x")
    elif case == "no-requirements":
        target.mkdir()
    proc = install("--dry-run", "--python", py, "--yolov9", target)
    expected = {"missing": "does not exist", "file": "is not a directory", "no-requirements": "has no requirements.txt"}
    assert_one_error(proc, str(target), expected[case])
    assert not pip_commands(proc)  # checked before anything runs


@pytest.mark.parametrize("cuda,package", [("12.8", "tensorrt-cu12"), ("13.0", "tensorrt-cu13")])
def test_tensorrt_matches_the_cuda_of_torch(tmp_path, venv_python, cuda, package):
    py = fake_python(tmp_path, venv_python, cuda=cuda)
    proc = install("--dry-run", "--python", py, "--tensorrt")
    assert proc.returncode == 0, proc.stderr
    commands = pip_commands(proc)
    assert len(commands) == 2
    trt = commands[1]
    assert trt[-1] == package and trt[:4] == [str(py), "-m", "pip", "install"]
    assert trt[trt.index("--extra-index-url") + 1] == "https://pypi.nvidia.com"
    assert "-c" in trt  # never changes torch either


@pytest.mark.parametrize("torch", ["cpu", "none"])
def test_tensorrt_needs_a_cuda_torch(tmp_path, venv_python, torch):
    py = fake_python(tmp_path, venv_python, cuda=None, torch=torch == "cpu")
    proc = install("--dry-run", "--python", py, "--tensorrt")
    assert_one_error(proc, "--tensorrt", "CPU build" if torch == "cpu" else "torch is not installed")
    assert len(pip_commands(proc)) == 1 and "==> TensorRT" not in proc.stdout


def test_tensorrt_already_present_is_reported_not_reinstalled(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python, tensorrt="10.13.3.9")
    proc = install("--dry-run", "--python", py, "--tensorrt")
    assert proc.returncode == 0, proc.stderr
    assert len(pip_commands(proc)) == 1
    assert "TensorRT 10.13.3.9 is already installed" in proc.stdout
    assert "TensorRT: 10.13.3.9 (import tensorrt)" in proc.stdout


def test_without_flags_tensorrt_is_detected_not_touched(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python, tensorrt="10.9.0.34")
    proc = install("--dry-run", "--python", py)
    assert proc.returncode == 0, proc.stderr
    assert len(pip_commands(proc)) == 1 and "==> TensorRT" not in proc.stdout
    assert "TensorRT: 10.9.0.34 (import tensorrt)" in proc.stdout


def test_trex(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    proc = install("--dry-run", "--python", py, "--trex")
    assert proc.returncode == 0, proc.stderr
    commands = pip_commands(proc)
    assert len(commands) == 2 and commands[1][-1] == TREX_URL
    assert "==> TensorRT Engine Explorer (trex)" in proc.stdout

    present = fake_python(tmp_path / "with-trex", venv_python, trex=True)
    proc = install("--dry-run", "--python", present, "--trex")
    assert proc.returncode == 0 and len(pip_commands(proc)) == 1
    assert "TensorRT Engine Explorer (trex) is already installed" in proc.stdout


def test_openvino(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    proc = install("--dry-run", "--python", py, "--openvino")
    assert proc.returncode == 0, proc.stderr
    commands = pip_commands(proc)
    assert len(commands) == 2
    ov = commands[1]
    assert ov[:4] == [str(py), "-m", "pip", "install"] and ov[-1] == "openvino"
    assert "-c" in ov  # never changes torch either
    assert "==> OpenVINO (openvino)" in proc.stdout

    present = fake_python(tmp_path / "with-openvino", venv_python, openvino="2026.4.1")
    proc = install("--dry-run", "--python", present, "--openvino")
    assert proc.returncode == 0 and len(pip_commands(proc)) == 1, proc.stdout + proc.stderr
    assert "OpenVINO 2026.4.1 is already installed (import openvino works): not installing another." in proc.stdout
    assert "OpenVINO: 2026.4.1 (import openvino)" in proc.stdout


def test_peers(tmp_path, venv_python):
    """--peers installs NNCF and OpenVINO (benchmarks/peers.py), each under the torch constraint."""
    py = fake_python(tmp_path, venv_python)
    proc = install("--dry-run", "--python", py, "--peers")
    assert proc.returncode == 0, proc.stderr
    commands = pip_commands(proc)
    assert [c[-1] for c in commands[1:]] == ["openvino", "nncf"] and all("-c" in c for c in commands[1:])
    assert "==> NNCF (nncf)" in proc.stdout

    present = fake_python(tmp_path / "with-openvino", venv_python, openvino="2026.4.1")
    proc = install("--dry-run", "--python", present, "--peers")
    assert proc.returncode == 0 and [c[-1] for c in pip_commands(proc)[1:]] == ["nncf"], proc.stdout + proc.stderr


def test_all_flags_in_order(tmp_path, venv_python, yolov9_dir):
    py = fake_python(tmp_path, venv_python, cuda="13.0")
    proc = install("--trex", "--yolov9", yolov9_dir, "--dry-run", "--tensorrt", "--openvino", f"--python={py}")
    assert proc.returncode == 0, proc.stderr
    steps = [line[4:] for line in proc.stdout.splitlines() if line.startswith("==> ")]
    assert steps == ["toolkit and YOLOv9 requirements", "OpenVINO (openvino)",
                     "TensorRT (tensorrt-cu13, for torch's CUDA 13.0)", "TensorRT Engine Explorer (trex)"]


def test_usage_errors(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    assert_one_error(install("--bogus", "--dry-run"), "unknown option --bogus", code=2)
    assert_one_error(install("somewhere", "--dry-run"), "unexpected argument 'somewhere'", code=2)
    assert_one_error(install("--dry-run", "--yolov9"), "--yolov9 needs a directory", code=2)
    assert_one_error(install("--dry-run", "--python"), "--python needs an interpreter", code=2)
    assert_one_error(install("--dry-run", "--python", tmp_path / "no-python"), "not found")
    proc = install("--help")
    assert proc.returncode == 0 and "--tensorrt" in proc.stdout and "--dry-run" in proc.stdout
    assert not pip_commands(proc)
    assert install("--dry-run", "--python", py).returncode == 0


def _offline_checkout(tmp_path: Path, requirements: str) -> Path:
    """A copy of the installer beside a requirements.txt of our choosing."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy2(INSTALLER, checkout / "install_dependencies.sh")
    (checkout / "requirements.txt").write_text(requirements)
    return checkout


OFFLINE = {"PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": None, "PIP_EXTRA_INDEX_URL": None,
           "PIP_INDEX_URL": None, "PIP_NO_CACHE_DIR": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def test_real_run_is_idempotent(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    checkout = _offline_checkout(tmp_path, "# already installed in the venv\npip\n")
    for _ in range(2):
        proc = install("--python", py, script=checkout / "install_dependencies.sh", env=OFFLINE)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Requirement already satisfied: pip" in proc.stdout
        assert "(toolkit requirements:" in proc.stdout


def test_real_run_stops_at_the_failing_step(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    checkout = _offline_checkout(tmp_path, "yolov9-qat-no-such-package-for-tests==0.0.1\n")
    proc = install("--python", py, "--tensorrt", "--trex", script=checkout / "install_dependencies.sh", env=OFFLINE)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: step 'toolkit requirements' failed")
    assert "==> TensorRT" not in proc.stdout


def test_dev_adds_the_test_tools_and_the_stubs_without_their_dependencies(tmp_path, venv_python):
    py = fake_python(tmp_path, venv_python)
    proc = install("--dry-run", "--python", py, "--dev")
    assert proc.returncode == 0, proc.stderr
    tools, stubs = pip_commands(proc)
    files = [tools[i + 1] for i, arg in enumerate(tools) if arg == "-r"]
    assert files == [str(REPO / "requirements.txt"), str(REPO / "requirements-dev.txt")]  # resolved together
    assert stubs[-2:] == ["--no-deps", "tensorrt-stubs"] and "-c" in stubs
    dev = (REPO / "requirements-dev.txt").read_text().split()
    assert "pytest" in dev and "mypy" in dev and "ruff" in dev
    assert "openvino" in dev  # CI scores the quickstart model's graphs with val_trt.py --backend openvino
    assert "nncf" in dev  # tests/test_peers.py runs benchmarks/peers.py's NNCF peer


def _readme_test_lines() -> list[str]:
    """The bash block of README's 'Tests, set-up included' paragraph."""
    text = (REPO / "README.md").read_text()
    block = text[text.index("Tests, set-up included"):]
    block = block[block.index("```bash\n") + len("```bash\n"):]
    return block[:block.index("```")].strip().splitlines()


def test_ci_runs_readme_test_command_exactly():
    export, line = _readme_test_lines()
    assert export.startswith("export YOLOV9_DIR=")
    pytest_command = "python3 -m pytest tests -q -rs -n auto --maxprocesses 4 --dist loadfile"
    assert "./install_dependencies.sh --dev" in line and line.endswith(pytest_command)
    ci = (REPO / ".ci" / "run").read_text()
    assert f"readme_tests='{line}'" in ci
    assert 'bash -c "$readme_tests"' in ci and "export YOLOV9_DIR" in ci
    # the torch the tests see is the one README's line installs, pinned, and CI installs none of its own before it
    assert line.startswith("python3 -m pip install torch==2.14.1 torchvision==0.29.1 && ")
    assert ci.count("pip install torch") == 1, "CI must not install a torch other than README's line does"
    assert "5) " in ci  # pytest's 'no tests collected' fails CI
    # The second pass: README's pytest command, -m models, against the yolo9 stand-in (as README's paragraph says).
    models = '"${readme_tests##*&& } -m models"'
    assert f"models_tests={models}" in ci and 'YOLOV9_DIR="$models_dir" bash -c "$models_tests"' in ci
    assert "YOLOV9_STANDIN=yolo9 bash" in ci
    expanded = subprocess.run(["bash", "-c", f"readme_tests={shlex.quote(line)}; echo {models}"], capture_output=True,
                              text=True, check=True).stdout.strip()
    assert expanded == pytest_command + " -m models"
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("Tests, set-up included"):readme.index("\n## ", readme.index("Tests, set-up included"))]
    assert "`-m models`" in section and "`yolo9`" in section and "bash .ci/run" in section
