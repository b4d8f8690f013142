"""The command and the paths a result set records, as anyone can run them: never this machine's own paths.

A path under one of the folders a benchmark knows is written from that folder's name (benchmarks/results/README.md
lists them): ``$REPO`` (this checkout), ``$YOLOV9_DIR`` (the YOLOv9 tree a command runs in), ``$SHARED`` (the
shared data and weights: ``YOLOV9_QAT_SHARED``, default ``../shared`` beside the repository), ``$WORK`` (the run's
own scratch folder), ``$SITE_PACKAGES`` (this Python's packages), ``$TMPDIR`` (the temporary folder) and ``~`` (the
home folder). The longest folder wins, so a tree copied into the scratch folder is ``$YOLOV9_DIR``, not ``$WORK``.

    command()                      # 'python3 $REPO/benchmarks/peers.py --weights $SHARED/weights/yolov9-t-coco.pt ...'
    text(log_text, work=out)       # the same rewriting for any text: a log, a report, a JSON document
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_ANSI_END = re.compile(r"\x1b\[[0-9;]*m$")  # a terminal colour code just before a path (upstream's log lines)


def shared() -> Path:
    """The shared folder (datasets/, weights/), as the tests and benchmarks find it."""
    return Path(os.environ.get("YOLOV9_QAT_SHARED", REPO.parent / "shared"))


Folder = str | os.PathLike | None


def roots(work: Folder = None, tree: Folder | list[Folder] = None) -> list[tuple[str, str]]:
    """(absolute folder, its placeholder), longest folder first; each folder both as given and resolved.
    ``tree``: the YOLOv9 tree, or several (a tree and its patched copy) (default: the current folder, where a
    benchmark runs, if it holds models/yolo.py)."""
    if tree is None and Path("models/yolo.py").is_file():
        tree = Path.cwd()
    trees = tree if isinstance(tree, (list, tuple)) else [tree]
    named = [(REPO, "$REPO"), (shared(), "$SHARED"), *((t, "$YOLOV9_DIR") for t in trees), (work, "$WORK"),
             (sysconfig.get_paths()["purelib"], "$SITE_PACKAGES"), (tempfile.gettempdir(), "$TMPDIR"),
             (Path.home(), "~")]
    pairs: dict[str, str] = {}
    for folder, name in named:
        if folder is None:
            continue
        for form in (os.path.abspath(folder), os.path.realpath(folder)):
            if form != os.sep:
                pairs.setdefault(form.rstrip(os.sep), name)
    return sorted(pairs.items(), key=lambda p: -len(p[0]))


def text(s: str, work: Folder = None, tree: Folder | list[Folder] = None) -> str:
    """``s`` with every path under a known folder written from that folder's placeholder."""
    for folder, name in roots(work, tree):
        s = _replace(s, folder, name)
    return s


def _replace(s: str, folder: str, name: str) -> str:
    """Each ``folder`` in ``s`` that is a whole path component (``/tmp`` in ``/tmp/x``, not in ``/tmpx``)."""
    out, i = [], 0
    while (j := s.find(folder, i)) >= 0:
        end = j + len(folder)
        before = s[j - 1] if j else ""
        starts = not (before.isalnum() or before in "._-/$~") or bool(_ANSI_END.search(s, max(0, j - 12), j))
        whole = starts and (end == len(s) or s[end] in "/\"' `,;:.|)]}\n\t\x1b")
        out.append(s[i:j] + (name if whole else folder))
        i = end
    return "".join(out) + s[i:]


def command(argv: list[str] | None = None, work: Folder = None, tree: Folder | list[Folder] = None) -> str:
    """The command line that made a result, run by ``python3``, its paths rewritten: ``argv`` (an interpreter
    first is dropped), or this process's own (its script made absolute, so that it names ``$REPO``)."""
    if argv is None:
        argv = [os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    elif argv and Path(argv[0]).name.startswith("python"):
        argv = argv[1:]
    return text(shlex.join(["python3", *argv]), work, tree)
