"""Faults during `qat.py quantize` leave complete, consistent files: Ctrl-C (SIGINT to the process group, as a
terminal sends it) and SIGKILL during calibration, during fine-tuning and while a checkpoint is written, SIGTERM
and SIGHUP (schedulers, docker stop, a closed SSH session) during calibration and fine-tuning, in one process and
under torchrun, and a full disk. After each: every file on disk is complete and loads, report.json agrees with
the checkpoints present, Ctrl-C, SIGTERM and SIGHUP end with one line saying what was saved (rank 0's alone) and
status 128 + the signal's number, and the same command with --exist-ok works. A run started with SIGHUP ignored
(``nohup``) runs on through one; every other run starts with the default dispositions, whatever the suite was
started with.

The process is stopped at each point by tests/faults/sitecustomize.py (on PYTHONPATH of the run only): a real
run that waits at a real point of its work until the signal comes.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from conftest import REPO

QS = REPO / "weights" / "gelan-qs-shapes.pt"
HOOKS = REPO / "tests" / "faults"
STAGES = ("calibration", "finetune", "checkpoint")


def _command(shapes: Path, project: Path, name: str, workers: int = 0) -> list[str]:
    return [sys.executable, "qat.py", "quantize", "--weights", str(QS), "--data", str(shapes), "--device", "cpu",
            "--imgsz", "64", "--batch-size", "8", "--workers", str(workers), "--calib-batches", "1",
            "--calib-method", "max", "--epochs", "1", "--iters", "2", "--project", str(project), "--name", name,
            "--exist-ok"]


def _env(**extra: str) -> dict:
    path = os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def _group_gone(pgid: int, seconds: float) -> bool:
    """True once no process of the group is left (the run's dataloader workers included)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def _default_signals(ignored: tuple[signal.Signals, ...] = ()) -> None:
    """In the child: SIGINT, SIGTERM and SIGHUP back to their defaults (``ignored``: ignored instead), whatever the
    suite itself was started with: a background job of a non-interactive shell (``.ci/run &``) ignores SIGINT,
    ``nohup`` (as many CI runners and remote sessions start jobs) SIGHUP, and a run keeps a signal it was started
    with ignored ignored, as it should; the tests say which disposition each run starts with."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")


def _ranks(launcher: int) -> list[int]:
    """The processes of torchrun's ranks, rank 0 first: its children that lead their own session (torchrun starts
    each rank so, and ends it by signalling that session), read from /proc."""
    children = [int(c) for t in Path(f"/proc/{launcher}/task").iterdir() for c in (t / "children").read_text().split()]
    ranks = {}
    for pid in children:
        with contextlib.suppress(OSError):
            env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
            if os.getsid(pid) == pid and "RANK" in env:
                ranks[int(env["RANK"])] = pid
    return [ranks[r] for r in sorted(ranks)]


def _interrupted_runs(tree: Path, shapes: Path, project: Path, cases: list[tuple[str, signal.Signals]],
                      workers: int = 0, ddp: bool = False) -> dict:
    """One run per (stage, signal) case, side by side (one thread each), each stopped at its stage and sent its
    signal. ``ddp``: 2 processes under torchrun (gloo), each rank's stderr in its own file; the signal goes to
    each rank's session, rank 0 first, as torchrun forwards a signal it receives. Returns (stage, signal) ->
    (run folder, exit status, stderr, [each rank's stderr]). Output goes to files: a pipe would also wait for any
    process the run left behind."""
    procs = {}
    for stage, sig in cases:
        name = f"{stage}-{sig.name}"
        mark, log, logs = project / f"{name}.mark", project / f"{name}.stderr", project / f"{name}-ranks"
        command = _command(shapes, project, name, workers)
        if ddp:
            command = [command[0], *TORCHRUN, "--log-dir", str(logs), "--redirects", "3", *command[1:]]
        with open(log, "w") as err:
            procs[stage, sig] = (name, mark, log, subprocess.Popen(
                command, cwd=tree, start_new_session=True, preexec_fn=_default_signals, stdout=subprocess.DEVNULL,
                stderr=err, env=_env(YOLOV9_QAT_TEST_PAUSE=stage, YOLOV9_QAT_TEST_MARK=str(mark), OMP_NUM_THREADS="1")))
    results = {}
    try:
        for (stage, sig), (name, mark, log, proc) in procs.items():
            deadline = time.time() + 300
            while not mark.exists():
                assert proc.poll() is None, f"{name}: exited {proc.returncode} before its stop: {log.read_text()}"
                assert time.time() < deadline, f"{name}: never reached its stop"
                time.sleep(0.2)
            groups = _ranks(proc.pid) if ddp else [proc.pid]
            assert len(groups) == (2 if ddp else 1), groups
            for pgid in groups:  # each whole group: the dataloader workers too, as a terminal's Ctrl-C does
                os.killpg(pgid, sig)
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                for pid in groups:
                    os.kill(pid, signal.SIGUSR1)  # its threads' stacks, to its stderr
                time.sleep(3)
                pytest.fail(f"{name}: still running 300 s after {sig.name}: {log.read_text()[-8000:]}")
            for pgid in [proc.pid, *groups]:
                assert _group_gone(pgid, 60), f"{name}: processes left behind after {sig.name}"
            ranks = [next((project / f"{name}-ranks").rglob(f"attempt_0/{r}/stderr.log")).read_text()
                     for r in range(len(groups))] if ddp else [log.read_text()]
            results[stage, sig] = (project / name, proc.returncode, log.read_text(), ranks)
    finally:
        for _, _, _, proc in procs.values():
            groups = [proc.pid]
            with contextlib.suppress(OSError):
                groups += _ranks(proc.pid) if ddp else []
            for pgid in reversed(groups):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
            proc.wait()
    return results


def check_run_folder(run: Path) -> dict:
    """Every file complete and loadable; report.json names only checkpoints present, with the metrics they
    hold; every checkpoint present is named by report.json (qat_best: the best of those named)."""
    from PIL import Image

    from utils.qat.model import checkpoint
    files = [p for p in run.rglob("*") if p.is_file()]
    assert not [p for p in files if p.name.startswith(".")], f"temporary files left: {files}"
    report = json.loads((run / "report.json").read_text())
    assert (run / "report.md").read_text().startswith("# ")
    if (run / "qat_ap.png").exists():
        Image.open(run / "qat_ap.png").verify()
    ckpts = {p.name: checkpoint.read(p) for p in sorted((run / "weights").glob("*.pt"))}  # whole zip archives
    named = {Path(m["weights"]).name: m for m in report["models"] if m["name"] == "PTQ"}
    named.update({Path(e["weights"]).name: e for e in report["epochs"]})
    best = f"qat_best_{QS.stem}.pt"
    assert set(ckpts) - {best} == set(named), (sorted(ckpts), sorted(named))
    for name, row in named.items():
        assert ckpts[name]["metrics"]["AP"] == row["AP"], name
    if best in ckpts:
        assert ckpts[best]["metrics"]["AP"] == max(row["AP"] for row in named.values())
    qat = [m for m in report["models"] if m["name"] == "QAT"]
    if qat:
        assert Path(qat[0]["weights"]).name == best and ckpts[best]["metrics"]["AP"] == qat[0]["AP"]
    return report


@pytest.fixture(scope="module")
def sigkilled(yolov9_tree, shapes, tmp_path_factory):
    return _interrupted_runs(yolov9_tree, shapes, tmp_path_factory.mktemp("sigkill"),
                             [(stage, signal.SIGKILL) for stage in STAGES])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("stage", STAGES)
def test_sigkill_leaves_complete_consistent_files(sigkilled, stage):
    run, rc, _err, _ = sigkilled[stage, signal.SIGKILL]
    assert rc == -signal.SIGKILL
    report = check_run_folder(run)
    assert [m["name"] for m in report["models"]] == (["Origin", "PTQ"] if stage == "finetune" else ["Origin"])
    assert not report["epochs"]


#: What a run stopped at each stage has saved (its last line says so).
SAVED = {"calibration": "report.json, report.md, origin_images.npz", "checkpoint": "report.json, report.md, "
         "origin_images.npz", "finetune": "report.json, report.md, origin_images.npz, weights/ptq_ap_"}
#: Ctrl-C at every stage; SIGTERM and SIGHUP, which take Ctrl-C's path with another number, at calibration and at
#: fine-tuning across the one-process and the torchrun runs (a Latin square: each pair of signal and stage once,
#: each kind of run sees both signals and both stages; 4 runs instead of 8).
STOPS = [(stage, signal.SIGINT) for stage in STAGES] + [("calibration", signal.SIGTERM), ("finetune", signal.SIGHUP)]
DDP_STOPS = [("calibration", signal.SIGHUP), ("finetune", signal.SIGTERM)]


@pytest.fixture(scope="module")
def stopped(yolov9_tree, shapes, tmp_path_factory):
    """The runs of STOPS, side by side, with a dataloader worker each (it gets the signal too)."""
    return _interrupted_runs(yolov9_tree, shapes, tmp_path_factory.mktemp("stopped"), STOPS, workers=1)


def _check_stop_line(run: Path, stage: str, sig: signal.Signals, err: str) -> None:
    """A run stopped by ``sig`` ended with one line saying so and what was saved, and no traceback."""
    assert "Traceback" not in err, (stage, sig.name, err[-3000:])
    how = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], (stage, sig.name, err[-2000:])
    assert lines[0].startswith(f"error: {how}; saved in {run}: {SAVED[stage]}"), (stage, lines[0])
    assert lines[0].endswith("(each file complete; nothing half-written was kept)."), lines[0]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("stage,sig", STOPS, ids=[f"{stage}-{sig.name}" for stage, sig in STOPS])
def test_stop_signal_one_line_saying_what_was_saved(stopped, stage, sig):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it), SIGTERM and SIGHUP (schedulers, docker stop,
    a closed SSH session): exit status 128 + the signal's number, one line, no traceback, every file whole."""
    run, rc, err, _ = stopped[stage, sig]
    assert rc == 128 + sig, (stage, sig.name, rc, err[-2000:])
    _check_stop_line(run, stage, sig, err)
    check_run_folder(run)


@pytest.mark.slow
@pytest.mark.ddp
def test_stop_signal_under_torchrun(yolov9_tree, shapes, tmp_path):
    """2 processes (gloo), each sent the signal as torchrun forwards one: at calibration rank 0 calibrates while
    rank 1 waits in the broadcast of its amax; at fine-tuning both wait at an optimizer step. Rank 0 prints the
    one line, rank 1 nothing; both exit 128 + the signal's number (torchrun's report of its ranks); files whole."""
    runs = _interrupted_runs(yolov9_tree, shapes, tmp_path, DDP_STOPS, workers=1, ddp=True)
    for (stage, sig), (run, rc, launcher, (rank0, rank1)) in runs.items():
        assert rc != 0
        statuses = re.findall(r"rank\s*: (\d) \(local_rank: \d\)\n\s*exitcode\s*: (-?\d+)", launcher)
        assert sorted(statuses) == [("0", str(128 + sig)), ("1", str(128 + sig))], (stage, sig.name, launcher[-3000:])
        _check_stop_line(run, stage, sig, rank0)
        assert rank1.strip() == "", (stage, sig.name, rank1[-3000:])
        assert check_run_folder(run)["world_size"] == 2


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_started_with_sighup_ignored_keeps_running_through_one(yolov9_tree, shapes, tmp_path):
    """``nohup`` starts a run with SIGHUP ignored, so that a closed terminal does not end it: the run, stopped at
    fine-tuning, gets SIGHUP (its whole group, as a terminal's hangup), is still running a while later, and once
    released finishes as any run does: exit status 0, no error line, QAT done, every file whole."""
    mark, release, log = tmp_path / "mark", tmp_path / "release", tmp_path / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            _command(shapes, tmp_path, "nohup"), cwd=yolov9_tree, start_new_session=True,
            preexec_fn=lambda: _default_signals((signal.SIGHUP,)), stdout=subprocess.DEVNULL, stderr=err,
            env=_env(YOLOV9_QAT_TEST_PAUSE="finetune", YOLOV9_QAT_TEST_MARK=str(mark),
                     YOLOV9_QAT_TEST_RELEASE=str(release), OMP_NUM_THREADS="1"))
    try:
        deadline = time.time() + 300
        while not mark.exists():
            assert proc.poll() is None, f"exited {proc.returncode} before its stop: {log.read_text()}"
            assert time.time() < deadline, "never reached its stop"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGHUP)
        time.sleep(2)
        assert proc.poll() is None, f"SIGHUP ended a run started with it ignored: {log.read_text()[-3000:]}"
        release.touch()
        assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert "error:" not in log.read_text()
    report = check_run_folder(tmp_path / "nohup")
    assert [m["name"] for m in report["models"]] == ["Origin", "PTQ", "QAT"]


