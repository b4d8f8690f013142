"""modelopt is imported without its unused plugins' packages (utils/qat/quantize/modelopt_import.py).

A real package named ``transformers`` (written here, on the child process's path; it records who imported it)
stands in for Hugging Face's: modelopt imports it when it is installed, unless the toolkit's import hides it."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PACKAGE = textwrap.dedent("""\
    import os, traceback
    __version__ = "5.17.0"
    with open(os.environ["IMPORT_LOG"], "a") as f:
        f.write("".join(traceback.format_stack()) + "@" * 4 + "\\n")  # four @ end one record
    """)


@pytest.fixture()
def fake_transformers(tmp_path):
    (tmp_path / "site" / "transformers").mkdir(parents=True)
    (tmp_path / "site" / "transformers" / "__init__.py").write_text(PACKAGE)
    return tmp_path


def _python(tmp: Path, code: str) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp / "imports.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp / "site"), str(REPO)]), "IMPORT_LOG": str(log),
           "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=tmp)
    return r, log.read_text() if log.exists() else ""


def test_modelopt_imported_by_the_toolkit_leaves_transformers_alone(fake_transformers):
    r, log = _python(fake_transformers, textwrap.dedent("""\
        import sys
        from utils.qat.quantize.modelopt_import import mtq
        assert "transformers" not in sys.modules, "modelopt imported transformers"
        from modelopt.torch.quantization.nn import TensorQuantizer
        import transformers  # the user's own import still works afterwards
        print("ok", transformers.__version__, mtq.__name__, TensorQuantizer.__name__)
        """))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "ok 5.17.0 modelopt.torch.quantization TensorQuantizer" in r.stdout
    assert log.count("@@@@") == 1 and "/modelopt/" not in log  # imported once, by the line above, not by modelopt
    assert "is not tested with current version of modelopt" not in r.stderr


def test_modelopt_imported_directly_pulls_transformers_in(fake_transformers):
    """The control: without the toolkit's import, modelopt loads the package (so the test above can fail)."""
    r, log = _python(fake_transformers, "import modelopt.torch.quantization")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "/modelopt/" in log


FIRST_IMPORT_IN_A_FRAME = textwrap.dedent("""\
    import gc, weakref
    class Dataloader:  # what ptq() held when it first imported modelopt
        pass
    def calibrate():
        loader = Dataloader()
        from utils.qat.quantize import modelopt_import  # noqa: F401
        return weakref.ref(loader)
    loader = calibrate()
    gc.collect()
    print("freed" if loader() is None else "kept")
    """)


def test_the_first_importers_frames_are_let_go(tmp_path):
    """PuLP (imported by modelopt) keeps the exception of each solver it did not find, with its traceback, in the
    solver's class: the frames of whoever imported modelopt first. Inside the calibration that kept its dataloader,
    worker processes and all, to the process's exit. The toolkit's import drops those tracebacks; the control shows
    modelopt imported directly keeps them (so this test can fail)."""
    r, _ = _python(tmp_path, FIRST_IMPORT_IN_A_FRAME)
    assert r.returncode == 0 and r.stdout.strip() == "freed", (r.stdout, r.stderr[-2000:])
    control = FIRST_IMPORT_IN_A_FRAME.replace("from utils.qat.quantize import modelopt_import",
                                              "import modelopt.torch.quantization")
    r, _ = _python(tmp_path, control)
    assert r.returncode == 0 and r.stdout.strip() == "kept", (r.stdout, r.stderr[-2000:])


def test_a_package_imported_before_is_left_as_it_is(fake_transformers):
    r, log = _python(fake_transformers, textwrap.dedent("""\
        import transformers
        from utils.qat.quantize.modelopt_import import mtq
        import sys
        assert sys.modules["transformers"] is transformers
        print("ok")
        """))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok" and log.count("@@@@") == 1


def _modelopt_imports(path: Path) -> list[tuple[int, bool]]:
    """(line, whether the toolkit's modelopt import precedes it in its scope) for each ``modelopt.torch`` import
    in ``path`` outside ``if TYPE_CHECKING``."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = []
    for scope in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        seen_toolkit = False
        for node in scope.body:
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in typing_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.startswith("utils.qat.quantize.modelopt_import") for n in names):
                seen_toolkit = True
            elif any(n.startswith("modelopt.torch") for n in names):
                found.append((node.lineno, seen_toolkit or "modelopt_import" in path.name))
    return found


def test_every_first_modelopt_import_goes_through_the_toolkit():
    """Each module (and function) importing modelopt.torch first imports utils.qat.quantize.modelopt_import, except
    where another module has already loaded modelopt (qdq.py is only reached on a quantized model)."""
    loaded_before = {"utils/qat/quantize/qdq.py"}
    sites = {f"{p.relative_to(REPO)}:{line}": ok for p in sorted((REPO / "utils" / "qat").rglob("*.py"))
             if str(p.relative_to(REPO)) not in loaded_before for line, ok in _modelopt_imports(p)}
    assert len(sites) >= 7  # rules, model_quant, calib, state, image_hist, checkpoint (twice): the scan sees them
    missing = [site for site, ok in sites.items() if not ok]
    assert not missing, f"modelopt.torch imported without utils.qat.quantize.modelopt_import first: {missing}"
