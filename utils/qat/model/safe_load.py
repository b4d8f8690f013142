"""Opening a checkpoint without running anything in it: every instruction of its pickle checked before it is read.

A ``.pt`` is a pickle, and a pickle may call any function while it is unpickled. Which functions it may *name* is
not enough to know: YOLOv9's format pickles whole models, so its checkpoints name the model classes, and a pickle
can *call* ``models.yolo.DetectionModel(cfg)`` (``parse_model`` evaluates the cfg's strings as Python; a cfg
given as a path is read from disk) or ``DetectMultiBackend(weights)`` (which loads or downloads another file)
where a genuine checkpoint only *rebuilds* a model: ``NEWOBJ`` (``cls.__new__``, no ``__init__``) and ``BUILD``
(its saved ``__dict__``). So every ``.pt`` is read in two steps:

1. :func:`scan_pickle`, the gate. It runs the pickle's instructions symbolically, on what they would build, without
   building it: each stack item is known as a global (which one), what a call of which global returned, a plain
   container or a plain value. Every global the file names and every *use* of it (called by ``REDUCE`` with which
   kinds of arguments, created by ``NEWOBJ``, given a state by ``BUILD``, passed to another call, stored in a
   container) must be one that genuine checkpoints make: :data:`USES`, learned from real ones (the shared
   reference weights, upstream train.py / train_dual.py checkpoints with ``ema``, ``optimizer``, ``opt`` and
   ``best_fitness``, dual-head and segmentation models, converted GELANs, this toolkit's quantized checkpoints);
   tests/test_safe_load.py regenerates the table from all of them and checks it equals this one. The first use
   outside it stops the load with one sentence naming the file, the global and the use, before anything is
   unpickled. What it cannot follow (instructions torch.save never writes, a malformed stream, torch's format
   from before 1.6, whose whole-model files the restricted unpickler cannot read anyway) is refused too. It reads
   the ``data.pkl`` record through torch's own zip reader, so it scans the bytes torch.load will unpickle.
2. ``torch.load(weights_only=True)`` under ``torch.serialization.safe_globals`` holding only the globals this file
   names (which also keeps torch's unpickler fast: it rebuilds its allow-list at every call): the second guard.

``trust=True`` (``--trust-weights``) loads the file with the full pickle instead, and says so once per file.

What a pickle can still reach, and why each is safe:

- ``NEWOBJ`` of a model class (the ``nn.Module`` classes of the tree's ``models.*`` modules, a fork's blocks
  included, and of ``torch.nn.modules``): ``cls.__new__(cls)``, which is ``object.__new__`` for every class
  allowed (:func:`model_classes` leaves out any other, such as torch's deprecated ``Container``); no
  ``__init__`` runs. Only with no arguments, as genuine files do.
- ``BUILD`` of such an object: its ``__setstate__``, which :func:`model_classes` allows only where it is
  ``nn.Module``'s (``__dict__.update`` plus defaults for missing hook dicts) or one of ``torch.nn.modules``'
  own (``_ConvNd``, ``Upsample``, ``Softmax`` / ``Softmin`` / ``LogSoftmax``, ``MultiheadAttention``,
  ``AvgPool3d``, ``TransformerEncoderLayer`` / ``DecoderLayer``, ``RNNBase``: each sets defaults that older
  versions lacked, and ``RNNBase`` reads its own weights back into a list); a fork's class with its own
  ``__setstate__`` or ``__new__`` is refused. A module's state is a dict whose entries become attributes, so
  the scan also refuses the two ways an attribute gets *called* later: a hook dict that is not empty (any key
  with ``hook`` in its name: ``_forward_hooks``, ``_backward_pre_hooks``, ...; they stay empty, even when the
  same dict is filled later through the pickle's memo), and a callable (a module, a looked-up method) set over
  an attribute the class defines (a method, or ``_compiled_call_impl``, which ``Module.__call__`` calls).
  What remains is a model's composition, which is what a model file is: its forward runs the tree's own code.
  ``DetectMultiBackend`` and ``AutoShape`` rebuilt this way hold no file or URL: only their constructors load
  one, and calling them is refused.
- ``builtins.getattr``: only ``getattr(<model class>, 'forward')`` (upstream's Segment, DSegment, DualDSegment and
  Panoptic keep ``self.detect = Detect.forward``), whose result is only stored as an attribute of a module
  (never called, passed or put in a container), and restricted again by the unpickler to a public function of
  the class.
- torch's tensor rebuilding: ``_rebuild_tensor_v2`` (a storage of this zip, offset, sizes, strides,
  requires_grad, backward hooks) and ``_rebuild_parameter``, only with those argument kinds, and with backward
  hooks that are empty and stay so (torch registers whatever that dict holds as hooks a backward pass calls).
  Storages come only from the zip's own records (``BINPERSID`` of a torch storage type). torch's other default
  globals (``_rebuild_from_type_v2``, which calls a function it is given; ``_rebuild_parameter_with_state``,
  which sets any attribute on a parameter; tensor and storage constructors, ``Counter``, ...) never occur in
  YOLOv9 checkpoints and are refused.
- plain data: ``OrderedDict()`` and ``set(list)`` (module internals), ``torch.Size`` of integers, torch dtypes as
  values (quantized checkpoints' modelopt state), ``_codecs.encode(str, 'latin1')`` (bytes: the codec is named
  in the table, as it imports a codec module by name), numpy's ``_reconstruct`` / ``scalar`` / ``dtype`` with
  exactly the argument kinds of an array or scalar built from bytes (``best_fitness``; numpy itself refuses an
  object array from bytes, and an object scalar: numpy 1 returned its bytes as they are), and pathlib paths of strings
  (``opt``): a path is built from its parts and nothing reads it (``PosixPath`` of another OS loads as its pure
  path: the full pickle fails on it).

Sizes, before and after the pickle: :func:`check_records` refuses a zip record stored compressed (torch.save never
compresses, and a compressed record of a few kilobytes can unpack to any size), so what torch.load reads never
exceeds the file; :func:`check_spans` refuses a loaded tensor that spans more elements than its storage holds (zero
strides state any shape over a few bytes), so every shape checked against the stored tensors later
(``utils.qat.model.bounds``) is backed by the file's own bytes.

Not covered here: a quantized checkpoint's model yaml, which ``checkpoint.load_quantized`` builds with
``parse_model`` after loading; ``yolov9.code_in_cfg`` checks it first, ``bounds.check_yaml_size`` its size.
"""
from __future__ import annotations