@pytest.mark.slow
@pytest.mark.e2e
def test_rerun_with_exist_ok_after_sigkill(yolov9_tree, shapes, sigkilled):
    run, _, _, _ = sigkilled["finetune", signal.SIGKILL]
    r = subprocess.run(_command(shapes, run.parent, run.name), cwd=yolov9_tree, capture_output=True, text=True,
                       env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held an earlier run of gelan-qs-shapes (--exist-ok): removed its" in r.stdout
    report = check_run_folder(run)
    assert [m["name"] for m in report["models"]] == ["Origin", "PTQ", "QAT"] and len(report["epochs"]) == 1
    from utils.qat.model import checkpoint
    checkpoint.load_quantized(run / "weights" / f"qat_best_{QS.stem}.pt")  # the model rebuilds from it


def _tmpfs_shell() -> list[str] | None:
    """A shell in its own user and mount namespace, where a small tmpfs can be mounted without privileges."""
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return probe[:-1] if ok else None


@pytest.mark.slow
@pytest.mark.e2e
def test_disk_full(yolov9_tree, shapes, tmp_path):
    """A 2 MB tmpfs as --project (the PTQ checkpoint, 6.5 MB, does not fit), then the same command with
    --exist-ok once the disk has room. Where no tmpfs can be mounted, the checkpoint's write fails with ENOSPC at
    the same point instead (tests/faults/sitecustomize.py)."""
    mnt, full, rerun = tmp_path / "small-disk", tmp_path / "full", tmp_path / "rerun"
    mnt.mkdir()
    command = " ".join(f"'{a}'" for a in _command(shapes, mnt, "run"))
    shell = _tmpfs_shell()
    if shell is not None:
        fill, make_room = f"mount -t tmpfs -o size=2m tmpfs '{mnt}'", f"mount -o remount,size=64m '{mnt}'"
    else:
        fill, make_room, shell = "export YOLOV9_QAT_TEST_ENOSPC=1", "unset YOLOV9_QAT_TEST_ENOSPC", ["sh", "-c"]
    script = (f"{fill} && cd '{yolov9_tree}' && {command}; echo rc=$? >&2; cp -a '{mnt}/run' '{full}'; "
              f"{make_room} && {command} >/dev/null 2>&1; echo rerun=$? >&2; cp -a '{mnt}/run' '{rerun}'")
    r = subprocess.run([*shell, script], capture_output=True, text=True, env=_env(), timeout=900)
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == "rerun=0" and lines[-2] == "rc=2", r.stderr[-3000:]
    error = lines[-3]
    assert error.startswith(f"error: cannot write {mnt}/run/weights/ptq_ap_"), error
    assert error.endswith(f"(no space left on the device): free some space there or write to another disk, then "
                          f"run the command again (saved in {mnt}/run: report.json, report.md, origin_images.npz; "
                          f"nothing half-written was kept)."), error
    assert "Traceback" not in r.stderr
    assert [m["name"] for m in check_run_folder(full)["models"]] == ["Origin"]
    assert [m["name"] for m in check_run_folder(rerun)["models"]] == ["Origin", "PTQ", "QAT"]


def test_atomic_file_whole_or_nothing(yolov9_tree, tmp_path):
    from utils.qat.core.atomic import atomic_file, write_text
    from utils.qat.core.errors import saved_summary
    target = write_text(tmp_path / "report.json", "old")
    with pytest.raises(RuntimeError):
        with atomic_file(target) as f:
            f.write(b"half")
            raise RuntimeError("stopped while writing")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    write_text(target, "new")
    assert target.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert saved_summary().startswith("saved in ") and "report.json" in saved_summary()


# ---- run_cli and stop signals, in a small Python process (no model: a tenth of a second each) -----------------

_STOP_SCRIPT = """
import multiprocessing, os, signal, subprocess, sys, time
from pathlib import Path
from utils.qat.core.atomic import atomic_file, write_text
from utils.qat.core.errors import run_cli

def main():
    with multiprocessing.Pool(1) as pool:  # its worker inherits run_cli's handlers; the pool ends it by SIGTERM
        assert pool.map(abs, [-1]) == [1]
    write_text(Path(sys.argv[2]) / "saved.txt", "whole")
    try:
        with atomic_file(Path(sys.argv[2]) / "half.bin") as f:
            f.write(b"half")
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
            time.sleep(1)  # the handler raises as soon as the signal lands; SIGHUP under nohup does not
    finally:
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal, and Ctrl-C, while the run cleans up: ignored
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        print("cleaned up")
        if os.environ.get("LATE_SIGNAL"):  # one more, landing while the interpreter finalizes (held there 2 s)
            subprocess.Popen([sys.executable, "-c", "import os, signal, time; time.sleep(0.5); "
                              f"os.kill({os.getpid()}, signal.{os.environ['LATE_SIGNAL']})"], stdout=subprocess.DEVNULL)
            globals()["held"] = HeldAtExit()

class HeldAtExit:
    def __del__(self):
        time.sleep(2)

run_cli(main)
"""


def _stop_script(tree: Path, folder: Path, sig: str, nohup: bool = False, **env: str):
    folder.mkdir()
    return subprocess.run([sys.executable, "-c", _STOP_SCRIPT, sig, str(folder)], cwd=tree, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(tree), **env},
                          preexec_fn=lambda: _default_signals((signal.SIGHUP,) if nohup else ()))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_run_cli_ends_a_stopped_run(yolov9_tree, tmp_path, sig):
    """128 + the signal's number, one line naming it and what was saved, no traceback (the pool's worker, ended
    by the pool's SIGTERM, too); cleanup runs to its end through a second signal; no half-written file."""
    r = _stop_script(yolov9_tree, tmp_path / "out", sig)
    number = getattr(signal, sig)
    assert r.returncode == 128 + number, r.stderr
    how = "interrupted" if sig == "SIGINT" else f"stopped by {sig}"
    assert r.stderr == (f"error: {how}; saved in {tmp_path / 'out'}: saved.txt (each file complete; nothing "
                        "half-written was kept).\n")
    assert r.stdout == "cleaned up\n" and [p.name for p in (tmp_path / "out").iterdir()] == ["saved.txt"]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_run_cli_a_signal_during_the_interpreters_exit_changes_nothing(yolov9_tree, tmp_path, sig):
    """A stopped run that is still finalizing when another signal lands (torchrun's SIGTERM to a rank slower to exit
    than rank 0; a second Ctrl-C) ends as before: the status of the first signal, its line alone."""
    r = _stop_script(yolov9_tree, tmp_path / "out", "SIGHUP", LATE_SIGNAL=sig)
    assert r.returncode == 128 + signal.SIGHUP, r.stderr
    assert r.stderr.startswith("error: stopped by SIGHUP; saved in ") and r.stderr.count("\n") == 1, r.stderr


