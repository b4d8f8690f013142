"""Test harness: a freshly patched copy of the YOLOv9 tree per session, real data, small subsets.

The tree comes from ``YOLOV9_DIR``; without it the harness clones upstream (network permitting)
and otherwise stops the run with a message saying how to provide one. Data and the reference
model come from ``YOLOV9_QAT_SHARED`` (default: ``../shared`` beside the repository).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("YOLOV9_QAT_SHARED", REPO.parent / "shared")).resolve()
UPSTREAM_URL = "https://github.com/WongKinYiu/yolov9.git"


def _source_tree(tmp_root: Path) -> Path:
    env = os.environ.get("YOLOV9_DIR")
    if env:
        src = Path(env).resolve()
        if not (src / "models" / "yolo.py").is_file():
            pytest.exit(f"YOLOV9_DIR={src} is not a YOLOv9 tree (no models/yolo.py); point it at a clone.", 2)
        return src
    dest = tmp_root / "yolov9-clone"
    try:
        subprocess.run(["git", "clone", "--depth", "1", "-q", UPSTREAM_URL, str(dest)], check=True, timeout=120,
                       capture_output=True)
    except (subprocess.SubprocessError, OSError):
        pytest.exit("YOLOV9_DIR is not set and cloning github.com/WongKinYiu/yolov9 failed: "
                    "set YOLOV9_DIR to a YOLOv9 clone (or run .ci/run, which builds one).", 2)
    return dest


_TREE: Path | None = None


def pytest_configure(config):
    """Patch a fresh copy of the tree before collection, so every ``utils.qat`` import in a test module
    resolves inside the patched tree (never the repository's own ``utils/``, which lacks upstream's)."""
    global _TREE
    import tempfile
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # one of several test processes (pytest -n N): one CPU thread each, for it and the CLIs it launches,
        # so that N processes share the cores instead of N x cores threads competing for them
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        torch.set_num_threads(1)
    elif getattr(config.option, "numprocesses", None):
        return  # the controller of pytest -n N runs no test: its workers patch their own trees
    # setuptools now, as every CLI process imports it (torch.utils.cpp_extension does): setuptools' distutils
    # hack stands aside for good once something looks pip up (tests/test_installer.py does), and a first
    # `import setuptools` after that fails its own check, in whichever in-process CLI test comes next.
    with contextlib.suppress(ImportError):
        import setuptools  # noqa: F401
    root = Path(tempfile.mkdtemp(prefix="yolov9-qat-tests-"))
    config.add_cleanup(lambda: shutil.rmtree(root, ignore_errors=True))
    src = _source_tree(root)
    tree = root / "yolov9"
    shutil.copytree(src, tree, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__"))
    subprocess.run(["chmod", "-R", "u+w", str(tree)], check=True)  # the stand-in's folders are read-only
    r = subprocess.run(["bash", str(REPO / "patch_yolov9.sh"), str(tree)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.exit(f"patch_yolov9.sh failed on the test tree: {r.stderr.strip() or r.stdout.strip()}", 2)
    here = {"", ".", str(REPO)}
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != str(REPO) and p not in here]
    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(REPO / "tests"))
    from utils.qat.core import compat
    compat.apply(tree)
    _TREE = tree


@pytest.fixture(scope="session")
def yolov9_tree() -> Path:
    """The patched copy of the YOLOv9 tree (on sys.path, compat shims applied)."""
    return _TREE


# How the skip reason of a test that needs a module or script the tree lacks ends (the faithful stand-in has no
# ELAN1, DSegment or segment/ scripts; such tests are marked ``models``).
ELSEWHERE = "it runs against a clone, or the yolo9 stand-in (.ci/run's -m models pass)"


def tree_has(tree: Path, symbol: str) -> bool:
    return f"class {symbol}(" in (tree / "models" / "common.py").read_text()


def modernised(tree: Path) -> str | None:
    """Why ``tree`` does not have upstream's breakages on today's stack (None: it has them). The ``yolo9`` stand-in
    (../shared/tools/make-yolov9-tree.sh) replaces pkg_resources, np.trapz, Pillow's getsize, ...: its
    utils/general.py imports no pkg_resources, which upstream's, a clone's and the faithful stand-in's do."""
    if "import pkg_resources" not in (tree / "utils" / "general.py").read_text():
        return "its utils/general.py imports no pkg_resources"
    return None


def data_missing() -> str | None:
    """The one sentence that stops a run whose tests need the shared data when it is not there (None: it is)."""
    if (SHARED / "datasets" / "coco334").is_dir():
        return None
    return (f"test data not found at {SHARED}: set YOLOV9_QAT_SHARED to the shared/ folder (its datasets/ and "
            "weights/; the default is ../shared beside the repository)")