import _compat_pickle
import argparse
import os
import pathlib
import pickle
import struct
import sys
import types
from pathlib import Path
from typing import Any

from utils.qat.core.errors import QATError

#: Modules whose globals are never allowed: they run commands, open files or import code.
DENIED_MODULES = ("os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "importlib", "runpy", "pty",
                  "ctypes", "code", "codeop", "pickle", "_pickle", "marshal", "webbrowser", "multiprocessing",
                  "asyncio", "pdb", "io", "_io", "tempfile", "signal", "threading", "_thread")
#: Builtins that run, import or reach arbitrary code (``getattr`` is allowed only as the method lookup of :data:`USES`).
DENIED_BUILTINS = ("eval", "exec", "compile", "open", "getattr", "setattr", "delattr", "__import__", "globals",
                   "locals", "vars", "breakpoint", "input", "exit", "quit", "help", "memoryview", "type", "object")

TRUST_HINT = "if you trust the file, pass --trust-weights to load it with the full pickle"
_announced: set[str] = set()

# The families a global may belong to: its group in USES (any other global is its own group, by name).
MODEL, STORAGE, DTYPE, PATH = "model class", "torch storage type", "torch dtype", "pathlib path"

#: What genuine checkpoints do with each global they name: group -> uses. A use is the instruction and the kinds
#: of what it is given (``REDUCE(str...)``: called with one or more strings; ``model class()``: an object a model
#: class created; ``'latin1'``: that very string), or where the global is put (``argument of X``, ``dict value``).
#: Learned from real checkpoints: tests/test_safe_load.py regenerates it from every genuine kind and compares.
USES: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    MODEL: {"NEWOBJ()", "BUILD(dict)", "argument of builtins.getattr"},
    STORAGE: {"BINPERSID('storage', torch storage type, str, str, int)"},
    DTYPE: {"dict value"},
    PATH: {"REDUCE(str...)"},
    "builtins.getattr": {"REDUCE(model class, 'forward')"},
    "builtins.set": {"REDUCE(list)"},
    "collections.OrderedDict": {"REDUCE()"},
    "_codecs.encode": {"REDUCE(str, 'latin1')"},
    "numpy._core.multiarray._reconstruct": {"REDUCE(numpy.ndarray, (int...), _codecs.encode())",
                                            "BUILD((int, (int...), numpy.dtype(), bool, _codecs.encode()))"},
    "numpy._core.multiarray.scalar": {"REDUCE(numpy.dtype(), _codecs.encode())"},
    "numpy.dtype": {"REDUCE(str, bool, bool)", "BUILD((int, str, None, None, None, int, int, int))"},
    "numpy.ndarray": {"argument of numpy._core.multiarray._reconstruct"},
    "torch.Size": {"REDUCE(())", "REDUCE((int...))"},
    "torch._utils._rebuild_tensor_v2": {"REDUCE(storage, int, (), (), bool, collections.OrderedDict())",
                                        "REDUCE(storage, int, (int...), (int...), bool, collections.OrderedDict())"},
    "torch._utils._rebuild_parameter": {"REDUCE(torch._utils._rebuild_tensor_v2(), bool, "
                                        "collections.OrderedDict())"},
}.items()}