def test_run_cli_stop_signals_on_other_ranks_and_under_nohup(yolov9_tree, tmp_path):
    """A torchrun rank other than 0 stops quietly with the same status; SIGHUP ignored from the start (nohup)
    stays ignored: the run goes on until the SIGTERM in its ``finally``."""
    r = _stop_script(yolov9_tree, tmp_path / "rank1", "SIGHUP", WORLD_SIZE="2", RANK="1")
    assert r.returncode == 128 + signal.SIGHUP and r.stderr == "" and r.stdout == ""  # rank 1 prints no results
    r = _stop_script(yolov9_tree, tmp_path / "nohup", "SIGHUP", nohup=True)
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert r.stderr.startswith("error: stopped by SIGTERM; saved in ")
    assert r.stdout == ""  # that SIGTERM was the first stop: it ended the cleanup's wait
    assert sorted(p.name for p in (tmp_path / "nohup").iterdir()) == ["half.bin", "saved.txt"]  # written whole


def test_the_race_notice_alone_is_dropped_once_stopping(monkeypatch):
    """CPython prints a signal caught just before the switch to SIG_IGN as an OSError it cannot raise; once a stop
    has begun that notice is dropped, and whatever else is reported reaches the hook that was there before."""
    from utils.qat.core import errors
    seen = []
    monkeypatch.setattr(errors, "_previous_unraisablehook", seen.append)
    race = types.SimpleNamespace(exc_value=OSError("Signal 15 ignored due to race condition"))
    other = types.SimpleNamespace(exc_value=OSError("[Errno 28] No space left on device"))
    errors._race_notice_dropped(race)
    errors._race_notice_dropped(other)
    assert seen == [other]
