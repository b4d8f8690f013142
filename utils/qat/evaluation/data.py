"""Dataset yamls and dataloaders, with one clear sentence for every way a dataset can be wrong."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import yaml

from utils.qat.core.errors import QATError
from utils.qat.evaluation import label_cache

IMAGE_SUFFIXES = {".bmp", ".dng", ".jpeg", ".jpg", ".mpo", ".png", ".tif", ".tiff", ".webp", ".pfm"}
# the YOLOv9 tree this file was patched into: as many folders up as the module name has dots (utils.qat....)
TREE = Path(__file__).resolve().parents[__name__.count(".")]
DEFAULT_DATA = "data/coco.yaml"  # --data when left out: the tree's COCO yaml, as upstream val.py and the reference
HYPS = "data/hyps"
NO_HYP = "none"  # --hyp none: fine-tune on the images as they are
# The augmentation of the fine-tuning images per task, as measured. Detection: upstream's hyp.scratch-high, with which
# every detection default was measured (GELAN-C, GELAN-S, GELAN-QS: docs/QAT_CALIBRATION.md "The head's scales
# searched, then QAT"). Segmentation: none, since on GELAN-QS-seg the masks ended lower with it (0.8036 against 0.8064)
# and the segmentation default was measured without it (docs/QAT_FINETUNING.md "The shapes models to the end, and the
# mask term's weight", and docs/QAT_CALIBRATION.md "`mse-image` on the GPU, and the calibration default per task").
# Segmentation on natural images is unmeasured.
DEFAULT_HYPS: dict[str, str | None] = {"detect": f"{HYPS}/hyp.scratch-high.yaml", "segment": None}
#: The evaluation protocol: rectangular letterbox shapes are fixed per group of this many images (upstream's order:
#: sorted by aspect ratio), whatever batch they then run in, so that a score does not depend on --batch-size.
#: Upstream's val.py fixes them per batch of its --batch-size, whose default is 32: at that default the two agree.
RECT_GROUP = 32


def data_argument(value: str | None) -> str:
    """The dataset yaml of ``--data`` (left out: the tree's data/coco.yaml); prints which one is used."""
    if value is not None:
        print(f"data: {value}")
        return value
    path = TREE / DEFAULT_DATA
    print(f"data: {DEFAULT_DATA if Path.cwd().resolve() == TREE else path} (--data not given: the default)")
    return str(path)


def _resolve(entry, base: Path) -> list[Path]:
    items = entry if isinstance(entry, (list, tuple)) else [entry]
    return [p if p.is_absolute() else (base / p) for p in (Path(str(i)) for i in items)]


def _count_images(paths: list[Path]) -> int:
    n = 0
    for p in paths:
        if p.is_dir():
            n += sum(1 for f in p.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)
        elif p.is_file():  # a txt list of image paths
            n += sum(1 for line in p.read_text().splitlines() if line.strip())
    return n


def load_data_yaml(path: str | os.PathLike, splits: tuple[str, ...] = ("val",), root: str | os.PathLike | None = None) -> dict:
    """Read and check a YOLOv9 data yaml. ``splits`` must exist and hold images.

    Like upstream, a relative ``path:`` is taken relative to the YOLOv9 root (``root``, default: the
    current directory) and train/val relative to ``path``. Returns the dict with absolute paths.
    """
    path = Path(path)
    if not path.is_file():
        raise QATError(f"dataset yaml not found: {path}; pass --data with the path of a YOLOv9 data yaml.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise QATError(f"{path} is not valid YAML ({e.__class__.__name__}); fix the file's syntax.") from e
    if not isinstance(data, dict):
        raise QATError(f"{path} is not a YOLOv9 data yaml (expected keys train, val, nc, names).")
    if "names" not in data:
        raise QATError(f"{path} has no 'names:' list; add the class names.")
    names = data["names"]
    if isinstance(names, (list, tuple)):
        names = dict(enumerate(names))
    if not isinstance(names, dict):
        raise QATError(f"'names:' in {path} must be a list or an index->name mapping.")
    names = {int(k): str(v) for k, v in names.items()}
    nc = int(data.get("nc", len(names)))
    if nc != len(names):
        raise QATError(f"{path} says nc: {nc} but lists {len(names)} names; make them agree.")
    base = Path(data.get("path") or "")
    if not base.is_absolute():
        base = (Path(root or os.getcwd()) / base).resolve()
    for split in splits:
        if not data.get(split):
            raise QATError(f"{path} has no '{split}:' entry; add the {split} image folder or list.")
        paths = _resolve(data[split], base)
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            fetch = ("download the dataset first (the yaml's 'download:' entry; for COCO, YOLOv9's "
                     "scripts/get_coco.sh) or " if data.get("download") else "")
            raise QATError(f"the '{split}' images of {path} were not found at {missing[0]}; {fetch}fix 'path:' / "
                           f"'{split}:' (relative paths are taken from the YOLOv9 root).")
        if _count_images(paths) == 0:
            raise QATError(f"the '{split}' folder of {path} ({paths[0]}) holds no images; point it at a folder of "
                           "images with labels/ beside images/.")
        data[split] = [str(p) for p in paths] if len(paths) > 1 else str(paths[0])
    data.update(path=str(base), names=names, nc=nc, yaml_file=str(path))
    for split in splits:
        check_classes(data, split)
    return data


def _images(entry: Path) -> list[str]:
    """The images of one train/val entry: a folder (searched recursively) or a txt list (upstream's rule:
    a line starting with ./ is relative to the list's folder)."""
    if entry.is_dir():
        return [str(f) for f in sorted(entry.rglob("*")) if f.suffix.lower() in IMAGE_SUFFIXES]
    lines = [line.strip() for line in entry.read_text().splitlines() if line.strip()]
    return [str(entry.parent / line[2:]) if line.startswith("./") else line for line in lines]


def label_files(data: dict, split: str) -> list[Path]:
    """The label file of every image of ``split`` (upstream's images/ -> labels/ rule; some may not exist)."""
    from utils.dataloaders import img2label_paths
    entries = data[split] if isinstance(data[split], list) else [data[split]]
    return [Path(p) for entry in entries for p in img2label_paths(_images(Path(entry)))]


def check_classes(data: dict, split: str) -> None:
    """Every label line's class id must be one of the dataset's classes (0 .. nc-1). Upstream's loader
    accepts larger ids without a word (only train.py refuses them, without naming the file)."""
    nc = data["nc"]
    for label in label_files(data, split):
        try:
            text = label.read_text(errors="replace")
        except (FileNotFoundError, IsADirectoryError):
            continue  # an image without labels: a background image
        for number, line in enumerate(text.splitlines(), 1):
            token = line.split(None, 1)[0] if line.strip() else None
            if token is None:
                continue
            try:
                cls = float(token)
            except ValueError:
                cls = None
            if cls is None or not cls.is_integer() or not 0 <= cls < nc:
                raise QATError(f"{label}:{number} has class {token}, but {data['yaml_file']} has nc: {nc} (classes "
                               f"0-{nc - 1}); fix that label, or nc and names in the yaml.")


def dataloader(data: dict, split: str, imgsz: int, batch_size: int, stride: int, *, workers: int = 8,
               rect: bool = True, shuffle: bool = False, hyp: dict | None = None, prefix: str = "",
               local_rank: int = -1, masks: bool = False, seed: int | None = None, group: int | None = None):
    """Upstream's dataloader: validation form (letterbox, pad 0.5, rect) by default; with ``hyp``, the
    training form with upstream's augmentation. Returns ``(loader, dataset)``.

    ``group`` (with ``rect``, one process, no shuffle: the evaluation protocol, :data:`RECT_GROUP`): the
    rectangular shapes are upstream's for batches of ``group`` images, and the loader cuts each such group into
    batches of at most ``batch_size`` (:class:`GroupedBatches`), so every image gets the same letterbox whatever
    ``batch_size`` is. Without it, upstream's: the shapes follow the batches.

    ``local_rank`` >= 0 (a process of a multi-GPU run, process group joined): ``batch_size`` images per
    process from upstream's ``DistributedSampler`` shard, rank r reading images r, r + W, r + 2W, ...
    (``shuffle``: of one permutation shared by the ranks, drawn anew after ``loader.sampler.set_epoch``).
    ``masks``: upstream's segmentation dataloader, whose batches add one mask per instance at input
    resolution (as upstream ``segment/val.py`` evaluates). ``seed``: the shuffle order and the random streams
    of the workers' augmentation (``_reseeded``)."""
    grouped = group is not None and rect and not shuffle and local_rank < 0
    workers = min(workers, os.cpu_count() or 1)
    # a loader made again (grouped, reseeded) is made first without workers: upstream's starts its workers at once,
    # and they would read and augment batches nobody takes
    kwargs = dict(single_cls=False, hyp=hyp, augment=hyp is not None, pad=0.5 if rect else 0.0, rect=rect,
                  workers=0 if grouped or seed is not None else workers, shuffle=shuffle,
                  prefix=prefix or f"{split}: ", rank=local_rank)
    shapes_batch = group if grouped else batch_size
    with _scan_reported_once(), label_cache.guarded():
        if masks:
            from utils.segment.dataloaders import create_dataloader as create_seg_dataloader
            loader, dataset = create_seg_dataloader(data[split], imgsz, shapes_batch, stride,
                                                    mask_downsample_ratio=1, overlap_mask=False, **kwargs)
        else:
            from utils.dataloaders import create_dataloader
            loader, dataset = create_dataloader(data[split], imgsz, shapes_batch, stride, **kwargs)
    if grouped:  # the dataset was made with no workers: the loader that reads it gets them, as upstream sizes them
        readers = min(workers, batch_size if batch_size > 1 else 0)
        loader = type(loader)(dataset, batch_sampler=GroupedBatches(len(dataset), group, batch_size),
                              num_workers=readers, pin_memory=loader.pin_memory, collate_fn=loader.collate_fn,
                              worker_init_fn=loader.worker_init_fn, generator=loader.generator)
    return (loader if seed is None else _reseeded(loader, seed, _upstream_workers(workers, loader.batch_size),
                                                  local_rank)), dataset


def _upstream_workers(workers: int, batch_size: int) -> int:
    """The workers upstream's ``create_dataloader`` gives a loader of ``batch_size`` (its own formula: the CPUs
    shared by the GPUs, none for batches of one)."""
    import torch
    return min((os.cpu_count() or 1) // max(torch.cuda.device_count(), 1), batch_size if batch_size > 1 else 0, workers)


class GroupedBatches:
    """Batch sampler: the indices 0..n-1 in order, in batches of at most ``batch_size`` that never cross a group of
    ``group`` (a group's images share one letterbox shape; a batch must)."""

    def __init__(self, n: int, group: int, batch_size: int):
        self.n, self.group, self.batch_size = n, group, batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for start in range(0, self.n, self.group):
            end = min(start + self.group, self.n)
            for first in range(start, end, self.batch_size):
                yield list(range(first, min(first + self.batch_size, end)))

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.group)
        return full * -(-self.group // self.batch_size) + -(-rest // self.batch_size)


@contextlib.contextmanager
def _scan_reported_once() -> Iterator[None]:
    """Upstream's dataset scan, reported through ``utils.qat.core.progress`` while a dataset is built.

    Upstream shows a cached scan with a tqdm bar that it never closes (``tqdm(None, desc=..., initial=n)``): the
    bar is drawn when made and again when collected, so a log gets every "Scanning ... labels.cache" line twice,
    and a first scan draws a bar per update. For the time the dataset is built, upstream's dataloaders module
    takes its bars from here: the cached scan is one line, a first scan one line when it ends (a bar on a
    terminal, as before). The module's name is restored afterwards; nothing else of upstream changes."""
    import utils.dataloaders as upstream
    saved = upstream.tqdm
    upstream.tqdm = _scan_bar
    try:
        yield
    finally:
        upstream.tqdm = saved


def _scan_bar(iterable=None, desc: str | None = None, total: int | None = None, **kwargs):
    """What upstream's dataloaders module gets for ``tqdm`` while a dataset is built (``_scan_reported_once``)."""
    from utils.qat.core.progress import note, progress
    if iterable is None:  # the summary of a cached scan, a bar that is drawn and never advanced: one line
        note(desc or "")
        return progress(None, disable=True)
    return progress(iterable, desc=desc, total=total, **kwargs)


def _reseeded(loader, seed: int, workers: int, local_rank: int = -1):
    """``loader`` again, with ``workers``, its shuffle and its workers' seeds drawn from ``seed``. Upstream seeds every
    loader's generator with one constant, so the order of the images and every worker's augmentation repeat whatever
    the seed. A distributed sampler takes the seed itself (its permutation is shared by the ranks); the
    workers' streams differ per rank, as upstream's do: per global rank, so that the processes of several hosts
    (each with its local ranks 0, 1, ...) draw streams of their own, and a launch repeats its single-host run."""
    import torch
    from torch.utils.data import DistributedSampler, RandomSampler
    rank = torch.distributed.get_rank() if local_rank >= 0 and torch.distributed.is_initialized() else 0
    generator = torch.Generator()
    generator.manual_seed(seed + rank)
    sampler = loader.sampler if isinstance(loader.sampler, DistributedSampler) else None
    if sampler is not None:
        sampler.seed = seed
    return type(loader)(loader.dataset, batch_size=loader.batch_size, shuffle=isinstance(loader.sampler, RandomSampler),
                        num_workers=workers, sampler=sampler, pin_memory=loader.pin_memory,
                        collate_fn=loader.collate_fn, worker_init_fn=loader.worker_init_fn, generator=generator)


def check_polygons(data: dict, splits: tuple[str, ...] = ("val",)) -> None:
    """Segmentation needs polygon labels (``class x1 y1 x2 y2 ...``); box-only label files would give
    empty masks and a mask mAP of 0 without a word, so they are refused here."""
    for split in splits:
        labels = label_files(data, split)
        boxes = polygons = 0
        for label in labels:
            if not label.is_file():
                continue
            for line in label.read_text().splitlines():
                n = len(line.split())
                polygons += n > 5
                boxes += n == 5
        if polygons == 0:
            where = labels[0].parent if labels else Path(str(data[split]))
            found = f"{boxes} box labels (class x y w h) and no polygons" if boxes else "no labels"
            raise QATError(f"the '{split}' labels of {data.get('yaml_file', 'the dataset')} ({where}) hold {found}; "
                           "segmentation needs polygon labels (class x1 y1 x2 y2 ...), e.g. upstream's "
                           "coco-segments or scripts/make_shapes_dataset.py --task segment.")


def hyp_argument(value: str | None, task: str = "detect") -> tuple[str, dict | None]:
    """``quantize``'s ``--hyp``: the file used (``"none"`` for no augmentation) and its contents; prints which."""
    default = DEFAULT_HYPS[task] or NO_HYP
    value = value or default
    path = _hyp_path(value)
    hyp = load_hyp(path)
    shown = NO_HYP if path is None else str(path)
    what = "no augmentation of the fine-tuning images" if hyp is None else "augmentation of the fine-tuning images"
    print(f"hyp: {shown} ({what}{'; the default for ' + task if value == default else ''})")
    return shown, hyp


def _hyp_path(value: str | os.PathLike | None) -> Path | None:
    """Where a ``--hyp`` value points: as given, else inside the YOLOv9 tree (``data/hyps/...`` typed from
    another folder, or a bare name as in the reference's ``--hyp hyp.scratch-high.yaml``)."""
    if value is None or str(value).lower() == NO_HYP:
        return None
    path = Path(value)
    if path.is_file():
        return path.resolve()  # recorded in report.json: the file, wherever the run was started
    if not path.is_absolute():
        for inside in (TREE / path, TREE / HYPS / path.name if not path.parent.name else None):
            if inside is not None and inside.is_file():
                return inside
    return path


def load_hyp(path: str | os.PathLike | None) -> dict | None:
    """Hyperparameters for augmentation during QAT (upstream hyp yaml), or None (``None`` or ``"none"``)."""
    path = _hyp_path(path)
    if path is None:
        return None
    if not path.is_file():
        raise QATError(f"hyperparameter file not found: {path}; pass --hyp {DEFAULT_HYPS['detect']}, a yaml of "
                       f"yours, or --hyp {NO_HYP} for no augmentation.")
    hyp = yaml.safe_load(path.read_text())
    if not isinstance(hyp, dict):
        raise QATError(f"{path} is not a hyperparameter yaml (expected key: value pairs such as mosaic: 1.0).")
    return hyp


def images_only(loader, device):
    """Yield float image batches in [0, 1] on ``device`` from an upstream dataloader."""
    for im, *_rest in loader:
        yield im.to(device, non_blocking=True).float() / 255


def labelled(loader, device):
    """Yield ``(images, targets, masks)`` from an upstream dataloader: images as float in [0, 1] on
    ``device``; targets (image index, class, x, y, w, h; normalised) and, from the segmentation loader,
    the instance masks (else None), as the loss functions of upstream's train.py take them."""
    for im, targets, _paths, _shapes, *masks in loader:
        yield im.to(device, non_blocking=True).float() / 255, targets, masks[0] if masks else None


def _split_images(data: dict, split: str) -> list[str]:
    """The absolute paths of a split's images, links kept as links: upstream finds each label by the image's path
    (images/ -> labels/), so a dataset of linked images has its labels beside the links, not beside their targets."""
    entries = data[split] if isinstance(data[split], list) else [data[split]]
    return [os.path.abspath(p) for entry in entries for p in _images(Path(entry))]


def holdout_images(data: dict, fraction: float) -> tuple[list[str], list[str], int]:
    """The training images split for the accuracy budget: ``(fit, held_out, shared)``. ``held_out`` is ``fraction``
    of the training images that are not evaluation images, spread evenly over them in path order (every k-th), so
    the split is the same on every rank and in every run; ``fit`` is the rest of the training images, which
    calibrate and fine-tune; ``shared``: how many training images are evaluation images too (never held out).
    A split that leaves either side empty is a QATError saying what to change."""
    train = _split_images(data, "train")
    evaluation = {os.path.realpath(p) for p in _split_images(data, "val")}  # one file under two names is one image
    shared = sum(os.path.realpath(p) in evaluation for p in train)
    candidates = sorted(p for p in train if os.path.realpath(p) not in evaluation)
    n = round(fraction * len(candidates))
    if len(candidates) < 2 or n < 1 or n >= len(candidates):
        also = f" ({shared} of its {len(train)} training images are evaluation images too)" if shared else ""
        raise QATError(f"--holdout-fraction {fraction:g} of the {len(candidates)} training images of "
                       f"{data.get('yaml_file', 'the dataset')} that are not evaluation images{also} leaves "
                       f"{n} to hold out and {len(candidates) - n} to train on; the budget needs both, so pass a "
                       "dataset with more training images, or another --holdout-fraction.")
    step = len(candidates) / n
    picked = {candidates[int(i * step + step / 2)] for i in range(n)}
    return [p for p in train if p not in picked], [p for p in candidates if p in picked], shared


def holdout_split(data: dict, fraction: float, folder: str | os.PathLike) -> tuple[dict, dict, dict]:
    """:func:`holdout_images` written as upstream's image lists, ``folder/fit.txt`` and ``folder/holdout.txt``.
    Returns ``(fit_data, holdout_data, record)``: ``data`` with ``train`` (the fit images) or ``val`` (the held-out
    ones) pointing at the lists, and what the split was."""
    fit, held, shared = holdout_images(data, fraction)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lists = {}
    for name, images in (("fit", fit), ("holdout", held)):
        lists[name] = folder / f"{name}.txt"
        lists[name].write_text("\n".join(images) + "\n")
    record = {"fraction": fraction, "holdout_images": len(held), "fit_images": len(fit),
              "evaluation_images_in_train": shared,
              "rule": "every k-th training image in path order, evaluation images excluded"}
    return {**data, "train": str(lists["fit"])}, {**data, "val": str(lists["holdout"])}, record