#: Argument positions whose strings are part of the use (the attribute getattr looks up, the codec encode imports,
#: the tag of a persistent id); any other string is just ``str``.
LITERALS = {"builtins.getattr": 1, "_codecs.encode": 1, "BINPERSID": 0}


def add_trust_flag(parser: argparse.ArgumentParser) -> None:
    """``--trust-weights``, for every command that reads a ``.pt`` (``args.trust_weights``: ``trust`` of :func:`load`)."""
    parser.add_argument("--trust-weights", action="store_true",
                        help="load a .pt that names code outside YOLOv9's model classes and torch (e.g. a fork's own "
                             "objects) with the full pickle, which runs whatever it names: only for files you trust "
                             "(without it such a file is refused before anything in it runs)")


def denied(name: str) -> bool:
    """True for a global (``module.name``) that can run code: :data:`DENIED_MODULES`, :data:`DENIED_BUILTINS`."""
    module, _, attr = name.rpartition(".")
    if module == "builtins":
        return attr in DENIED_BUILTINS
    return any(module == m or module.startswith(m + ".") for m in DENIED_MODULES)


def model_classes() -> set[type]:
    """The ``nn.Module`` classes defined in the tree's model modules (``models`` and every ``models.*`` that
    ``models.yolo`` imports) and in ``torch.nn.modules`` that unpickling rebuilds without running their own code:
    ``__new__`` is ``object.__new__`` and ``__setstate__`` is nn.Module's or one of torch.nn.modules' own."""
    import torch.nn as nn

    import models.yolo  # noqa: F401  (imports models.common, models.experimental and whatever a fork adds)
    found = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "models" or name.startswith(("models.", "torch.nn.modules."))):
            continue
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == name
                    and obj.__new__ is object.__new__
                    and obj.__setstate__.__module__.startswith("torch.nn.modules.")
                    and not denied(f"{obj.__module__}.{obj.__qualname__}")):
                found.add(obj)
    return found


def _numpy_globals() -> dict[str, Any]:
    """numpy arrays, scalars and dtypes as pickled by numpy 1 (``numpy.core``) and 2 (``numpy._core``)."""
    import numpy as np
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy < 2
        from numpy.core import multiarray  # type: ignore[no-redef]
    found: dict[str, Any] = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for f in ("_reconstruct", "scalar"):
        for m in ("numpy.core", "numpy._core"):
            found[f"{m}.multiarray.{f}"] = getattr(multiarray, f)
    return found


def _dtype_classes() -> list[tuple[type, str]]:
    """numpy's dtype classes: the types a dtype object has, which torch's unpickler checks before ``BUILD``."""
    import numpy as np
    dtypes = vars(getattr(np, "dtypes", types.SimpleNamespace())).values()
    return [(c, f"{c.__module__}.{c.__qualname__}") for c in dtypes if isinstance(c, type) and issubclass(c, np.dtype)]


def _path_globals() -> dict[str, Any]:
    """pathlib paths of upstream's ``opt``, as Python pickles them (``pathlib._local.PosixPath`` from 3.13 on). A
    path of the other OS loads as its pure path (the full pickle fails on it: ``cannot instantiate 'WindowsPath' on
    your system``)."""
    windows = os.name == "nt"
    paths = {"PosixPath": pathlib.PurePosixPath if windows else pathlib.PosixPath,
             "WindowsPath": pathlib.WindowsPath if windows else pathlib.PureWindowsPath,
             "PurePosixPath": pathlib.PurePosixPath, "PureWindowsPath": pathlib.PureWindowsPath}
    return {f"{module}.{name}": cls for name, cls in paths.items() for module in ("pathlib", "pathlib._local")}


def _method_of(classes: set[type]):
    def method_of(cls: Any, name: Any) -> Any:
        """``getattr`` as upstream checkpoints use it: a plain method of an allowed class, nothing else."""
        value = getattr(cls, name, None) if cls in classes and isinstance(name, str) and not name.startswith("_") \
            else None
        if not isinstance(value, types.FunctionType):
            raise pickle.UnpicklingError(f"GLOBAL builtins.getattr on {getattr(cls, '__name__', cls)!r}.{name}")
        return value
    return method_of


