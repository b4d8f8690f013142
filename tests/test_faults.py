"""Faults during `qat.py quantize` leave complete, consistent files: Ctrl-C (SIGINT to the process group, as a
terminal sends it) and SIGKILL during calibration, during fine-tuning and while a checkpoint is written, and a
full disk. After each: every file on disk is complete and loads, report.json agrees with the checkpoints
present, Ctrl-C ends with one line saying what was saved, and the same command with --exist-ok works.

The process is stopped at each point by tests/faults/sitecustomize.py (on PYTHONPATH of the run only): a real
run that waits at a real point of its work until the signal comes.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
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


def _sigint_default() -> None:
    """In the child: SIGINT back to its default, so that Python turns it into KeyboardInterrupt even when the
    suite itself runs with SIGINT ignored (a background job of a non-interactive shell, e.g. ``.ci/run &``)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted_runs(tree: Path, shapes: Path, project: Path, sig: signal.Signals, workers: int = 0) -> dict:
    """One run per stage, side by side (one thread each), each stopped at its stage and sent ``sig``. Returns
    stage -> (run folder, exit status, stderr). Output goes to files: a pipe would also wait for any process
    the run left behind."""
    procs = {}
    for stage in STAGES:
        mark, log = project / f"{stage}.mark", project / f"{stage}.stderr"
        with open(log, "w") as err:
            procs[stage] = (mark, log, subprocess.Popen(
                _command(shapes, project, stage, workers), cwd=tree, start_new_session=True,
                preexec_fn=_sigint_default, stdout=subprocess.DEVNULL, stderr=err,
                env=_env(YOLOV9_QAT_TEST_PAUSE=stage, YOLOV9_QAT_TEST_MARK=str(mark), OMP_NUM_THREADS="1")))
    results = {}
    try:
        for stage, (mark, log, proc) in procs.items():
            deadline = time.time() + 300
            while not mark.exists():
                assert proc.poll() is None, f"{stage}: exited {proc.returncode} before its stop: {log.read_text()}"
                assert time.time() < deadline, f"{stage}: never reached its stop"
                time.sleep(0.2)
            os.killpg(proc.pid, sig)  # the whole group: the dataloader workers too, as a terminal's Ctrl-C does
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # its threads' stacks, to its stderr
                time.sleep(3)
                pytest.fail(f"{stage}: still running 300 s after {sig.name}: {log.read_text()[-8000:]}")
            assert _group_gone(proc.pid, 60), f"{stage}: processes left behind after {sig.name}"
            results[stage] = (project / stage, proc.returncode, log.read_text())
    finally:
        for _, _, proc in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return results


def check_run_folder(run: Path) -> dict:
    """Every file complete and loadable; report.json names only checkpoints present, with the metrics they
    hold; every checkpoint present is named by report.json (qat_best: the best of those named)."""
    from PIL import Image

    from utils.qat import checkpoint
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
    return _interrupted_runs(yolov9_tree, shapes, tmp_path_factory.mktemp("sigkill"), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize("stage", STAGES)
def test_sigkill_leaves_complete_consistent_files(sigkilled, stage):
    run, rc, _err = sigkilled[stage]
    assert rc == -signal.SIGKILL
    report = check_run_folder(run)
    assert [m["name"] for m in report["models"]] == (["Origin", "PTQ"] if stage == "finetune" else ["Origin"])
    assert not report["epochs"]


@pytest.mark.slow
@pytest.mark.e2e
def test_ctrl_c_one_line_saying_what_was_saved(yolov9_tree, shapes, tmp_path):
    saved = {"calibration": "report.json, report.md", "checkpoint": "report.json, report.md",
             "finetune": "report.json, report.md, weights/ptq_ap_"}
    runs = _interrupted_runs(yolov9_tree, shapes, tmp_path, signal.SIGINT, workers=1)  # workers get SIGINT too
    for stage, (run, rc, err) in runs.items():
        assert rc == 130, (stage, err[-2000:])
        assert "Traceback" not in err, (stage, err[-3000:])
        last = err.strip().splitlines()[-1]
        assert last.startswith(f"error: interrupted; saved in {run}: {saved[stage]}"), (stage, last)
        assert last.endswith("(each file complete; nothing half-written was kept)."), last
        check_run_folder(run)


@pytest.mark.slow
@pytest.mark.e2e
def test_rerun_with_exist_ok_after_sigkill(yolov9_tree, shapes, sigkilled):
    run, _, _ = sigkilled["finetune"]
    r = subprocess.run(_command(shapes, run.parent, run.name), cwd=yolov9_tree, capture_output=True, text=True,
                       env=_env(), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held an earlier run of gelan-qs-shapes (--exist-ok): removed its" in r.stdout
    report = check_run_folder(run)
    assert [m["name"] for m in report["models"]] == ["Origin", "PTQ", "QAT"] and len(report["epochs"]) == 1
    from utils.qat import checkpoint
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
                          f"run the command again (saved in {mnt}/run: report.json, report.md; nothing half-written "
                          f"was kept)."), error
    assert "Traceback" not in r.stderr
    assert [m["name"] for m in check_run_folder(full)["models"]] == ["Origin"]
    assert [m["name"] for m in check_run_folder(rerun)["models"]] == ["Origin", "PTQ", "QAT"]


def test_atomic_file_whole_or_nothing(yolov9_tree, tmp_path):
    from utils.qat.atomic import atomic_file, saved_summary, write_text
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
