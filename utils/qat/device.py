"""``--device`` parsing: cpu, N, cuda:N (and N,M for multi-GPU runs)."""
from __future__ import annotations

import torch

from utils.qat.errors import QATError


def select_device(spec: str | None) -> torch.device:
    """The device for ``spec``; default: the first GPU if there is one, else the CPU with a notice."""
    spec = (spec or "").strip().lower()
    if spec in ("", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        print("notice: no CUDA GPU found; running on the CPU (slow for full-size models).")
        return torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if "," in spec:
        raise QATError(f"--device {spec} names several GPUs, but this version runs QAT on one; use e.g. --device 0.")
    index = spec.removeprefix("cuda:").removeprefix("cuda").split(",")[0] or "0"
    if not index.isdigit():
        raise QATError(f"--device '{spec}' is not understood; use cpu, 0, or cuda:0.")
    if not torch.cuda.is_available():
        raise QATError(f"--device {spec} asks for a CUDA GPU but none is available here; use --device cpu.")
    if int(index) >= torch.cuda.device_count():
        raise QATError(f"--device {spec}: there is no GPU {index} (found {torch.cuda.device_count()}); "
                       "pick an index below that.")
    return torch.device(f"cuda:{index}")