class Globals:
    """Every global a checkpoint may name: name -> (group in :data:`USES`, the object torch's unpickler gets)."""

    def __init__(self, classes: set[type] | None = None):
        import torch
        import torch._weights_only_unpickler as wo
        classes = model_classes() if classes is None else classes
        self.defaults = dict(wo._get_allowed_globals())  # torch's own, which need no allow-listing
        table: dict[str, tuple[str, Any]] = {}
        for name, obj in self.defaults.items():
            storage = isinstance(obj, torch.serialization.StorageType) or obj in (torch.TypedStorage,
                                                                                  torch.UntypedStorage)
            table[name] = (STORAGE if storage else DTYPE if isinstance(obj, torch.dtype) else name, obj)
        for name, obj in _numpy_globals().items():
            table[name] = (name.replace("numpy.core.", "numpy._core."), obj)
        table.update({name: (PATH, obj) for name, obj in _path_globals().items()})
        table.update({f"{c.__module__}.{c.__qualname__}": (MODEL, c) for c in classes})
        table["builtins.getattr"] = ("builtins.getattr", _method_of(classes))
        self.table = table

    def group(self, name: str) -> str | None:
        """The group of ``name`` in :data:`USES` (None: a global no checkpoint names)."""
        found = self.table.get(name)
        return found[0] if found else None

    def safe(self, names: set[str]) -> list[Any]:
        """What ``torch.serialization.safe_globals`` needs for a file naming ``names``: those outside torch's defaults,
        plus numpy's dtype classes where it names ``numpy.dtype``."""
        out: list[Any] = [(self.table[n][1], n) for n in sorted(names) if n not in self.defaults]
        if "numpy.dtype" in names:
            out += _dtype_classes()
        return out


class Refused(Exception):
    """What a pickle does that genuine checkpoints never do: ``action`` completes "it ..." in the sentence."""

    def __init__(self, action: str, unknown: str | None = None):
        super().__init__(action)
        self.action, self.unknown = action, unknown  # unknown: a global outside the table, by name


class Malformed(Exception):
    """A pickle that torch's unpickler would not read either, or that uses instructions torch.save never writes."""


# ---------------------------------------------------------------------------------------------- the scan
class _G:
    """A global on the stack."""
    __slots__ = ("name", "group")

    def __init__(self, name: str, group: str):
        self.name, self.group = name, group


class _V:
    """What an instruction made: a container (``items`` for dicts), or what a call of ``maker`` returned."""
    __slots__ = ("kind", "maker", "items", "frozen", "built", "is_state", "method", "cls")

    def __init__(self, kind: str, maker: _G | None = None, items: dict | None = None):
        self.kind, self.maker, self.items = kind, maker, items
        self.frozen = self.built = self.is_state = False  # frozen: hooks, to stay empty
        self.method: str | None = None  # a looked-up method: "models.yolo.Detect.forward"
        self.cls: type | None = None  # the class of a model object


_SCALARS = {int: "int", str: "str", float: "float", bool: "bool", type(None): "None"}


def _kind(v: Any) -> str:
    t = type(v)
    if t is _V:
        return v.kind
    if t is _G:
        return v.group
    if t is tuple:
        return _tuple_kind(v)
    return _SCALARS.get(t, t.__name__)


def _tuple_kind(t: tuple, literal: int | None = None, found: list | None = None) -> str:
    """``(int, str)``; ``(int...)`` for one or more of the same scalar kind (sizes, path parts); a string at
    ``literal`` as itself. ``found`` collects the globals and looked-up methods inside, at any depth."""
    kinds = []
    for i, v in enumerate(t):
        tv = type(v)
        if tv is int:
            kinds.append("int")
        elif tv is _V:
            kinds.append(v.kind)
            if v.method and found is not None:
                found.append(v)
        elif tv is tuple:
            kinds.append(_tuple_kind(v, None, found))
        elif tv is str:
            kinds.append(_literal(v) if i == literal else "str")
        elif tv is _G:
            kinds.append(v.group)
            if found is not None:
                found.append(v)
        else:
            kinds.append(_SCALARS.get(tv, tv.__name__))
    if kinds and (kinds[0] == "int" or kinds[0] == "str") and kinds.count(kinds[0]) == len(kinds):
        return f"({kinds[0]}...)"
    return "(" + ", ".join(kinds) + ")"


def _literal(s: str) -> str:
    return repr(s if len(s) <= 200 else s[:200] + "...")


def _describe(v: Any) -> str:
    """How a sentence names a stack item."""
    if type(v) is _G:
        return v.name
    if type(v) is _V:
        if v.method:
            return f"what builtins.getattr returned ({v.method})"
        if v.cls is not None:
            return f"a {v.maker.name} object"
        if v.kind == "collections.OrderedDict()":
            return "an OrderedDict"
        return f"what {v.maker.name} returned" if v.maker else f"a {v.kind}"
    return f"a {_kind(v)}"


