"""utils/qat/core/progress.py: a bar on a terminal (a real pseudo-terminal here), one line per stage in a log."""
from __future__ import annotations

import io
import os

import pytest
from tqdm import tqdm

from utils.qat.core.progress import StageLine, progress


def test_log_gets_one_line_per_stage():
    log = io.StringIO()
    bar = progress(range(5), total=3, desc="QAT epoch 1/2", file=log)
    assert isinstance(bar, StageLine)
    for i, _ in enumerate(bar):
        bar.set_postfix(loss=f"{0.5 / (i + 1):.5f}")
        if i + 1 >= 3:
            break  # how finetune and calibrate stop at --iters / --calib-batches
    for _ in progress([1, 2], desc="computing amax", file=log, leave=False):
        pass
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "\r" not in log.getvalue()
    assert lines[0].startswith("QAT epoch 1/2: 3/3 in ") and lines[0].endswith(" s, loss=0.16667")
    assert lines[1].startswith("computing amax: 2/2 in ")


def test_log_says_where_an_interrupted_stage_stopped():
    log = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        for i in progress(range(10), desc="calibrating (mse)", file=log):
            if i == 3:
                raise KeyboardInterrupt
    (line,) = log.getvalue().splitlines()
    assert line.startswith("calibrating (mse): stopped at 4/10 after ")


def test_terminal_gets_a_bar_and_quiet_gets_nothing(monkeypatch):
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        assert isinstance(progress(range(2), file=terminal), tqdm)
    os.close(leader)
    monkeypatch.setenv("YOLOV9_QAT_QUIET", "1")
    log = io.StringIO()
    for _ in progress(range(2), desc="x", file=log):
        pass
    assert log.getvalue() == ""
