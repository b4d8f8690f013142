#!/usr/bin/env python3
"""Generate the embedded "shapes" detection dataset (YOLO format), deterministically.

Rendered shapes (6 classes: circle, square, triangle, star, cross, ring), filled or outlined, in random
colours, sizes, rotations and positions, several per image with some overlap, on procedural textured
backgrounds (value noise, gradients, stripes, checkers). No third-party images. Boxes are exact: each
is the tight box of the pixels the object covers (coverage >= 0.5), and objects are only placed where
they leave every earlier object's visible extent equal to its box.

With ``--task segment`` the labels are polygons (YOLO segmentation format: ``class x1 y1 x2 y2 ...``,
normalised): shapes are drawn filled and never overlap, so each object's outline is known exactly: the
shape's own vertices, a 64-gon for circles (within 0.1 px of the drawn edge at the largest size), and
for rings a "keyhole" polygon (outer circle, a zero-width cut, inner circle backwards) that fills as
the annulus.

    python3 scripts/make_shapes_dataset.py --out DIR [--seed 0] [--train 320] [--val 64] [--imgsz 256] [--jobs 4]
                                          [--task segment]

Writes DIR/images/{train,val}/*.png, DIR/labels/{train,val}/*.txt and DIR/shapes.yaml (absolute
``path``). Every image is drawn from its own random stream keyed by (seed, split, index): the same seed
gives byte-identical files, and image i of a split is the same whatever the split sizes are (so the
val split does not change when --train changes). The dataset is built in a temporary folder beside
DIR and renamed into place: DIR is never left half-written. Needs numpy and opencv only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np

NAMES = ("circle", "square", "triangle", "star", "cross", "ring")
SPLITS = {"train": 1, "val": 2}
TASKS = ("detect", "segment")
CIRCLE_VERTICES = 64
VERSION = 1  # bump when the rendering changes (the weights README names the version it was trained on)


# ----------------------------------------------------------------------------------------------- geometry
def _polygon(cls: str, size: float, rng: np.random.Generator) -> np.ndarray:
    """Vertices (N, 2) of a polygonal shape centred on the origin, about ``size`` across."""
    r = size / 2
    if cls == "square":
        ax = rng.uniform(0.85, 1.15)
        pts = np.array([[-1, -1], [1, -1], [1, 1], [-1, 1]], dtype=np.float64) * [r * ax, r / ax] * 0.75
    elif cls == "triangle":
        a0 = -math.pi / 2
        pts = np.array([[r * math.cos(a0 + k * 2 * math.pi / 3), r * math.sin(a0 + k * 2 * math.pi / 3)]
                        for k in range(3)])
    elif cls == "star":
        inner = rng.uniform(0.38, 0.5)
        pts = np.array([[(r if k % 2 == 0 else r * inner) * math.cos(-math.pi / 2 + k * math.pi / 5),
                         (r if k % 2 == 0 else r * inner) * math.sin(-math.pi / 2 + k * math.pi / 5)]
                        for k in range(10)])
    elif cls == "cross":
        t = rng.uniform(0.15, 0.22) * size  # half arm thickness
        q = r * 0.9
        pts = np.array([[-t, -q], [t, -q], [t, -t], [q, -t], [q, t], [t, t], [t, q], [-t, q], [-t, t], [-q, t],
                        [-q, -t], [-t, -t]], dtype=np.float64)
    else:
        raise ValueError(cls)
    theta = rng.uniform(0, 2 * math.pi)
    c, s = math.cos(theta), math.sin(theta)
    return pts @ np.array([[c, s], [-s, c]])


def _polygon_sdf(px: np.ndarray, py: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """Signed distance (pixels, negative inside) from points (px, py) to the polygon ``pts``."""
    d = np.full(px.shape, np.inf)
    inside = np.zeros(px.shape, dtype=bool)
    n = len(pts)
    for i in range(n):
        (x0, y0), (x1, y1) = pts[i], pts[(i + 1) % n]
        ex, ey = x1 - x0, y1 - y0
        t = np.clip(((px - x0) * ex + (py - y0) * ey) / (ex * ex + ey * ey), 0.0, 1.0)
        dx, dy = px - (x0 + t * ex), py - (y0 + t * ey)
        d = np.minimum(d, dx * dx + dy * dy)
        crosses = (y0 > py) != (y1 > py)
        with np.errstate(divide="ignore", invalid="ignore"):
            xint = x0 + (py - y0) * ex / np.where(ey == 0, 1.0, ey)
        inside ^= crosses & (px < xint)
    d = np.sqrt(d)
    return np.where(inside, -d, d)


def _circle(radius: float, n: int = CIRCLE_VERTICES) -> np.ndarray:
    a = np.arange(n) * (2 * math.pi / n)
    return np.stack([np.cos(a), np.sin(a)], 1) * radius


def _shape(cls: str, size: float, rng: np.random.Generator, filled: bool = False):
    """A function (px, py) -> coverage in [0, 1] (1 px anti-aliased edge), its half-extent bound, and its
    outline polygon (None for outlined shapes). ``filled`` draws no outlined variants."""
    r = size / 2
    outlined = cls in ("square", "triangle", "star", "cross") and rng.random() < 0.4 and not filled
    stroke = max(2.5, rng.uniform(0.1, 0.16) * size)
    if cls == "circle":
        outline = _circle(r)

        def sdf(px, py):
            return np.sqrt(px * px + py * py) - r
    elif cls == "ring":
        inner = rng.uniform(0.45, 0.62) * r
        mid, half = (r + inner) / 2, (r - inner) / 2
        outer_pts = _circle(r)
        outline = np.concatenate([outer_pts, outer_pts[:1], _circle(inner)[::-1], _circle(inner)[:1]])  # keyhole

        def sdf(px, py):
            return np.abs(np.sqrt(px * px + py * py) - mid) - half
    else:
        pts = outline = _polygon(cls, size, rng)

        def sdf(px, py):
            return _polygon_sdf(px, py, pts)
    if outlined:
        base, outline = sdf, None

        def sdf(px, py):  # noqa: F811 - stroke centred on the outline
            return np.abs(base(px, py)) - stroke / 2
    bound = r + stroke + 2
    return (lambda px, py: np.clip(0.5 - sdf(px, py), 0.0, 1.0)), bound, outline


# -------------------------------------------------------------------------------------------- backgrounds
def _upsample(grid: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear upsampling of a (gh, gw) grid to (h, w), in numpy (identical on every platform)."""
    gh, gw = grid.shape
    y = np.linspace(0, gh - 1, h)
    x = np.linspace(0, gw - 1, w)
    y0 = np.minimum(np.floor(y).astype(int), gh - 2)
    x0 = np.minimum(np.floor(x).astype(int), gw - 2)
    fy, fx = (y - y0)[:, None], (x - x0)[None, :]
    a, b = grid[y0][:, x0], grid[y0][:, x0 + 1]
    c, d = grid[y0 + 1][:, x0], grid[y0 + 1][:, x0 + 1]
    return (a * (1 - fx) + b * fx) * (1 - fy) + (c * (1 - fx) + d * fx) * fy


