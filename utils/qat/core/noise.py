"""Third-party messages a user cannot act on, silenced at the source, each by its exact text.

Every CLI applies these through :func:`utils.qat.core.compat.apply` before importing torch's or modelopt's
noisy modules. Each entry names its source and why it is harmless; anything not listed (a real
warning) still shows.
"""
from __future__ import annotations

import logging
import warnings

# (category, message regex, source: why it is harmless)
WARNINGS = (
    (FutureWarning, r"`torch\.jit\.script` is deprecated",
     "modelopt 0.47 tensor_quant.py decorates a helper with torch.jit.script at import (torch >= 2.10)"),
    (UserWarning, r"pkg_resources is deprecated",
     "YOLOv9's utils/general.py imports pkg_resources (setuptools 80 warns; compat keeps it working)"),
)

# (logger name, message prefix, source: why it is harmless)
LOG_RECORDS = (
    ("torch.utils.cpp_extension", "No CUDA runtime is found",
     "modelopt imports torch.utils.cpp_extension, which logs this on every CPU-only machine with a "
     "CUDA toolkit folder; nothing is compiled"),
    ("yolov5", "\x1b[34m\x1b[1malbumentations: \x1b[0m1 validation error for InitSchema",
     "YOLOv9's utils/augmentations.py builds its Albumentations list with albumentations 1.x arguments; 2.x "
     "refuses them (a pydantic error, once per dataloader with --hyp) and upstream then trains without that list, "
     "whose transforms run on 1 % of images or never (blur, median blur, gray, CLAHE). `pip install "
     "'albumentations<2'` brings them back"),
)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


_applied = False


def silence() -> None:
    """Install the filters (idempotent)."""
    global _applied
    if _applied:
        return
    for category, message, _why in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, prefix, _why in LOG_RECORDS:
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
    _applied = True