def _globals_in(v: Any) -> list[_G]:
    if type(v) is _G:
        return [v]
    if type(v) is tuple:
        return [g for x in v for g in _globals_in(x)]
    return []


def _shown_args(t: tuple) -> str:
    """Arguments as a sentence shows them: globals by name, strings as themselves (shortened), others by kind."""
    parts = [v.name if type(v) is _G else _literal(v) if type(v) is str else
             _shown_args(v) if type(v) is tuple else _kind(v) for v in t]
    return "(" + ", ".join(parts) + ")"


def _callables_in(v: Any) -> list[_V]:
    """Looked-up methods in ``v`` (itself, or inside a tuple)."""
    if type(v) is _V and v.method:
        return [v]
    if type(v) is tuple:
        return [m for x in v for m in _callables_in(x)]
    return []


class Scan:
    """One symbolic run of a pickle. ``learn``: record every use instead of refusing those outside :data:`USES` (how
    the test regenerates the table)."""

    def __init__(self, names: Globals, learn: bool = False):
        self.globals, self.learn = names, learn
        self.uses: set[tuple[str, str]] = set()
        self.names: set[str] = set()
        self._methods: list[tuple[_V, _V]] = []  # (dict, looked-up method stored in it)

    def allowed(self, g: _G, use: str) -> bool:
        """Whether genuine checkpoints use ``g`` so (always, while learning: then it is recorded)."""
        if self.learn:
            self.uses.add((g.group, use))
            return True
        return use in USES.get(g.group, ())

    def _call(self, op: str, f: Any, args: Any) -> Any:
        if type(f) is not _G:
            raise Refused(f"calls {_describe(f)}")
        if type(args) is not tuple:
            raise Malformed(f"{op} with {_kind(args)} arguments")
        found: list = []
        use = op + _tuple_kind(args, LITERALS.get(f.group), found) if args else op + "()"
        if not self.allowed(f, use):
            shown = _shown_args(args)
            raise Refused(f"calls {f.name}{shown}" if op == "REDUCE" else
                          f"creates a {f.name} object" + (f" from {shown}" if args else ""))
        for x in found:
            if type(x) is not _G or not self.allowed(x, f"argument of {f.group}"):
                raise Refused(f"passes {_describe(x)} to {f.name}")
        for a in args:  # backward hooks of a rebuilt tensor (the only calls given an OrderedDict): empty for good
            if type(a) is _V and a.kind == "collections.OrderedDict()":
                if a.items:
                    raise Refused(f"passes a filled OrderedDict to {f.name} (a tensor's backward hooks)")
                a.frozen = True
        group = f.group
        if group == "collections.OrderedDict":
            return _V("collections.OrderedDict()", f, items={})
        made = _V(f"{group}()", f)
        if group == "builtins.getattr" and len(args) == 2 and type(args[0]) is _G:
            made.method = f"{args[0].name}.{args[1]}"
        elif group == MODEL:
            cls = self.globals.table.get(f.name)
            made.cls = cls[1] if cls else object
        return made

    def _build(self, inst: Any, state: Any) -> None:
        if type(inst) is not _V or inst.maker is None:
            raise Refused(f"sets the state of {_describe(inst)}")
        g = inst.maker
        if not self.allowed(g, ("BUILD again" if inst.built else "BUILD") + f"({_kind(state)})"):
            raise Refused(f"sets the state of {_describe(inst)}" + (" twice" if inst.built else
                                                                    f" from a {_kind(state)}"))
        inst.built = True
        for m in _callables_in(state):
            raise Refused(f"sets the state of {_describe(inst)} to {_describe(m)}")
        if g.group == MODEL and type(state) is _V and state.items is not None:
            self._module_state(inst, state)

    def _module_state(self, inst: _V, state: _V) -> None:
        """A module's state: hook dicts empty for good; no callable over an attribute the class defines."""
        state.is_state = True
        cls = inst.cls
        for key, value in state.items.items():
            if type(key) is str and "hook" in key:
                if value is None or type(value) is bool:
                    continue
                if type(value) is _V and value.items:
                    raise Refused(f"puts a hook in the {_literal(key)} of {_describe(inst)}")
                if type(value) is not _V or value.items is None:
                    raise Refused(f"sets the {_literal(key)} of {_describe(inst)} to {_describe(value)}")
                value.frozen = True
            elif type(value) is _V and (value.method or value.cls is not None) and type(key) is str \
                    and hasattr(cls, key):
                raise Refused(f"sets {_literal(key)} of {_describe(inst)}, which its class defines, to "
                              f"{_describe(value)}")

    def _store(self, target: Any, pairs: list, op: str) -> None:
        dict_like = type(target) is _V and target.items is not None
        if not (dict_like if op.startswith("SETITEM") else type(target) is _V and target.kind == "list"):
            raise Malformed(f"{op} on {_describe(target)}")
        if target.frozen and pairs:
            raise Refused(f"fills {_describe(target)}, which serves as hooks")
        place = "dict value" if dict_like else "list item"
        for key, value in pairs:
            for where, v in (("dict key", key), (place, value)):
                if type(v) is _G or type(v) is tuple:
                    for g in _globals_in(v):
                        if not self.allowed(g, where):
                            raise Refused(f"stores {g.name} as a {where}")
                    for m in _callables_in(v):
                        raise Refused(f"stores {_describe(m)} in a tuple")
                elif type(v) is _V and v.method:
                    if where != "dict value":
                        raise Refused(f"stores {_describe(v)} as a {where}")
                    self._methods.append((target, v))  # only as a module's attribute: checked at the end
            if dict_like:
                try:
                    target.items[key] = value
                except TypeError as e:
                    raise Malformed(f"{op} with an unhashable key") from e

    def _persistent(self, pid: Any) -> _V:
        found: list = []
        use = "BINPERSID" + (_tuple_kind(pid, LITERALS["BINPERSID"], found) if type(pid) is tuple else _kind(pid))
        if not found or any(type(x) is not _G or not self.allowed(x, use) for x in found):
            raise Refused(f"refers to a storage as {_shown_args(pid) if type(pid) is tuple else _kind(pid)}")
        return _V("storage")

    def finish(self) -> None:
        for d, m in self._methods:
            if not d.is_state:
                raise Refused(f"stores {_describe(m)} elsewhere than in a module's attributes")

    # -- the instructions (those of torch's weights-only unpickler, protocol 2; any other is Malformed)
    def run(self, data: bytes, pos: int = 0) -> int:
        """Scan the pickle at ``data[pos:]``; the position after its STOP."""
        unpack = struct.unpack_from
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        try:
            while True:
                op = data[pos]
                pos += 1
                if op == 0x72:  # LONG_BINPUT
                    memo[unpack("<I", data, pos)[0]] = stack[-1]
                    pos += 4
                elif op == 0x68:  # BINGET
                    stack.append(memo[data[pos]])
                    pos += 1
                elif op == 0x6a:  # LONG_BINGET
                    stack.append(memo[unpack("<I", data, pos)[0]])
                    pos += 4
                elif op == 0x71:  # BINPUT
                    memo[data[pos]] = stack[-1]
                    pos += 1
                elif op == 0x29:  # EMPTY_TUPLE
                    stack.append(())
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    stack[-1] = self._call("REDUCE", stack[-1], args)
                elif op == 0x4b:  # BININT1
                    stack.append(data[pos])
                    pos += 1
                elif op == 0x28:  # MARK
                    metastack.append(stack)
                    stack = []
                elif op == 0x7d:  # EMPTY_DICT
                    stack.append(_V("dict", items={}))
                elif op == 0x89 or op == 0x88:  # NEWFALSE, NEWTRUE
                    stack.append(op == 0x88)
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                elif op == 0x74:  # TUPLE
                    items = stack
                    stack = metastack.pop()
                    stack.append(tuple(items))
                elif op == 0x58:  # BINUNICODE
                    n = unpack("<I", data, pos)[0]
                    stack.append(str(data[pos + 4:pos + 4 + n], "utf-8", "surrogatepass"))
                    pos += 4 + n
                elif op == 0x75 or op == 0x65:  # SETITEMS, APPENDS
                    items = stack
                    stack = metastack.pop()
                    if op == 0x75:
                        if len(items) % 2:
                            raise Malformed("SETITEMS with an odd number of items")
                        self._store(stack[-1], list(zip(items[::2], items[1::2])), "SETITEMS")
                    else:
                        self._store(stack[-1], [(None, v) for v in items], "APPENDS")
                elif op == 0x73:  # SETITEM
                    value, key = stack.pop(), stack.pop()
                    self._store(stack[-1], [(key, value)], "SETITEM")
                elif op == 0x61:  # APPEND
                    value = stack.pop()
                    self._store(stack[-1], [(None, value)], "APPEND")
                elif op == 0x4e:  # NONE
                    stack.append(None)
                elif op == 0x86:  # TUPLE2
                    stack[-2:] = [(stack[-2], stack[-1])]
                elif op == 0x87:  # TUPLE3
                    stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
                elif op == 0x5d:  # EMPTY_LIST
                    stack.append(_V("list"))
                elif op == 0x4d:  # BININT2
                    stack.append(unpack("<H", data, pos)[0])
                    pos += 2
                elif op == 0x4a:  # BININT
                    stack.append(unpack("<i", data, pos)[0])
                    pos += 4
                elif op == 0x47:  # BINFLOAT
                    stack.append(unpack(">d", data, pos)[0])
                    pos += 8
                elif op == 0x51:  # BINPERSID
                    stack.append(self._persistent(stack.pop()))
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    stack.append(self._call("NEWOBJ", stack.pop(), args))
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    self._build(stack[-1], state)
                elif op == 0x63:  # GLOBAL
                    end = data.index(b"\n", pos)
                    end2 = data.index(b"\n", end + 1)
                    module, name = data[pos:end].decode("utf-8"), data[end + 1:end2].decode("utf-8")
                    pos = end2 + 1
                    stack.append(self._global(module, name))
                elif op == 0x8f:  # EMPTY_SET
                    stack.append(_V("set"))
                elif op == 0x55:  # SHORT_BINSTRING (torch.load decodes it as utf-8)
                    n = data[pos]
                    stack.append(data[pos + 1:pos + 1 + n].decode("utf-8"))
                    pos += 1 + n
                elif op == 0x8a:  # LONG1
                    n = data[pos]
                    stack.append(pickle.decode_long(data[pos + 1:pos + 1 + n]))
                    pos += 1 + n
                elif op == 0x80:  # PROTO
                    pos += 1
                elif op == 0x2e:  # STOP
                    root = stack.pop()
                    for g in _globals_in(root):
                        if not self.allowed(g, "the whole file"):
                            raise Refused(f"is {g.name} itself")
                    return pos
                else:
                    raise Malformed(f"opcode {bytes([op])!r} at byte {pos - 1}")
        except (IndexError, KeyError, ValueError, UnicodeDecodeError, struct.error) as e:
            raise Malformed(f"{type(e).__name__} at byte {pos}") from e

    def _global(self, module: str, name: str) -> _G:
        """As torch's unpickler reads a GLOBAL (Python 2 names mapped alike)."""
        from torch._utils import IMPORT_MAPPING, NAME_MAPPING
        raw_module, raw_name = module, name
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        full = f"{module}.{name}"
        group = self.globals.group(full)
        if group is None and self.learn and full.startswith("models."):
            group = MODEL  # a class of another tree (the table does not depend on the tree)
        if group is None or not self.learn and group not in USES:
            shown = _python_name(raw_module, raw_name)
            raise Refused(f"names {shown}", unknown=shown)
        self.names.add(full)
        return _G(full, group)


