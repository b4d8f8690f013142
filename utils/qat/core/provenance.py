"""Where a result came from: the sha256 of the weights it was made from or scored, the toolkit's version and, when
the toolkit was installed from a git clone, its commit.

    record("yolov9-c-converted.pt")  # {"weights": ..., "weights_sha256": ..., "toolkit_version": ..., "toolkit_commit": ...}

The commit comes from the YOLOv9 tree's ``.yolov9-qat-manifest``: patch_yolov9.sh, run from a clone, writes the
version of each file it installs as ``0.1.0+g<commit>`` (``.dirty`` added when the clone had uncommitted changes
to overlay files). Asking git in the tree would name upstream YOLOv9's commit, not the toolkit's. Without a
manifest, or installed from a copy without git, the commit is None.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
from pathlib import Path

from utils.qat import __version__

#: The YOLOv9 tree this package was installed into (utils/qat/ inside it) and the patcher's record there.
TREE = Path(__file__).resolve().parents[__name__.count(".")]  # the YOLOv9 tree (utils/qat/core/ inside it)
MANIFEST = ".yolov9-qat-manifest"
#: The manifest line whose version names the toolkit's commit: the file that holds ``__version__``.
VERSION_FILE = "utils/qat/__init__.py"
_LABEL = re.compile(r"\+g([0-9a-f]{7,40})(\.dirty)?$")


def sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """The sha256 of a file, read in chunks (a checkpoint can be hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def commit_of_label(version: str) -> str | None:
    """The commit in a manifest version ``0.1.0+g<commit>[.dirty]`` (``<commit>-dirty`` for a clone with
    uncommitted changes, as ``git describe --dirty`` says); None for a plain version."""
    m = _LABEL.search(version)
    if m is None:
        return None
    return m[1] + ("-dirty" if m[2] else "")


@functools.lru_cache(maxsize=None)
def toolkit_commit(tree: Path = TREE) -> str | None:
    """The toolkit commit that patch_yolov9.sh recorded in ``tree``'s manifest; None when it recorded none."""
    try:
        lines = (tree / MANIFEST).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines[1:]:
        fields = line.split("\t")
        if len(fields) == 3 and fields[0] == VERSION_FILE:
            return commit_of_label(fields[2])
    return None


def record(weights: str | os.PathLike | None = None) -> dict:
    """Provenance fields for report.json, checkpoints and results: the weights file and its sha256 (when given),
    the toolkit's version and commit (None when unknown)."""
    out: dict = {}
    if weights is not None:
        out.update(weights=str(weights), weights_sha256=sha256(weights))
    return {**out, "toolkit_version": __version__, "toolkit_commit": toolkit_commit()}
