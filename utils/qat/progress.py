"""Progress bars for long work (tqdm), one style across the toolkit."""
from __future__ import annotations

import os
import sys

from tqdm import tqdm

from utils.qat.errors import secondary_rank


def progress(iterable=None, **kwargs):
    """A tqdm bar on stderr; plain (no redraws) when stderr is not a terminal, off with YOLOV9_QAT_QUIET=1
    and on the ranks other than 0 of a multi-GPU run."""
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("disable", os.environ.get("YOLOV9_QAT_QUIET") == "1" or secondary_rank())
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 5.0)
    return tqdm(iterable, **kwargs)
