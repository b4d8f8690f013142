"""nvidia-modelopt, imported without the integrations this toolkit never uses.

``import modelopt.torch.quantization`` runs ``modelopt.torch``'s ``__init__``, which loads every plugin whose
package is installed: Hugging Face transformers, diffusers, accelerate, PEFT, Megatron, ... On a machine that has
them (most GPU machines used for deep learning do), that is much of the command's start-up: 24 s from launch to
the first line of ``qat.py quantize`` on the H100 host of benchmarks/results/yolov9-t-coco-startup-h100-logs/, and
17.5 s with this module (``qat.py --help``, torch without modelopt, takes 5 s). The toolkit quantizes YOLOv9's own
modules and needs none of those plugins, so while modelopt is first imported their packages look absent, which
modelopt's own ``import_plugin`` treats as a missing package: skipped, silently. A package the process imported
before is left alone, and once modelopt is loaded they import normally again. Every module here that uses modelopt
imports this one first (tests/test_modelopt_import.py).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterable, Iterator

#: The packages behind modelopt's optional plugins (``with import_plugin(...)`` in modelopt.torch); none of them
#: takes part in quantizing a YOLOv9 model.
INTEGRATIONS = ("transformers", "diffusers", "accelerate", "peft", "trl", "vllm", "megatron", "transformer_engine",
                "apex", "fairscale", "torch_geometric", "deepspeed", "fastvideo")


@contextlib.contextmanager
def absent(names: Iterable[str]) -> Iterator[None]:
    """While inside, ``import name`` raises ModuleNotFoundError for each of ``names`` not imported yet (a ``None``
    in ``sys.modules`` is Python's own marker for that); afterwards they import as usual."""
    hidden = [n for n in names if n not in sys.modules]
    for n in hidden:
        sys.modules[n] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for n in hidden:
            if n in sys.modules and sys.modules[n] is None:
                del sys.modules[n]


def drop_kept_tracebacks(modules: Iterable[str]) -> None:
    """Drops the tracebacks of exceptions that ``modules`` keep, in their globals or their classes' attributes.
    PuLP, which modelopt imports, keeps one per solver it did not find (``err = e`` in each solver class); its
    traceback holds the frames of that import and of whoever imported first, so a first import inside the
    calibration kept its dataloader, worker processes and all, to the process's exit."""
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in list(vars(module).values()):
            kept = [value] if not isinstance(value, type) else list(vars(value).values())
            for item in kept:
                if isinstance(item, BaseException):
                    item.__traceback__ = None


def load():
    """``modelopt.torch.quantization``, imported (once per process) with :data:`INTEGRATIONS` absent; the exceptions
    its dependencies keep from that import let go of its callers' frames."""
    name = "modelopt.torch.quantization"
    if name not in sys.modules:
        before = set(sys.modules)
        with absent(INTEGRATIONS):
            importlib.import_module(name)
        drop_kept_tracebacks(set(sys.modules) - before)
    return sys.modules[name]


mtq = load()