def _python_name(module: str, name: str) -> str:
    """What the full pickle imports for a GLOBAL (protocol 2 writes Python 2 names: ``subprocess`` as ``commands``)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    elif module in _compat_pickle.IMPORT_MAPPING:
        module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{module}.{name}"


def scan_pickle(data: bytes, names: Globals | None = None, learn: bool = False) -> Scan:
    """Scan the pickle ``data``; raises :class:`Refused` or :class:`Malformed`, else returns the scan (its
    ``names``; its ``uses`` when ``learn``)."""
    scan = Scan(names or Globals(), learn)
    scan.run(data)
    scan.finish()
    return scan


class Legacy(Exception):
    """A file in torch's pre-1.6 format: a pickle that names classes through persistent ids, which torch's
    restricted unpickler cannot read (the full pickle can)."""


def pickle_of(path: Path) -> bytes:
    """The bytes torch.load unpickles: the ``data.pkl`` record that torch's own zip reader returns (one zip may hold
    several, and readers disagree on which counts)."""
    import torch
    with open(path, "rb") as f:
        if not torch.serialization._is_zipfile(f):
            if f.read(1) == pickle.PROTO:
                raise Legacy()
            raise ValueError("not a zip file")
        return torch._C.PyTorchFileReader(f).get_record("data.pkl")


def scan(path: str | os.PathLike, learn: bool = False, names: Globals | None = None) -> Scan:
    """:func:`scan_pickle` of a checkpoint file."""
    return scan_pickle(pickle_of(Path(path)), names, learn)


def _shown(name: str) -> str:
    """A name from a file, safe in one line."""
    return ascii(name)[1:-1][:120]


def _refusal(path: Path, refused: Refused) -> QATError:
    name = refused.unknown
    if name is None:
        return QATError(f"{path} was not loaded: it {refused.action}, which YOLOv9 checkpoints never do; "
                        f"{TRUST_HINT}.")
    module, _, attr = name.rpartition(".")
    if module.startswith("models.") and not hasattr(sys.modules.get(module), attr):  # the full pickle fails too
        return QATError(f"{path} was not loaded: it names {_shown(name)}, which this YOLOv9 tree does not define; "
                        f"run the command in the YOLOv9 tree (version or fork) the checkpoint was made with.")
    why = "which runs code" if denied(name) else "which YOLOv9 checkpoints do not contain (unpickling it could run code)"
    return QATError(f"{path} was not loaded: it names {_shown(name)}, {why}; {TRUST_HINT}.")


def _full_pickle(path: Path) -> Any:
    import torch
    if str(path) not in _announced:
        _announced.add(str(path))
        print(f"notice: --trust-weights: loading {path} with the full pickle, which runs any code it names.")
    return torch.load(path, map_location="cpu", weights_only=False)


def check_records(path: Path) -> None:
    """Every record of the checkpoint's zip is stored as it is (torch.save never compresses): what torch.load reads
    can then never exceed the file's own size, where a compressed record of a few kilobytes could unpack to any."""
    import zipfile
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError):
        return  # not a zip: pickle_of says what it is
    packed = next((i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED), None)
    if packed is not None:
        raise QATError(f"{path} was not loaded: its record {packed} is compressed, which torch.save never does (it "
                       f"could unpack to more than the file holds); {TRUST_HINT}.")
    size = os.path.getsize(path)
    if sum(i.file_size for i in infos) > size:  # no reader gets them out, the full pickle's neither
        raise QATError(f"{path} was not loaded: its records add up to more bytes than the file has, so the file is "
                       f"damaged (or made to exhaust memory); copy or download it again.")


