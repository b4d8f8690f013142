"""One user-facing failure type and the CLI wrapper that turns it into one sentence and exit code 2."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator


class QATError(Exception):
    """A problem the user can fix. The message is one sentence naming the problem and the fix.

    ``every_rank`` (torchrun launches): None while it was raised outside any process group (by the checks
    every process makes alike on the same arguments), True when the ranks agreed on it
    (``distributed.same_on_every_rank``), False when this rank alone raised it inside the process group."""
    every_rank: bool | None = None


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

    In a torchrun launch only rank 0 prints results: the other ranks' standard output is discarded. An
    error every rank meets (``QATError.every_rank`` not False) is printed by rank 0 alone; the other ranks
    exit quietly with status 0, so that torchrun waits for rank 0 (a failing exit would make torchrun end
    rank 0, perhaps before it printed), and the launch still fails with rank 0's status. An error of one rank
    alone is printed by that rank, whose exit then ends the others.
    """
    quiet = secondary_rank()
    try:
        with _stdout_discarded(quiet):
            main()
    except QATError as e:
        if quiet and e.every_rank is not False:
            sys.exit(0)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if not quiet:
            from utils.qat.atomic import saved_summary
            print(f"error: interrupted; {saved_summary()} (each file complete; nothing half-written was kept).",
                  file=sys.stderr)
        sys.exit(130)
