"""The one OpenVINO ``Core`` of the process, for every graph OpenVINO compiles here.

OpenVINO's CPU plugin (2026.4.1), when a Core loads it, gives the calling thread an alternate signal stack of its
own, and puts back the one it found when that Core is destroyed. Two Cores destroyed in the order they were made
(the first before the second) leave the thread's alternate stack on the first one's freed memory. The next signal
caught by a Python handler then kills the process with SIGSEGV and no traceback: CPython installs its handlers with
SA_ONSTACK, and torch's DataLoader adds one for SIGCHLD, so the next child process to exit is enough. A pytest
worker that had scored graphs with OpenVINO died so when the cpu_deploy benchmark it ran as a subprocess exited.
One Core, kept until the process exits, never puts a stack back out of order.
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def shared_core():
    """The process's ``openvino.Core`` (made on first use; ``openvino`` must be importable)."""
    import openvino
    return openvino.Core()
