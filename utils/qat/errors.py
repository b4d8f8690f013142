"""One user-facing failure type and the CLI wrapper that turns it into one sentence and exit code 2."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator


class QATError(Exception):
    """A problem the user can fix. The message is one sentence naming the problem and the fix."""


def secondary_rank() -> bool:
    """True in the processes of a torchrun launch other than rank 0 (read from torchrun's environment, so it
    holds before any process group exists). They print no error sentences, results or progress bars."""
    return (os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1")
            and os.environ.get("RANK", "0").strip() not in ("", "0"))


@contextlib.contextmanager
def _stdout_discarded(discard: bool) -> Iterator[None]:
    if not discard:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        yield


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; a QATError becomes ``error: <sentence>`` on stderr and exit status 2.

    In a torchrun launch only rank 0 speaks: the other ranks' standard output is discarded (rank 0 prints
    the results) and they print no error sentence: every rank runs the same checks on the same arguments,
    and what only rank 0 does (evaluating, writing) fails on rank 0, so they would repeat rank 0's line.
    They exit with the same status all the same (torchrun then ends the rest).
    """
    quiet = secondary_rank()
    try:
        with _stdout_discarded(quiet):
            main()
    except QATError as e:
        if not quiet:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if not quiet:
            print("error: interrupted; files already written are complete, nothing half-written was kept.",
                  file=sys.stderr)
        sys.exit(130)
