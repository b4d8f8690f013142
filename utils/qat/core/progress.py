"""Progress for long work, one style across the toolkit: a tqdm bar on a terminal, one line per stage
in a log (CI, ``| tee``, nohup), where redrawn bars would print a line per update."""
from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm

from utils.qat.core.errors import secondary_rank


def progress(iterable=None, **kwargs):
    """A tqdm bar on stderr when stderr is a terminal; otherwise a :class:`StageLine` that writes one line
    when the stage ends. Nothing with YOLOV9_QAT_QUIET=1 and on the ranks other than 0 of a multi-GPU run."""
    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("disable", os.environ.get("YOLOV9_QAT_QUIET") == "1" or secondary_rank())
    if not kwargs["disable"] and not _is_terminal(kwargs["file"]):
        return StageLine(iterable, desc=kwargs.get("desc"), total=kwargs.get("total"), file=kwargs["file"])
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)


def note(line: str, file=None) -> None:
    """One line of progress news (on stderr, as the bars): nothing where ``progress`` draws nothing."""
    if os.environ.get("YOLOV9_QAT_QUIET") == "1" or secondary_rank():
        return
    print(line, file=file or sys.stderr, flush=True)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class StageLine:
    """Iterates like tqdm and writes ``desc: n/total in S s, postfix`` once the stage ends (its items run
    out, or the loop leaves after ``total`` items), or ``desc: stopped at n/total after S s`` when the
    loop was left early (an error, Ctrl-C)."""

    def __init__(self, iterable, desc: str | None = None, total: int | None = None, file=None):
        self.iterable, self.desc, self.file = iterable, desc or "progress", file or sys.stderr
        self.total = total if total is not None else _len(iterable)
        self.n, self.postfix, self._written = 0, "", False

    def __len__(self) -> int:
        return self.total if self.total is not None else len(self.iterable)

    def __iter__(self):
        start, exhausted = time.time(), False
        try:
            for item in self.iterable:
                self.n += 1
                yield item
            exhausted = True
        finally:
            self._write(time.time() - start, exhausted)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or self.desc

    def update(self, n: int = 1) -> None:
        self.n += n

    def close(self) -> None:
        pass

    def _write(self, seconds: float, exhausted: bool) -> None:
        if self._written:
            return
        self._written = True
        total = self.total
        done = exhausted or (total is not None and self.n >= total)
        count = f"{min(self.n, total)}/{total}" if total is not None else str(self.n)
        if done:
            line = f"{self.desc}: {count} in {seconds:.1f} s"
        else:
            line = f"{self.desc}: stopped at {self.n}/{total if total is not None else '?'} after {seconds:.1f} s"
        if self.postfix:
            line += f", {self.postfix}"
        print(line, file=self.file, flush=True)


def _len(iterable) -> int | None:
    try:
        return len(iterable)
    except TypeError:
        return None
