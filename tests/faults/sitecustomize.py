"""Test instrumentation for tests/test_faults.py, loaded at interpreter start-up through PYTHONPATH.

It changes nothing by default. With YOLOV9_QAT_TEST_PAUSE set, the process stops at one real point of a
`qat.py quantize` run, touches the file YOLOV9_QAT_TEST_MARK and sleeps until the test signals it (or, with
YOLOV9_QAT_TEST_RELEASE set, until that file exists: then the run goes on):
  calibration  the first forward pass of a quantized module (calibration: Origin runs the FP model)
  finetune     the first optimizer step of QAT fine-tuning (torch's global step pre-hook)
  checkpoint   the first file completed under a weights/ folder, after its bytes are written and before it
               is linked into place (the fsync of utils/qat/core/atomic.py)
SIGUSR1 then prints every thread's stack (for a run that does not end after its signal).
With YOLOV9_QAT_TEST_ENOSPC=1 that fsync fails with ENOSPC instead (a full disk, where no small tmpfs can be
mounted for the test).
"""
import errno
import faulthandler
import os
import signal
import time

_stage = os.environ.get("YOLOV9_QAT_TEST_PAUSE")
if _stage:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for the stacks of a run that hangs
_paused = False


def _pause(*_args, **_kwargs):
    global _paused
    if _paused:
        return
    _paused = True
    open(os.environ["YOLOV9_QAT_TEST_MARK"], "w").close()
    release = os.environ.get("YOLOV9_QAT_TEST_RELEASE")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (release and os.path.exists(release)):
        time.sleep(0.1)  # until the test sends its signal (its handler raises here), or releases the run


def _weights_file(fd: int) -> bool:
    try:
        return "/weights/" in os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return False


if _stage == "calibration":
    import torch

    def _quantized_forward(module, _args):
        if type(module).__name__.startswith("Quant"):
            _pause()

    torch.nn.modules.module.register_module_forward_pre_hook(_quantized_forward)
elif _stage == "finetune":
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_pause)

if _stage == "checkpoint" or os.environ.get("YOLOV9_QAT_TEST_ENOSPC") == "1":
    _fsync = os.fsync

    def fsync(fd):
        if _weights_file(fd):
            if _stage == "checkpoint":
                _pause()
            else:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return _fsync(fd)

    os.fsync = fsync