def _colour(rng: np.random.Generator, lo: float = 0.0, hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, 3)


def _texture(rng: np.random.Generator, s: int) -> np.ndarray:
    """One procedural texture in [0, 1], shape (s, s)."""
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float64)
    kind = rng.integers(0, 4)
    if kind == 0:  # multi-octave value noise
        t = np.zeros((s, s))
        amp, total = 1.0, 0.0
        for g in (rng.integers(3, 6), rng.integers(8, 14), rng.integers(20, 40)):
            t += amp * _upsample(rng.random((g, g)), s, s)
            total += amp
            amp *= 0.5
        t /= total
        return (t - t.min()) / max(t.max() - t.min(), 1e-6)
    if kind == 1:  # linear gradient
        th = rng.uniform(0, 2 * math.pi)
        t = xx * math.cos(th) + yy * math.sin(th)
        return (t - t.min()) / max(t.max() - t.min(), 1e-6)
    if kind == 2:  # stripes, soft or hard
        th = rng.uniform(0, math.pi)
        period = rng.uniform(6, 40)
        t = 0.5 + 0.5 * np.sin(2 * math.pi * (xx * math.cos(th) + yy * math.sin(th)) / period + rng.uniform(0, 6.3))
        return (t > 0.5).astype(np.float64) if rng.random() < 0.5 else t
    cell = int(rng.integers(6, 33))  # checker
    return (((xx // cell) + (yy // cell)) % 2).astype(np.float64)


def _background(rng: np.random.Generator, s: int) -> np.ndarray:
    base = _colour(rng, 0.1, 0.9)
    img = np.broadcast_to(base, (s, s, 3)).copy()
    for _ in range(int(rng.integers(1, 3))):
        delta = rng.uniform(-0.35, 0.35, 3)
        img += _texture(rng, s)[..., None] * delta
    return np.clip(img, 0.0, 1.0)


# ---------------------------------------------------------------------------------------------- rendering
def _bbox(mask: np.ndarray):
    ys, xs = np.nonzero(mask)
    if len(xs) == 0:
        return None
    return int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1  # x0, y0, x1, y1 (exclusive)


def render(seed: int, split: str, index: int, s: int, task: str = "detect"):
    """Image (s, s, 3) uint8 RGB and its labels in pixels: ``[(cls, x0, y0, x1, y1)]`` for ``detect``,
    ``[(cls, polygon (N, 2))]`` for ``segment`` (filled shapes that do not overlap)."""
    img, labels, _ = render_with_owner(seed, split, index, s, task)
    return img, labels


def render_with_owner(seed: int, split: str, index: int, s: int, task: str = "detect"):
    """:func:`render`, plus the (s, s) map of which object each pixel shows (-1: background)."""
    segment = task == "segment"
    rng = np.random.default_rng([VERSION, seed, SPLITS[split], index] + ([1] if segment else []))
    img = _background(rng, s)
    smin, smax = 24 * s / 256, 120 * s / 256
    owner = np.full((s, s), -1, dtype=np.int32)  # which object each pixel shows (coverage >= 0.5)
    objects = []  # (cls, box)
    outlines = []  # segment: polygons in image pixels
    for _ in range(int(rng.integers(2, 7))):
        cls = int(rng.integers(0, len(NAMES)))
        for _attempt in range(30):
            size = float(math.exp(rng.uniform(math.log(smin), math.log(smax))))
            cover_fn, bound, outline = _shape(NAMES[cls], size, rng, filled=segment)
            cx, cy = rng.uniform(bound, s - bound, 2) if s > 2 * bound else (s / 2, s / 2)
            wx0, wy0 = max(int(cx - bound), 0), max(int(cy - bound), 0)
            wx1, wy1 = min(int(cx + bound) + 2, s), min(int(cy + bound) + 2, s)
            py, px = np.mgrid[wy0:wy1, wx0:wx1].astype(np.float64)
            cov = cover_fn(px + 0.5 - cx, py + 0.5 - cy)
            local = cov >= 0.5
            box = _bbox(local)
            if box is None:
                continue
            box = (box[0] + wx0, box[1] + wy0, box[2] + wx0, box[3] + wy0)
            if box[0] < 1 or box[1] < 1 or box[2] > s - 1 or box[3] > s - 1:
                continue
            new = np.zeros((s, s), dtype=bool)
            new[wy0:wy1, wx0:wx1] = local
            if segment and any(_near(box, b) for _, b in objects):
                continue  # polygons stay exact only where nothing covers them
            if not _keeps_others(owner, new, objects, box):
                continue
            # colour that stands out from the background under the object
            under = img[wy0:wy1, wx0:wx1][local].mean(0)
            col = _contrasting(rng, under)
            a = cov[..., None]
            img[wy0:wy1, wx0:wx1] = img[wy0:wy1, wx0:wx1] * (1 - a) + col * a
            owner[new] = len(objects)
            objects.append((cls, box))
            if segment:
                outlines.append(outline + (cx, cy))
            break
    img = img + rng.normal(0.0, rng.uniform(0.0, 0.04), img.shape)  # sensor-like noise
    img = np.clip(np.rint(img * 255), 0, 255).astype(np.uint8)
    if segment:
        return img, [(c, poly) for (c, _), poly in zip(objects, outlines)], owner
    return img, [(c, *b) for c, b in objects], owner


def _near(a, b, gap: int = 2) -> bool:
    """Boxes ``a`` and ``b`` (x0, y0, x1, y1) overlap or come closer than ``gap`` pixels."""
    return not (a[0] >= b[2] + gap or b[0] >= a[2] + gap or a[1] >= b[3] + gap or b[1] >= a[3] + gap)


def _keeps_others(owner: np.ndarray, new: np.ndarray, objects, box) -> bool:
    """Placing ``new`` must leave each earlier object >= 70% visible with an unchanged visible box."""
    for j, (_, (x0, y0, x1, y1)) in enumerate(objects):
        if box[0] >= x1 or box[2] <= x0 or box[1] >= y1 or box[3] <= y0:
            continue
        mine = owner[y0:y1, x0:x1] == j
        left = mine & ~new[y0:y1, x0:x1]
        if left.sum() < 0.7 * mine.sum():
            return False
        b = _bbox(left)
        if b is None or b != (0, 0, x1 - x0, y1 - y0):
            return False
    return True


def _contrasting(rng: np.random.Generator, under: np.ndarray) -> np.ndarray:
    lum = np.array([0.299, 0.587, 0.114])
    for _ in range(30):
        col = _colour(rng)
        if abs(float((col - under) @ lum)) >= 0.22 and float(np.abs(col - under).max()) >= 0.35:
            return col
    return np.zeros(3) if float(under @ lum) > 0.5 else np.ones(3)


# ------------------------------------------------------------------------------------------------- output
def _encode(job):
    """(seed, split, index, imgsz, task) -> (file stem, PNG bytes, label text)."""
    seed, split, i, imgsz, task = job
    img, labels = render(seed, split, i, imgsz, task)
    ok, buf = cv2.imencode(".png", img[..., ::-1], [cv2.IMWRITE_PNG_COMPRESSION, 3])
    if not ok:
        raise RuntimeError(f"PNG encoding failed for {split} image {i}")
    if task == "segment":
        text = "".join(f"{c} " + " ".join(f"{v / imgsz:.6f}" for v in poly.reshape(-1)) + "\n" for c, poly in labels)
    else:
        text = "".join(f"{c} {(x0 + x1) / 2 / imgsz:.6f} {(y0 + y1) / 2 / imgsz:.6f} "
                       f"{(x1 - x0) / imgsz:.6f} {(y1 - y0) / imgsz:.6f}\n" for c, x0, y0, x1, y1 in labels)
    return f"{split}_{i:06d}", buf.tobytes(), text


def write_dataset(out: Path, seed: int = 0, n_train: int = 320, n_val: int = 64, imgsz: int = 256,
                  jobs: int = 1, task: str = "detect") -> Path:
    """Generate the dataset into ``out`` (replaced atomically); returns the data yaml's path.

    ``jobs`` > 1 renders in that many processes; the files are the same whatever ``jobs`` is.
    ``task="segment"`` writes polygon labels (a different set of images than ``detect``).
    """
    if imgsz < 128:
        raise ValueError("--imgsz must be at least 128")
    if task not in TASKS:
        raise ValueError(f"--task must be one of {', '.join(TASKS)}")
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    pool = None
    try:
        tasks = [(seed, split, i, imgsz, task) for split, n in (("train", n_train), ("val", n_val)) for i in range(n)]
        for split in SPLITS:
            (tmp / "images" / split).mkdir(parents=True)
            (tmp / "labels" / split).mkdir(parents=True)
        if jobs > 1 and len(tasks) > 1:
            import multiprocessing
            pool = multiprocessing.get_context("spawn" if sys.platform == "win32" else "fork").Pool(jobs)
            results = pool.imap(_encode, tasks, chunksize=8)
        else:
            results = map(_encode, tasks)
        for (_, split, *_), (stem, png, text) in zip(tasks, results):
            (tmp / "images" / split / f"{stem}.png").write_bytes(png)
            (tmp / "labels" / split / f"{stem}.txt").write_text(text)
        names = "".join(f"  {i}: {n}\n" for i, n in enumerate(NAMES))
        (tmp / "shapes.yaml").write_text(
            f"# Shapes dataset v{VERSION}: python3 scripts/make_shapes_dataset.py --seed {seed} --train {n_train} "
            f"--val {n_val} --imgsz {imgsz}{' --task segment' if task == 'segment' else ''}\n"
            f"path: {json.dumps(str(out))}\ntrain: images/train\nval: images/val\nnc: {len(NAMES)}\nnames:\n{names}")
        os.chmod(tmp, 0o755)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    return out / "shapes.yaml"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="dataset folder to create (replaced if it exists)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train", type=int, default=320, help="number of train images")
    p.add_argument("--val", type=int, default=64, help="number of val images")
    p.add_argument("--imgsz", type=int, default=256, help="image side in pixels (square images)")
    p.add_argument("--task", choices=TASKS, default="detect",
                   help="detect: box labels; segment: polygon labels (filled, non-overlapping shapes)")
    p.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1),
                   help="processes to render with (output is the same for any value)")
    return p


def main(argv=None) -> int:
    args = get_args_parser().parse_args(argv)
    for flag, value, low in (("--train", args.train, 1), ("--val", args.val, 1), ("--imgsz", args.imgsz, 32),
                             ("--seed", args.seed, 0), ("--jobs", args.jobs, 1)):
        if value < low:  # the wording of utils/qat/core/validate.py (this script runs before any tree is patched)
            print(f"error: {flag} {value} is out of range: it must be at least {low}.", file=sys.stderr)
            return 2
    try:
        yaml_path = write_dataset(Path(args.out), args.seed, args.train, args.val, args.imgsz, args.jobs,
                                  args.task)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kind = "segmentation" if args.task == "segment" else "detection"
    print(f"shapes {kind} dataset: {args.train} train + {args.val} val images ({args.imgsz}px, seed {args.seed}) "
          f"-> {yaml_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
