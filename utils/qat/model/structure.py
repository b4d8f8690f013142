"""A model's layer shapes as plain data, recorded in a quantized checkpoint and applied when it is rebuilt.

A quantized checkpoint rebuilds its model from the yaml, which gives the shapes upstream's code derives from it;
a model whose modules differ from its yaml (Ultralytics' YOLOv9-t, whose class branch is 80 wide where the yaml
builds 128; a pruned model) needs its own. :func:`record` lists the constructor arguments of every layer with
weights (convolutions, BatchNorm, Linear), :func:`apply` makes each rebuilt layer that differs again from its
record, before modelopt's state and the weights are restored. Plain data: read with ``weights_only=True``
defaults, nothing runs.

A record may change a layer's widths (the arguments of :data:`WIDTHS`), never its kind or its geometry (stride,
padding, dilation: what sizes its output), and every layer it makes is first made on the meta device and its
tensors compared with those the checkpoint stores: a record cannot make the loader allocate what the file does
not hold.

    layers = record(model)
    apply(rebuilt, layers, "qat_best.pt", state_dict)
"""
from __future__ import annotations

import inspect

import torch.nn as nn

from utils.qat.core.errors import QATError

#: The layers recorded: those whose constructor arguments decide their weights' shapes (and BatchNorm's eps).
KINDS: dict[str, type[nn.Module]] = {cls.__name__: cls for cls in (
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.Linear)}
_NOT_RECORDED = ("device", "dtype")  # where a layer lives, not its shape
#: The arguments a record may set otherwise than the yaml: widths and what goes with them (every other one, such
#: as stride, padding or dilation, sizes activations rather than weights, and must be the yaml's).
WIDTHS = frozenset({"in_channels", "out_channels", "groups", "bias", "num_features", "in_features", "out_features",
                    "affine", "track_running_stats", "eps", "momentum"})
#: What to do about a checkpoint that does not fit the model this tree builds.
FIX = "use the YOLOv9 tree it was quantized in, or quantize its FP weights again in this one"


def _kind(module: nn.Module) -> str | None:
    """The recorded class a module is (modelopt's QuantConv2d is a Conv2d), None for any other module."""
    return next((c.__name__ for c in type(module).__mro__ if KINDS.get(c.__name__) is c), None)


def _arguments(cls: type[nn.Module]) -> list[str]:
    return [p for p in inspect.signature(cls).parameters if p not in _NOT_RECORDED]


def layer(module: nn.Module) -> dict | None:
    """One layer's record: ``{"type": class name, constructor argument: value, ...}`` (``bias`` as a bool)."""
    kind = _kind(module)
    if kind is None:
        return None
    entry: dict = {"type": kind}
    for name in _arguments(KINDS[kind]):
        value = getattr(module, name)
        entry[name] = value is not None if name == "bias" else value
    return entry


def record(model: nn.Module) -> dict[str, dict]:
    """Module name -> :func:`layer` for every recorded layer of ``model``."""
    return {name: entry for name, m in model.named_modules() if (entry := layer(m)) is not None}


def _fresh(entry: dict, like: nn.Module) -> nn.Module:
    """A new layer as ``entry`` records it, with ``like``'s trainability and the attributes upstream set on it."""
    fresh = KINDS[entry["type"]](**_arguments_of(entry))
    weight = next(like.parameters(), None)
    if weight is not None:
        fresh.to(weight.device).requires_grad_(weight.requires_grad)
    for k, v in vars(like).items():  # upstream's layer index and inputs (i, f, type, np) on a yaml-level layer
        if k not in vars(fresh):
            setattr(fresh, k, v)
    return fresh


def _checked(entry: dict, built: nn.Module, name: str, state: dict | None, source: str) -> None:
    """``entry`` differs from ``built`` (the yaml's layer) in widths alone, and the layer it makes, made on the
    meta device (no memory), has exactly the tensors ``state`` stores for ``name``."""
    kind, have = entry["type"], layer(built) or {}
    if kind != have.get("type"):
        raise QATError(f"{source} records a {kind} at {name} where its yaml builds a {have.get('type')} in this "
                       f"YOLOv9 tree; {FIX}.")
    moved = next((k for k in sorted(set(entry) | set(have)) if k not in WIDTHS and k != "type"
                  and entry.get(k) != have.get(k)), None)
    if moved is not None:
        raise QATError(f"{source} records a {kind} at {name} with {moved} {entry.get(moved)!r} where its yaml builds "
                       f"{have.get(moved)!r}; a checkpoint may record other widths, never another geometry, so {FIX}.")
    try:
        shapes = {k: tuple(v.shape) for k, v in KINDS[kind](**_arguments_of(entry), device="meta").state_dict().items()}
    except (TypeError, ValueError, RuntimeError) as e:
        raise QATError(f"{source} records a {kind} at {name} that cannot be made ({e}); {FIX}.") from e
    if state is None:
        return
    for key, shape in shapes.items():
        stored = state.get(f"{name}.{key}")
        if stored is None or tuple(stored.shape) != shape:
            holds = "no such tensor" if stored is None else f"one of shape {tuple(stored.shape)}"
            raise QATError(f"{source} records a {kind} at {name} whose {key} would have shape {shape}, but the file "
                           f"stores {holds}; the record does not describe the file's own weights, so {FIX}.")


def _arguments_of(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k != "type"}


def apply(model: nn.Module, layers: dict[str, dict], source: str, state: dict | None = None) -> nn.Module:
    """Make every layer of ``model`` (rebuilt from the yaml) that differs from ``layers`` (:func:`record` of the
    model that was saved) again as recorded; a record that does not describe this model, or whose layers would not
    hold exactly the tensors ``state`` (the checkpoint's state dict) stores, is one QATError sentence (``source``
    names the checkpoint), before anything it sizes is made."""
    modules = dict(model.named_modules())
    changed = []
    for name, entry in layers.items():
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind not in KINDS:
            raise QATError(f"{source} records a {kind} at {name}, a layer this version of yolov9-qat does not know; "
                           f"read it with the version that wrote it, or quantize its FP weights again with this one.")
        built = modules.get(name) if name else None
        if built is None or _kind(built) is None:
            what = f"a {type(built).__name__}" if built is not None else "nothing"
            raise QATError(f"{source} records a {kind} at {name or 'the top'} where its yaml builds {what} in this "
                           f"YOLOv9 tree; {FIX}.")
        if layer(built) != entry:
            _checked(entry, built, name, state, source)
            changed.append((name, entry, built))
    for name, entry, built in changed:  # every record checked before any layer is made
        try:
            fresh = _fresh(entry, built)
        except (TypeError, ValueError) as e:
            raise QATError(f"{source} records a {entry['type']} at {name} that cannot be made ({e}); {FIX}.") from e
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, fresh)
    extra = next((n for n, m in modules.items() if n not in layers and _kind(m) is not None), None)
    if extra is not None:
        raise QATError(f"{source} does not record the {_kind(modules[extra])} at {extra} that its yaml builds in "
                       f"this YOLOv9 tree; {FIX}.")
    return model


def misfit(model: nn.Module, state: dict) -> str:
    """The first way ``state`` does not fit ``model``'s state dict, in words ('' if it fits)."""
    have = model.state_dict()
    for k, v in state.items():
        if k not in have:
            return f"the rebuilt model has no {k}"
        if tuple(have[k].shape) != tuple(v.shape):
            return f"{k} has shape {tuple(v.shape)} where the rebuilt model's is {tuple(have[k].shape)}"
    missing = next((k for k in have if k not in state), None)
    return f"the checkpoint has no {missing}" if missing is not None else ""
