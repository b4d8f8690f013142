"""Upstream's label caches read as data: ``labels.cache`` files are pickles, and a pickle may run code.

Upstream's dataset reads ``<labels>.cache`` with ``np.load(..., allow_pickle=True)``, so a dataset folder handed
to the toolkit (a download, a colleague's share) could run any code through that file. :func:`load` reads the same
files with an unpickler that knows only what ``np.save`` of upstream's cache dict writes (numpy arrays and scalars
of plain dtypes inside plain containers); anything else is refused, and upstream then scans the labels again and
writes a fresh cache, as it does for a cache of another version. :func:`guarded` gives upstream's dataloaders
module this reader for the time a dataset is built.
"""
from __future__ import annotations

import contextlib
import io
import pickle
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np

#: What np.save's pickle of a dict of arrays, tuples, lists and strings names (numpy 1 and 2 spellings).
ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
           ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
           ("numpy", "ndarray"), ("numpy", "dtype")}


class RefusedCache(Exception):
    """A cache that names anything else than plain arrays."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in ALLOWED:
            raise RefusedCache(f"{module}.{name}")
        return super().find_class(module, name)


def _plain(obj) -> None:
    """Refuse object arrays whose items are not plain data (an object array's items come from the pickle too, so
    they were already limited to :data:`ALLOWED`; a dtype that is not a plain number, string or object is not)."""
    if isinstance(obj, np.ndarray) and obj.dtype.kind not in "biufcUSO":
        raise RefusedCache(f"an array of dtype {obj.dtype}")


def load(path: str | Path, allow_pickle: bool = False, **_ignored):
    """``np.load`` of an upstream label cache (a ``.npy`` of one pickled dict), without running anything in it."""
    data = Path(path).read_bytes()
    f = io.BytesIO(data)
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _fortran, dtype = read_header(f)
    if dtype != np.dtype(object) or shape != ():
        raise RefusedCache(f"an array of {dtype} {shape}, not a cache dict")
    obj = _Unpickler(f).load()
    _plain(obj)
    return obj


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Upstream's dataloaders module reads label caches with :func:`load` while the ``with`` block runs (a dataset
    is built); its name ``np`` is numpy again afterwards."""
    import utils.dataloaders as upstream
    saved = upstream.np
    proxy = types.ModuleType("numpy")
    proxy.__dict__.update(vars(np))
    proxy.load = _load_cache_or_array  # type: ignore[attr-defined]
    upstream.np = proxy
    try:
        yield
    finally:
        upstream.np = saved


def _load_cache_or_array(file, *args, allow_pickle: bool = False, **kwargs):
    """What upstream's ``np.load`` becomes: a pickled label cache through :func:`load` (a refused one raises, and
    upstream scans the labels again), any other file as numpy reads it, never with pickles."""
    if allow_pickle:
        try:
            return load(file)
        except RefusedCache as e:
            print(f"notice: {file} was not read: a label cache holds plain arrays, this one names {e}; scanning the "
                  f"labels again.")
            raise
    return np.load(file, *args, allow_pickle=False, **kwargs)
