"""Type check of the TensorRT-facing modules (mypy.ini) against ``tensorrt-stubs``, and proof the stubs are used;
the lint of every Python file (ruff, ``[tool.ruff]`` in pyproject.toml).

tensorrt-stubs 10.13 installs ``tensorrt/__init__.pyi`` without a ``py.typed`` marker (mypy would skip
it and treat tensorrt as untyped) and ``tensorrt_bindings/tensorrt.pyi`` has a few lines that are not
valid Python (a parameter named ``in``; a required parameter after defaulted ones), which stop mypy.
:func:`prepare_stubs` copies the installed stub files into a folder with exactly those lines repaired;
MYPYPATH points mypy at it. A deliberately wrong use of the TensorRT API must then fail the check.

Run by hand:  python3 tests/test_typecheck.py
"""
from __future__ import annotations

import ast
import configparser
import importlib.metadata as md
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

MISUSE = '''\
import tensorrt as trt


def run(ctx: trt.IExecutionContext, engine: trt.ICudaEngine, stream: object) -> None:
    ctx.execute_async_v3(stream)                  # needs the int stream handle
    ctx.set_tensor_address("images", 1.5)         # needs an int device pointer
    n = engine.num_io_tensors()                   # a property, not a method
    trt.Builder(trt.Logger()).create_network("strongly")  # flags are an int bit mask
'''


def _fix_def(line: str) -> str:
    """Repair one stub ``def`` line that does not parse."""
    fixed = re.sub(r"\bin:", "in_:", line)
    try:
        ast.parse(fixed.strip() + " ...")
        return fixed
    except SyntaxError:
        pass
    head, _, rest = fixed.partition("(")
    params, _, tail = rest.rpartition(")")
    parts = [p.strip() for p in params.split(", ")]
    seen_default = False
    for i, p in enumerate(parts):
        if "=" in p:
            seen_default = True
        elif seen_default and p and not p.startswith("*"):
            parts[i] = p + " = ..."
    fixed = head + "(" + ", ".join(parts) + ")" + tail
    ast.parse(fixed.strip() + " ...")  # still broken: let the SyntaxError surface
    return fixed


def prepare_stubs(dest: Path) -> tuple[Path, int]:
    """Copy the installed tensorrt-stubs .pyi files into ``dest`` (repaired); returns (dest, lines fixed)."""
    dist = md.distribution("tensorrt-stubs")
    fixed = 0
    for f in dist.files or []:
        if not str(f).endswith(".pyi"):
            continue
        lines = Path(str(dist.locate_file(f))).read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("def "):
                try:
                    ast.parse(line.strip() + " ...")
                except SyntaxError:
                    lines[i] = _fix_def(line)
                    fixed += 1
        out = dest / str(f)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    if not (dest / "tensorrt" / "__init__.pyi").is_file():
        raise RuntimeError("tensorrt-stubs has no tensorrt/__init__.pyi")
    return dest, fixed


def _mypy(stubs: Path, cache: Path, *files: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MYPYPATH": str(stubs)}
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(cache),
                           *files],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _need_tools() -> None:
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (pip install mypy)")
    try:
        md.distribution("tensorrt-stubs")
    except md.PackageNotFoundError:
        pytest.skip("tensorrt-stubs is not installed (pip install tensorrt-stubs)")


def test_mypy_passes_against_tensorrt_stubs(tmp_path):
    _need_tools()
    stubs, _ = prepare_stubs(tmp_path / "stubs")
    r = _mypy(stubs, tmp_path / "cache")
    assert r.returncode == 0 and "Success: no issues found in 11 source files" in r.stdout, r.stdout + r.stderr

    # the stubs are really used: a wrong use of the TensorRT API fails the same check
    misuse = tmp_path / "trt_misuse.py"
    misuse.write_text(MISUSE)
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "mypy.ini")
    files = [f.strip() for f in cfg["mypy"]["files"].split(",")]
    r = _mypy(stubs, tmp_path / "cache", *files, str(misuse))
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert errors and all(line.startswith(str(misuse)) for line in errors), out
    assert any('"execute_async_v3" of "IExecutionContext" has incompatible type "object"; expected "int"' in e
               for e in errors), out
    assert any('"set_tensor_address" of "IExecutionContext" has incompatible type "float"' in e for e in errors), out
    assert any('"int" not callable' in e for e in errors), out
    assert any('"create_network" of "Builder" has incompatible type "str"' in e for e in errors), out


def test_ruff_finds_nothing():
    """``ruff check`` from the top of the repository: unused imports and variables, undefined names, and the
    pycodestyle checks pyproject.toml selects. Fix what it names (or, for a deliberate case, ``# noqa: F401``
    with the reason on the line)."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (./install_dependencies.sh --dev installs it)")
    ruff = [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise"]
    r = subprocess.run([*ruff, "."], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr

    # the configuration is the one read, and it catches what it is there for
    unused = "import os\n\n\ndef f():\n    x = 1\n"
    r = subprocess.run([*ruff, "--stdin-filename", "tests/unused.py", "-"], cwd=REPO, input=unused,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "F401" in r.stdout and "F841" in r.stdout, r.stdout + r.stderr


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        stubs_dir, n = prepare_stubs(Path(d) / "stubs")
        print(f"tensorrt-stubs copied to {stubs_dir} ({n} lines repaired)", file=sys.stderr)
        res = _mypy(stubs_dir, Path(d) / "cache")
        print(res.stdout + res.stderr, end="")
        sys.exit(res.returncode)
