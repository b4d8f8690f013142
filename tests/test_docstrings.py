"""The calls that module docstrings show are real calls: every example line (a docstring line that parses as a
Python statement with a call) names functions and classes that exist, with arguments their signatures take.

A name the example calls must be bound by the example itself (``qmodel, info = prepare(...)``), be a builtin, be
defined or imported by the module, or (for a pointer to another room, like ``evaluate(...)`` in
utils/qat/quantize/state.py) be defined at the top of some toolkit module. A method called on a name the example bound
from a class (``learned = LearnedAmax(...)``; ``learned.release()``) must exist on that class. Names the caller
brings (``model(images)``, ``optimizer.add_param_group``) are not checked: the example does not define them.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import inspect

import pytest

from conftest import REPO

# The overlay's Python modules (what patch_yolov9.sh copies), by import name.
MODULES = sorted(
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for pattern in ("*.py", "utils/qat/**/*.py", "segment/*.py")
    for p in REPO.glob(pattern))
# Called in examples without being defined there: objects the caller brings, and the notation of the formula in
# utils/qat/quantize/qdq.py's docstring (what fake_quant computes, written as math, not calls).
CALLER_OBJECTS = {"model", "backend"}
NOTATION = {"float32", "clamp", "round_half_to_even"}


def _source(module: str) -> str:
    path = REPO / module.replace(".", "/")
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def _docstring(module: str) -> str:
    return ast.get_docstring(ast.parse(_source(module))) or ""


def example_statements(doc: str) -> list[tuple[str, ast.stmt]]:
    """(line, statement) for each docstring line that is a Python statement containing a call."""
    found = []
    for line in doc.splitlines():
        code = line.split("#")[0].strip()
        if "(" not in code:
            continue
        try:
            tree = ast.parse(code + ("\n    pass" if code.endswith(":") else ""))
        except SyntaxError:
            continue
        stmt = tree.body[0]
        if isinstance(stmt, (ast.Expr, ast.Assign, ast.With)) and any(isinstance(n, ast.Call) for n in ast.walk(stmt)):
            found.append((line.strip(), stmt))
    return found


def toolkit_definitions() -> set[str]:
    names = set()
    for module in MODULES:
        tree = ast.parse(_source(module))
        names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names


def check_arguments(func, call: ast.Call, line: str) -> None:
    """The example's keywords and positional count fit ``func``'s signature (``...`` stands for any arguments)."""
    if any(isinstance(a, ast.Constant) and a.value is Ellipsis for a in call.args):
        return
    params = inspect.signature(func).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for kw in call.keywords:
        assert kw.arg is None or kw.arg in names, f"{line!r}: {func.__qualname__} takes no {kw.arg}="
    if not any(p.kind is p.VAR_POSITIONAL for p in params):
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        assert len(call.args) <= len(positional), f"{line!r}: {func.__qualname__} takes {len(positional)} positional"


def bound_names(stmt: ast.stmt) -> dict[str, ast.expr]:
    """Names the statement binds -> the expression they come from."""
    bound: dict[str, ast.expr] = {}
    if isinstance(stmt, ast.Assign):
        for target in stmt.targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    bound[n.id] = stmt.value
    elif isinstance(stmt, ast.With):
        for item in stmt.items:
            if isinstance(item.optional_vars, ast.Name):
                bound[item.optional_vars.id] = item.context_expr
    return bound


def test_example_lines_are_found():
    """The scan sees the examples it is meant to check (a scan that finds nothing checks nothing)."""
    lines = [line for m in MODULES for line, _ in example_statements(_docstring(m))]
    assert any(line.startswith("qmodel, info = prepare(") for line in lines), lines
    assert any(line.startswith("with quantizers_off(") for line in lines), lines
    assert not example_statements("Prose with a call like mean(t^2) in a sentence is not an example.")


@pytest.mark.parametrize("module", [m for m in MODULES if example_statements(_docstring(m))])
def test_docstring_examples_call_what_exists(yolov9_tree, module):
    mod = importlib.import_module(module)
    anywhere = toolkit_definitions()
    example: dict[str, ast.expr] = {}  # names the example binds, across its lines
    for line, stmt in example_statements(_docstring(module)):
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name):
                if f.id in example or f.id in CALLER_OBJECTS | NOTATION or hasattr(builtins, f.id):
                    continue
                if hasattr(mod, f.id):
                    if callable(getattr(mod, f.id)):
                        check_arguments(getattr(mod, f.id), node, line)
                    continue
                assert f.id in anywhere, f"{module}: {line!r} calls {f.id}, which no toolkit module defines"
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                source = example.get(f.value.id)
                if isinstance(source, ast.Call) and isinstance(source.func, ast.Name) and \
                        isinstance(getattr(mod, source.func.id, None), type):
                    cls = getattr(mod, source.func.id)
                    assert hasattr(cls, f.attr), f"{module}: {line!r}: {cls.__name__} has no {f.attr}"
                    check_arguments(getattr(cls, f.attr), node, line)
        example.update(bound_names(stmt))


def test_the_check_catches_a_call_that_does_not_exist(yolov9_tree):
    """What the check is for: a docstring naming a function, keyword or method that is gone fails it."""
    from utils.qat.quantize import model_quant
    stale = {"prepare(fp_model, skip_layers=['22'])": "takes no skip_layers=",
             "qmodel = quantize_model(fp_model)": "which no toolkit module defines"}
    for code, why in stale.items():
        (line, stmt), = example_statements(code)
        call = next(n for n in ast.walk(stmt) if isinstance(n, ast.Call))
        with pytest.raises(AssertionError, match=why):
            if hasattr(model_quant, call.func.id):
                check_arguments(getattr(model_quant, call.func.id), call, line)
            else:
                assert call.func.id in toolkit_definitions(), f"{line!r} calls {call.func.id}, which no toolkit module defines"
