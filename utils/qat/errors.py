"""One user-facing failure type and the CLI wrapper that turns it into one sentence and exit code 2."""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator


class QATError(Exception):
    """A problem the user can fix. The message is one sentence naming the problem and the fix."""


# How long a rank other than 0 waits before printing its error (see run_cli).
SECONDARY_GRACE_S = 5.0


def secondary_rank() -> bool:
    """True in the processes of a torchrun launch other than rank 0 (read from torchrun's environment, so it
    holds before any process group exists). They print no results or progress bars (run_cli, progress)."""
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

    In a torchrun launch only rank 0 prints results: the other ranks' standard output is discarded. Their
    errors wait ``SECONDARY_GRACE_S`` first: an error every rank meets (the same checks on the same
    arguments) is then printed by rank 0, and torchrun, seeing rank 0 exit, ends the others before they
    repeat it (without the wait, a rank that exits first gets rank 0 killed before it prints); an error of
    one rank alone (rank 0 still at work) is printed after the wait.
    """
    quiet = secondary_rank()
    try:
        with _stdout_discarded(quiet):
            main()
    except QATError as e:
        if quiet:
            time.sleep(SECONDARY_GRACE_S)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if not quiet:
            from utils.qat.atomic import saved_summary
            print(f"error: interrupted; {saved_summary()} (each file complete; nothing half-written was kept).",
                  file=sys.stderr)
        sys.exit(130)
