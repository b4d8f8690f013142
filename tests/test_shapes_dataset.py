"""The embedded shapes dataset (scripts/make_shapes_dataset.py): deterministic, valid, loadable upstream."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import upstream_config_dir

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "make_shapes_dataset.py"
N_TRAIN, N_VAL, IMGSZ = 12, 4, 256


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_shapes_dataset", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gen = _load_generator()


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path; shapes.yaml without its (location-dependent) path line."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "shapes.yaml":
                data = b"\n".join(line for line in data.splitlines() if not line.startswith(b"path:"))
            out[str(p.relative_to(root))] = data
    return out


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Made through the CLI, the way users make it (2 processes)."""
    out = tmp_path_factory.mktemp("shapes") / "shapes"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--seed", "0", "--train", str(N_TRAIN),
                        "--val", str(N_VAL), "--imgsz", str(IMGSZ), "--jobs", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def test_same_seed_gives_identical_bytes(dataset, tmp_path):
    again = tmp_path / "again"
    gen.write_dataset(again, seed=0, n_train=N_TRAIN, n_val=N_VAL, imgsz=IMGSZ, jobs=1)
    a, b = _files(dataset), _files(again)
    assert a.keys() == b.keys()
    assert [k for k in a if a[k] != b[k]] == []


def test_other_seed_differs_and_val_split_ignores_train_size(dataset, tmp_path):
    other = gen.write_dataset(tmp_path / "other", seed=1, n_train=2, n_val=2, imgsz=IMGSZ).parent
    assert (other / "images/val/val_000000.png").read_bytes() != (dataset / "images/val/val_000000.png").read_bytes()
    fewer = gen.write_dataset(tmp_path / "fewer", seed=0, n_train=3, n_val=N_VAL, imgsz=IMGSZ).parent
    for split in ("images/val", "labels/val"):
        assert _files(fewer / split) == _files(dataset / split)
    full = _files(dataset / "images/train")
    assert all(full[k] == v for k, v in _files(fewer / "images/train").items())  # train i is train i


def test_counts_and_labels_are_valid(dataset):
    import cv2
    nc = len(gen.NAMES)
    for split, n in (("train", N_TRAIN), ("val", N_VAL)):
        images = sorted((dataset / "images" / split).glob("*.png"))
        labels = sorted((dataset / "labels" / split).glob("*.txt"))
        assert len(images) == n and len(labels) == n
        assert [p.stem for p in images] == [p.stem for p in labels]
        for img_path, lab_path in zip(images, labels):
            img = cv2.imread(str(img_path))
            assert img is not None and img.shape == (IMGSZ, IMGSZ, 3)
            rows = [line.split() for line in lab_path.read_text().splitlines()]
            assert 1 <= len(rows) <= 6, lab_path
            for row in rows:
                assert len(row) == 5, lab_path
                c = int(row[0])
                x, y, w, h = map(float, row[1:])
                assert 0 <= c < nc
                assert w * IMGSZ >= 8 and h * IMGSZ >= 8  # learnable, not slivers
                assert 0 <= x - w / 2 and x + w / 2 <= 1 and 0 <= y - h / 2 and y + h / 2 <= 1


def test_render_boxes_in_pixels():
    """render() gives integer pixel boxes inside the image, objects about 24-120 px across."""
    img, labels = gen.render(0, "val", 0, IMGSZ)
    assert labels
    for c, x0, y0, x1, y1 in labels:
        assert 0 <= c < len(gen.NAMES) and 0 < x0 < x1 < IMGSZ and 0 < y0 < y1 < IMGSZ
        assert 24 * 0.6 <= max(x1 - x0, y1 - y0) <= 125


def test_rewrite_is_atomic(tmp_path, monkeypatch):
    out = tmp_path / "ds"
    gen.write_dataset(out, seed=0, n_train=2, n_val=1, imgsz=IMGSZ)
    before = _files(out)
    calls = {"n": 0}
    real = gen.render

    def failing(*args):
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("disk full")
        return real(*args)

    monkeypatch.setattr(gen, "render", failing)
    with pytest.raises(RuntimeError):
        gen.write_dataset(out, seed=5, n_train=4, n_val=1, imgsz=IMGSZ)
    assert _files(out) == before  # the old dataset is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # no temp folders left behind
    monkeypatch.undo()
    gen.write_dataset(out, seed=1, n_train=2, n_val=1, imgsz=IMGSZ)  # replacing an existing dataset works
    assert _files(out) != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_cli_rejects_bad_sizes(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x"), "--train", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error:")
    assert not (tmp_path / "x").exists()


def test_yaml_loads_with_upstream_check_dataset(yolov9_tree, dataset, tmp_path, monkeypatch):
    from utils import general
    # check_dataset ends by downloading Arial.ttf into upstream's config dir when it is missing (no network
    # here, and no toolkit command calls check_dataset): give it a config dir that holds the font.
    upstream_config_dir(tmp_path / "config")
    monkeypatch.setattr(general, "CONFIG_DIR", tmp_path / "config")
    data = general.check_dataset(str(dataset / "shapes.yaml"), autodownload=False)
    assert data["nc"] == len(gen.NAMES)
    assert list(data["names"].values()) == list(gen.NAMES)
    assert Path(data["train"]) == dataset / "images" / "train"
    assert Path(data["val"]) == dataset / "images" / "val"
    assert Path(data["val"]).is_dir()


def test_generated_image_pixels_match_render(dataset):
    import cv2
    img, _ = gen.render(0, "train", 3, IMGSZ)
    on_disk = cv2.imread(str(dataset / "images/train/train_000003.png"))[..., ::-1]
    assert np.array_equal(img, on_disk)
