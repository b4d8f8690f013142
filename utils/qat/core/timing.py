"""Where a run's time goes: the wall seconds of each stage of this process, for report.json (``stages``) and the table
``qat.py quantize`` prints at its end.

    timing.begin()                           # main() starts: the seconds since the process started are "start-up"
    with timing.timed("calibration"):        # a stage
        with timing.timed("amax search"):    # a stage inside another is taken out of it
            ...
    timing.add("training epoch 1", seconds)  # a stage measured by its own code, taken out of the stage around it
    timing.record()                          # {"seconds": {"start-up": 3.1, "calibration": 9.0, ...}, "total": 95.2}

Stages never overlap: each counts its own seconds, less those of the stages inside it, so that they add up to at most
``total``, the process's age (what no stage holds is ``other`` in the table). A stage that comes again under the same
name adds up (the budget's calibrations).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

_seconds: dict[str, float] = {}  # each stage's own seconds, in the order the stages first started
_inner: list[float] = []  # per open stage, innermost last: the seconds of the stages inside it so far
_IMPORTED = time.time()
_start = _IMPORTED  # where the record starts: the process's start once begin() ran
_began = False


def _process_start() -> float:
    """When this process started (the interpreter's start-up and imports before ``main`` included); without psutil,
    when this module was imported."""
    try:
        import psutil
        return psutil.Process().create_time()
    except Exception:  # no psutil, or a platform it cannot read
        return _IMPORTED


def begin() -> None:
    """A command starts: forget any earlier record (a test's earlier command in the same process); the first command
    of the process counts ``start-up`` from the process's start, a later one starts its record now."""
    global _start, _began
    _seconds.clear()
    _inner.clear()
    now = time.time()
    _start = now if _began else min(_process_start(), now)
    if not _began:
        _seconds["start-up"] = now - _start
    _began = True


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Count the block's wall seconds as stage ``name``, less those of the stages timed inside it."""
    began = time.time()
    _seconds.setdefault(name, 0.0)  # listed where it starts, before the stages inside it
    _inner.append(0.0)
    try:
        yield
    finally:
        inside = _inner.pop()
        add(name, time.time() - began - inside)
        if _inner:
            _inner[-1] += inside  # the enclosing stage loses this one's whole time, the stages inside it included


def add(name: str, seconds: float) -> None:
    """Count ``seconds`` measured elsewhere as stage ``name``, taken out of the stage open around it."""
    _seconds[name] = _seconds.get(name, 0.0) + max(seconds, 0.0)
    if _inner:
        _inner[-1] += max(seconds, 0.0)


def record() -> dict:
    """``{"seconds": {stage: seconds}, "total": seconds}``, to the hundredth: the stages in the order they first
    started, and the seconds since the record began (the process's start where ``begin`` was called first)."""
    return {"seconds": {k: round(v, 2) for k, v in _seconds.items()}, "total": round(time.time() - _start, 2)}


def table(rec: dict) -> str:
    """A :func:`record` as the markdown table ``quantize`` prints: each stage's seconds and share of the total, then
    ``other`` (what no stage holds) and the total."""
    total = rec["total"]
    rows = [*rec["seconds"].items(), ("other", max(total - sum(rec["seconds"].values()), 0.0)), ("total", total)]
    lines = ["| stage | seconds | share |", "|---|---|---|"]
    lines += [f"| {name} | {s:.1f} | {s / total if total > 0 else 0:.0%} |" for name, s in rows]
    return "\n".join(lines)

