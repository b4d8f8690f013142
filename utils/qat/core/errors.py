"""One user-facing failure type, the files this process saved (what a failure reports), and the CLI wrapper that
turns a failure into one sentence and exit code 2, and ends a run stopped by Ctrl-C, SIGTERM or SIGHUP with one line
saying what was saved."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


class QATError(Exception):
    """A problem the user can fix. The message is one sentence naming the problem and the fix.

    ``every_rank`` (torchrun launches): None while it was raised outside any process group (by the checks
    every process makes alike on the same arguments), True when the ranks agreed on it
    (``distributed.same_on_every_rank``), False when this rank alone raised it inside the process group."""
    every_rank: bool | None = None


_saved: dict[str, None] = {}  # files this process completed, in order (utils.qat.core.atomic records each)


def record_saved(path: str | os.PathLike) -> None:
    _saved[str(path)] = None


def saved_summary() -> str:
    """``saved in FOLDER: a, b/c`` for the files this process completed (that still exist), or ``nothing was
    saved``; paths inside the current folder are shown relative to it."""
    paths = [p for p in _saved if os.path.exists(p)]
    if not paths:
        return "nothing was saved"
    base = Path(os.path.commonpath(paths))
    if len(paths) == 1:
        base = base.parent
    try:
        shown = base.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        shown = base
    return f"saved in {shown}: " + ", ".join(os.path.relpath(p, base) for p in paths)


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


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (schedulers, ``docker stop``, a closed SSH session), raised in the main thread like Ctrl-C's
    KeyboardInterrupt, so that ``finally`` blocks and atomic writes unwind the same way; a KeyboardInterrupt, so
    that code that cleans up after Ctrl-C (torch's, upstream's) treats it alike."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: The signals that end a run like Ctrl-C (exit status 128 + the signal's number).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _race_notice_dropped(unraisable: sys.UnraisableHookArgs) -> None:
    """``sys.unraisablehook`` once a stop has begun: CPython reports a signal that reached its C handler just
    before the switch to SIG_IGN as "OSError: Signal 15 ignored due to race condition" (not raised, printed);
    that signal was meant to be ignored, so the notice is dropped and anything else reported as before."""
    exc = unraisable.exc_value
    if isinstance(exc, OSError) and str(exc).endswith("ignored due to race condition"):
        return
    _previous_unraisablehook(unraisable)


_previous_unraisablehook = sys.unraisablehook


class _Stop:
    """The first stop signal this process received (None before)."""
    signum: int | None = None

    def __init__(self) -> None:
        self.pid = os.getpid()

    def handler(self, signum: int, _frame: object) -> None:
        if os.getpid() != self.pid:
            # a forked child (a DataLoader worker, a multiprocessing pool's worker, which the pool ends with
            # SIGTERM): it behaves as without this handler, so it ends without a traceback and unwinds nothing
            if signum == signal.SIGINT:
                raise KeyboardInterrupt()  # Python's own; torch's worker loop ends quietly on it
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.signum is not None:
            return  # a second signal that was already on its way
        self.signum = signum
        global _previous_unraisablehook
        _previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, _race_notice_dropped
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            # from now until the process has ended: a second signal (torchrun sends SIGTERM to every rank once one
            # has failed; a second Ctrl-C) would cut the cleanup or the interpreter's exit short, and lose the line
            # saying what was saved or end by the signal instead of the status. SIGKILL still ends it. SIG_IGN, not
            # a Python handler that does nothing: the interpreter puts SIG_DFL back for its own handlers as it
            # finalizes, and torchrun's SIGTERM landing then (a rank slower to exit than rank 0) would end the
            # process by the signal
            signal.signal(sig, signal.SIG_IGN)
        # torch's SIGCHLD handler reports a DataLoader worker ended by the same signal as a failure, with a
        # traceback even at exit; the run is ending anyway, and its workers with it
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        raise KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


@contextlib.contextmanager
def _stop_signals() -> Iterator[_Stop]:
    """SIGTERM, SIGHUP (and Ctrl-C, where Python's own handler is in place) raise once in the main thread; from
    then on all three are ignored, as the process is ending. A signal the process was started with ignored
    (``nohup`` ignores SIGHUP) stays ignored; without a stop the previous handlers come back afterwards."""
    stop = _Stop()
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield stop
        return
    previous = {}
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        untouched = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        if signal.getsignal(sig) == untouched:
            previous[sig] = signal.signal(sig, stop.handler)
    try:
        yield stop
    finally:
        if stop.signum is None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _run(main: Callable[[], object], quiet: bool) -> BaseException | None:
    """What ``main`` raised (None when it returned)."""
    try:
        with _stdout_discarded(quiet):
            main()
    except BaseException as e:  # noqa: BLE001 (sorted out by run_cli, which re-raises what it does not handle)
        return e
    return None


def run_cli(main: Callable[[], object]) -> None:
    """Run ``main``; a QATError becomes ``error: <sentence>`` on stderr and exit status 2.

    In a torchrun launch only rank 0 prints results: the other ranks' standard output is discarded. An
    error every rank meets (``QATError.every_rank`` not False) is printed by rank 0 alone; the other ranks
    exit quietly with status 0, so that torchrun waits for rank 0 (a failing exit would make torchrun end
    rank 0, perhaps before it printed), and the launch still fails with rank 0's status. An error of one rank
    alone is printed by that rank, whose exit then ends the others.

    Ctrl-C, SIGTERM and SIGHUP end the run alike (``_stop_signals``): one line, ``error: interrupted; ...`` or
    ``error: stopped by SIGTERM; ...``, saying what was saved, and exit status 128 + the signal's number; under
    torchrun, which forwards the signal to every process, rank 0 alone prints it.
    """
    quiet = secondary_rank()
    with _stop_signals() as stop:
        try:
            error = _run(main, quiet)
        except KeyboardInterrupt as e:  # a signal that landed while _run was returning
            error = e
        if stop.signum is not None or isinstance(error, KeyboardInterrupt):
            # whatever surfaced after a stop signal is its consequence (a DataLoader worker ended by the same
            # signal, a peer rank gone from a collective): the run was stopped, and says so once
            signum = stop.signum or signal.SIGINT
            if not quiet:
                how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
                print(f"error: {how}; {saved_summary()} (each file complete; nothing half-written was kept).",
                      file=sys.stderr)
            sys.exit(128 + signum)
    if isinstance(error, QATError):
        if quiet and error.every_rank is not False:
            sys.exit(0)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    if error is not None:
        raise error