def pytest_collection_modifyitems(session, config, items):
    """A run that needs the shared data without it stops before any test, in one sentence; then tests marked
    ``compat`` show an upstream breakage first: on a modernised tree they are skipped, saying why."""
    missing = data_missing()
    if missing and any("shared" in getattr(item, "fixturenames", ()) for item in items):
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            pytest.exit(missing, 2)
        # A worker of pytest -n N: pytest.exit there reads as a crashed worker. Run nothing and ask to stop: the
        # controller ends the session with this sentence ("Interrupted: ..."), exit status 2.
        session.shouldstop = missing
        config.hook.pytest_deselected(items=list(items))
        items[:] = []
        return
    why = modernised(_TREE) if _TREE is not None else None
    if why is None:
        return
    skip = pytest.mark.skip(reason=f"upstream's breakage is not in this YOLOv9 tree ({why}: modernised, like the "
                                   "yolo9 stand-in); the compat tests run against the faithful stand-in or a clone")
    for item in items:
        if item.get_closest_marker("compat"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared() -> Path:
    missing = data_missing()  # a run that asks for it is stopped at collection (pytest_collection_modifyitems)
    if missing:
        pytest.fail(missing, pytrace=False)
    return SHARED


@pytest.fixture(scope="session")
def gelan_c(shared) -> Path:
    return shared / "weights" / "gelan-c-coco334.pt"


def make_subset(src_images: Path, dest: Path, n: int) -> Path:
    """Link the first ``n`` images (sorted) of a YOLO dataset split and their labels into ``dest``."""
    images = sorted(p for p in src_images.iterdir() if p.suffix.lower() in {".jpg", ".jpeg", ".png"})[:n]
    img_dir = dest / "images" / src_images.name
    lbl_dir = dest / "labels" / src_images.name
    img_dir.mkdir(parents=True, exist_ok=True)
    lbl_dir.mkdir(parents=True, exist_ok=True)
    labels = src_images.parent.parent / "labels" / src_images.name
    for p in images:
        (img_dir / p.name).symlink_to(p)
        lab = labels / (p.stem + ".txt")
        if lab.exists():
            (lbl_dir / lab.name).symlink_to(lab)
    return img_dir


def write_data_yaml(path: Path, train: Path, val: Path, names: list[str]) -> Path:
    import yaml
    path.write_text(yaml.safe_dump({"train": str(train), "val": str(val), "nc": len(names),
                                    "names": dict(enumerate(names))}, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def coco_names(shared) -> list[str]:
    import yaml
    return list(yaml.safe_load((shared / "datasets" / "coco334.yaml").read_text())["names"].values())


def coco_data(root: Path, shared: Path, names: list[str], n_train: int, n_val: int) -> Path:
    """Data yaml in ``root``: the first ``n_train`` coco369 train photos, the first ``n_val`` coco334 val photos."""
    train = make_subset(shared / "datasets" / "coco369" / "images" / "train2017", root / "coco369", n_train)
    val = make_subset(shared / "datasets" / "coco334" / "images" / "val2017", root / "coco334", n_val)
    return write_data_yaml(root / "small.yaml", train, val, names)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory, shared, coco_names) -> Path:
    """Data yaml: 8 coco369 train photos, 8 coco334 val photos (real COCO, real labels)."""
    return coco_data(tmp_path_factory.mktemp("data"), shared, coco_names, 8, 8)


@pytest.fixture(scope="session")
def shapes(tmp_path_factory) -> Path:
    """A small embedded shapes dataset (16 train, 16 val images at 256 px), generated by the repo's script."""
    out = tmp_path_factory.mktemp("shapes") / "shapes"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_shapes_dataset.py"), "--out", str(out),
                    "--train", "16", "--val", "16", "--imgsz", "256"], check=True, capture_output=True)
    return out / "shapes.yaml"


def run_tool(tree: Path, *args: str, timeout: int = 900, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python3 <args>`` inside the patched tree, the way users run the CLIs."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=tree, capture_output=True, text=True, timeout=timeout,
                          env=full_env)


# The module of each CLI, where it is not the script's name without .py.
CLI_MODULES = {"segment/qat_seg.py": "segment.qat_seg", "scripts/benchmark_trt.py": "benchmark_trt",
               "scripts/benchmark_cpu.py": "benchmark_cpu",
               "trtexec": "trtexec_cli"}
SCRIPT_MODULES = ("benchmark_trt", "benchmark_cpu", "trtexec_cli")  # CLIs that live in the tree's scripts/


def cli_module(tree: Path, tool: str):
    """The module of a CLI of the patched tree (scripts/*.py imported from the tree's scripts/)."""
    import importlib
    name = CLI_MODULES.get(tool, tool.removesuffix(".py"))
    if name in SCRIPT_MODULES and str(tree / "scripts") not in sys.path:
        sys.path.append(str(tree / "scripts"))
    return importlib.import_module(name)


def run_main(tree: Path, tool: str, *args: str, cwd: Path | None = None):
    """Run a CLI in this process: ``main(get_args_parser().parse_args(args))`` from the top of the tree, as
    ``run_tool`` runs it but without starting Python again. For the error paths: the QATError it raises is what
    ``run_cli`` prints as ``error: ...`` with exit status 2 (tests/test_validate.py runs that contract itself).
    ``cwd``: the folder it runs in instead of the tree."""
    import importlib
    module = cli_module(tree, tool)
    main = importlib.import_module("qat").main if tool == "segment/qat_seg.py" else module.main
    args_ = module.get_args_parser().parse_args(list(args))
    here = os.getcwd()
    os.chdir(cwd or tree)
    try:
        return main(args_)
    finally:
        os.chdir(here)


def cli_error(tree: Path, tool: str, *args: str, cwd: Path | None = None) -> str:
    """The one sentence a CLI fails with (``run_main``; ``run_cli`` prints it as ``error: <sentence>``)."""
    from utils.qat.core.errors import QATError
    with pytest.raises(QATError) as e:
        run_main(tree, tool, *args, cwd=cwd)
    message = str(e.value)
    assert message and "\n" not in message, message
    return message