def tensors_in(obj: Any, seen: set[int] | None = None):
    """Every tensor of a loaded checkpoint: in its dicts, lists and tuples, and the parameters and buffers of its
    modules."""
    import torch
    import torch.nn as nn
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, nn.Module):
        yield from (t for m in obj.modules() for t in (*m._parameters.values(), *m._buffers.values())
                    if t is not None)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, seen)


def check_spans(path: Path, obj: Any) -> None:
    """No tensor of the loaded checkpoint spans more elements than its storage holds: a tensor of a few stored
    bytes may not state a shape of millions of elements through zero strides, since everything sized by it
    (a layer made to hold it, a copy) would take that memory."""
    for t in tensors_in(obj):
        held = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
        if t.numel() * t.element_size() > held:
            raise QATError(f"{path} was not loaded: it holds a tensor of shape {tuple(t.shape)} built from "
                           f"{max(held, 0)} stored bytes, which torch.save never writes; {TRUST_HINT}.")


def _restricted(path: Path) -> Any:
    import torch
    names = Globals()
    check_records(path)
    try:
        found = scan(path, names=names)
    except Refused as e:
        raise _refusal(path, e) from None
    except Malformed as e:
        raise QATError(f"{path} was not loaded: its pickle is not one torch.save writes ({e}); {TRUST_HINT}.") from None
    except Legacy:
        raise QATError(f"{path} was not loaded: it is in torch's format from before 1.6, whose models only the full "
                       f"pickle reads; {TRUST_HINT} (or save it again with a newer torch).") from None
    try:
        with torch.serialization.safe_globals(names.safe(found.names)):
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the second guard refused what the scan let through
        raise QATError(f"{path} was not loaded: it holds an object that YOLOv9 checkpoints do not contain; "
                       f"{TRUST_HINT}.") from e
    check_spans(path, loaded)
    return loaded


def load(path: str | os.PathLike, trust: bool = False) -> Any:
    """The object a ``.pt`` holds, read without running code unless ``trust``; a QATError for a file that names
    anything else, or uses what it names otherwise than checkpoints do, or that is no PyTorch checkpoint."""
    path = Path(path)
    try:
        return _full_pickle(path) if trust else _restricted(path)
    except QATError:
        raise
    except Exception as e:  # pickle, zip and torch errors all mean the same thing to the user
        if _truncated_zip(path):
            raise QATError(f"{path} was not loaded: it starts as a PyTorch checkpoint (a zip archive) but its archive "
                           f"is incomplete, so the file is damaged (an interrupted copy or download, a full disk "
                           f"while saving); copy or download it again.") from e
        raise QATError(f"{path} is not a PyTorch checkpoint ({type(e).__name__}); pass a YOLOv9 .pt file.") from e


def _truncated_zip(path: Path) -> bool:
    """``path`` begins as a zip archive (torch.save's format) that zipfile cannot open: cut short, or damaged."""
    import zipfile
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        return False
    return head == b"PK\x03\x04" and not zipfile.is_zipfile(path)
