"""patch_yolov9.sh: install, re-run, check, uninstall, and every refusal, on real files.

Most cases use a small fake toolkit (a copy of patch_yolov9.sh beside a few overlay files) and a
small fake YOLOv9 tree, so that the overlay can be changed between runs. Idempotency and the
byte-for-byte uninstall also run on a copy of the real tree from ``YOLOV9_DIR`` with this
repository's real overlay.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCHER = REPO / "patch_yolov9.sh"
MANIFEST = ".yolov9-qat-manifest"
UPSTREAM_MARKERS = ["models/yolo.py", "models/common.py", "models/experimental.py", "utils/general.py", "val.py"]

# A fake toolkit: overlay files, and files that must never be copied.
FAKE_OVERLAY = {
    "qat.py": "print('qat')\n",
    "models/quantize.py": "QUANTIZE = 1\n",
    "utils/qat/__init__.py": '"""fake toolkit."""\n__version__ = "9.9.9"\n',
    "utils/qat/tool.py": "TOOL = 1\n",
    "utils/qat/old.py": "OLD = 1\n",
    "scripts/run_qat.sh": "#!/bin/sh\necho run\n",
    "segment/qat_seg.py": "SEG = 1\n",
}
FAKE_NOT_OVERLAY = {
    "tests/test_x.py": "def test(): pass\n",
    "docs/x.md": "# doc\n",
    "benchmarks/b.py": "B = 1\n",
    ".ci/run": "exit 0\n",
    "README.md": "# readme\n",
    "requirements.txt": "onnx\n",
    "install_dependencies.sh": "#!/bin/sh\n",
    "utils/qat/__pycache__/tool.cpython-311.pyc": "junk",
    "models/stray.pyc": "junk",
}
# A fake upstream tree: what the patcher checks for, plus a few neighbours.
FAKE_UPSTREAM = {
    "models/yolo.py": "# yolo\n",
    "models/common.py": "# common\n",
    "models/experimental.py": "# experimental\n",
    "models/__init__.py": "",
    "utils/__init__.py": "",
    "utils/general.py": "# general\n",
    "utils/metrics.py": "# metrics\n",
    "val.py": "# val\n",
    "export.py": "# export\n",
    "scripts/get_coco.sh": "#!/bin/bash\n",
}


def write_files(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def make_fake_repo(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PATCHER, root / "patch_yolov9.sh")
    write_files(root, FAKE_OVERLAY)
    write_files(root, FAKE_NOT_OVERLAY)
    (root / "scripts/run_qat.sh").chmod(0o755)
    return root


def make_fake_tree(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    write_files(root, FAKE_UPSTREAM)
    return root


@pytest.fixture
def fake(tmp_path):
    """(repo, tree): a fake toolkit checkout and a fake upstream tree."""
    return make_fake_repo(tmp_path / "repo"), make_fake_tree(tmp_path / "yolov9")


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file (sha256, mode), directory (mode) and link (target) under ``root``."""
    out: dict[str, tuple] = {".": ("dir", stat.S_IMODE(root.lstat().st_mode))}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", hashlib.sha256(path.read_bytes()).hexdigest(), stat.S_IMODE(st.st_mode))
    return out


def patch(*args, repo: Path = REPO, prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*(prefix or []), "bash", str(repo / "patch_yolov9.sh"), *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def assert_one_error(proc: subprocess.CompletedProcess, *fragments: str, code: int = 1) -> None:
    """Failed with ``code`` and exactly one 'error: ...' sentence on stderr, naming ``fragments``."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and lines[0].endswith("."), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def read_manifest(tree: Path) -> list[list[str]]:
    lines = (tree / MANIFEST).read_text().splitlines()
    assert lines[0].startswith("# yolov9-qat manifest")
    return [line.split("\t") for line in lines[1:]]


def check_statuses(tree: Path, repo: Path) -> tuple[int, dict[str, str]]:
    proc = patch("--check", tree, repo=repo)
    statuses = {}
    for line in proc.stdout.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0] in {"installed", "missing", "modified", "outdated", "unmanaged", "obsolete"}:
            statuses[parts[1]] = parts[0]
    return proc.returncode, statuses


# ---------------------------------------------------------------------------------------------
# The real tree (YOLOV9_DIR) and the real overlay

@pytest.fixture(scope="module")
def upstream_source(tmp_path_factory) -> Path:
    if not os.environ.get("YOLOV9_DIR"):
        pytest.skip("YOLOV9_DIR is not set: the real-tree patcher tests need a YOLOv9 tree")
    src = Path(os.environ["YOLOV9_DIR"]).resolve()
    if not (src / "models" / "yolo.py").is_file():
        pytest.skip(f"YOLOV9_DIR={src} is not a YOLOv9 tree")
    return src


def copy_tree(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, symlinks=True, ignore=shutil.ignore_patterns(".git", "__pycache__", MANIFEST))
    for dirpath, _, _ in os.walk(dest):  # the stand-in carries read-only folders
        os.chmod(dirpath, os.stat(dirpath).st_mode | stat.S_IWUSR)
    return dest


def overlay_of(repo: Path) -> list[str]:
    files = [p.name for p in repo.glob("*.py") if p.is_file() and not p.name.startswith(".")]
    for top in ("models", "utils", "scripts", "segment"):
        for p in (repo / top).rglob("*"):
            rel = p.relative_to(repo)
            if p.is_file() and "__pycache__" not in rel.parts and not any(part.startswith(".") for part in rel.parts) \
                    and p.suffix not in {".pyc", ".pyo"} and not p.name.endswith("~"):
                files.append(rel.as_posix())
    return sorted(files)


def test_real_tree_patch_twice_is_identical_and_uninstall_restores_it(upstream_source, tmp_path):
    pristine = copy_tree(upstream_source, tmp_path / "pristine")
    tree = copy_tree(upstream_source, tmp_path / "yolov9")
    before = snapshot(tree)

    first = patch(tree)
    assert first.returncode == 0, first.stderr
    after_first = snapshot(tree)
    overlay = overlay_of(REPO)
    assert overlay, "this repository has no overlay files"
    for rel in overlay:
        assert (tree / rel).read_bytes() == (REPO / rel).read_bytes(), rel
    assert {row[0] for row in read_manifest(tree) if not row[0].endswith("/")} == set(overlay)
    for rel, entry in before.items():  # upstream files untouched
        if entry[0] == "file":
            assert after_first[rel] == entry, rel

    second = patch(tree)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout
    assert snapshot(tree) == after_first

    check = patch("--check", tree)
    assert check.returncode == 0, check.stdout
    assert "installed and current" in check.stdout

    # Byte-compiled overlay modules (Python writes them on first import) go with their sources.
    py_files = [str(tree / rel) for rel in overlay if rel.endswith(".py")]
    subprocess.run(["python3", "-m", "py_compile", *py_files], capture_output=True)
    removed = patch("--uninstall", tree)
    assert removed.returncode == 0, removed.stderr
    assert snapshot(tree) == snapshot(pristine)


def test_real_tree_with_edits_collision_and_check(upstream_source, tmp_path):
    tree = copy_tree(upstream_source, tmp_path / "yolov9")
    compat = "utils/qat/core/compat.py"
    (tree / compat).parent.mkdir(parents=True)
    (tree / compat).write_text("# someone else's compat.py\n")
    before = snapshot(tree)
    proc = patch(tree)
    assert_one_error(proc, "refusing to patch", compat, "nothing was changed")
    assert snapshot(tree) == before

    shutil.rmtree(tree / "utils/qat")
    assert patch(tree).returncode == 0
    with open(tree / compat, "a") as f:
        f.write("# local tweak\n")
    code, statuses = check_statuses(tree, REPO)
    assert code == 1 and statuses[compat] == "modified"
    kept = patch(tree)
    assert kept.returncode == 0 and f"kept      {compat}" in kept.stdout
    assert (tree / compat).read_text().endswith("# local tweak\n")
    assert patch("--force", tree).returncode == 0
    assert (tree / compat).read_bytes() == (REPO / compat).read_bytes()


# ---------------------------------------------------------------------------------------------
# Fake trees

def test_installs_exactly_the_overlay(fake):
    repo, tree = fake
    before = snapshot(tree)
    proc = patch(tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    for rel, text in FAKE_OVERLAY.items():
        assert (tree / rel).read_text() == text
    for rel in FAKE_NOT_OVERLAY:
        assert not (tree / rel).exists(), rel
    assert os.access(tree / "scripts/run_qat.sh", os.X_OK)
    assert stat.S_IMODE((tree / "models/quantize.py").stat().st_mode) == 0o644
    rows = read_manifest(tree)
    files = {row[0]: row for row in rows if not row[0].endswith("/")}
    assert set(files) == set(FAKE_OVERLAY)
    for rel, (_, sha, version) in files.items():
        assert sha == hashlib.sha256((tree / rel).read_bytes()).hexdigest() and version == "9.9.9"
    assert {row[0] for row in rows if row[0].endswith("/")} == {"utils/qat/", "segment/"}
    after = snapshot(tree)
    for rel, entry in before.items():
        if entry[0] == "file":
            assert after[rel] == entry, rel


def test_patch_twice_leaves_identical_tree(fake):
    repo, tree = fake
    assert patch(tree, repo=repo).returncode == 0
    first = snapshot(tree)
    manifest = (tree / MANIFEST).read_bytes()
    second = patch(tree, repo=repo)
    assert second.returncode == 0, second.stderr
    assert "up to date" in second.stdout
    assert snapshot(tree) == first
    assert (tree / MANIFEST).read_bytes() == manifest


def test_uninstall_restores_upstream_byte_for_byte(fake, tmp_path):
    repo, tree = fake
    pristine = make_fake_tree(tmp_path / "pristine")
    assert patch(tree, repo=repo).returncode == 0
    subprocess.run(["python3", "-m", "py_compile", str(tree / "utils/qat/tool.py"), str(tree / "models/quantize.py")],
                   check=True)
    assert (tree / "models/__pycache__").is_dir()
    proc = patch("--uninstall", tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert snapshot(tree) == snapshot(pristine)
    again = patch("--uninstall", tree, repo=repo)
    assert again.returncode == 0 and "nothing to uninstall" in again.stdout


def test_uninstall_keeps_directories_holding_user_files(fake):
    repo, tree = fake
    assert patch(tree, repo=repo).returncode == 0
    (tree / "utils/qat/mine.txt").write_text("mine\n")
    proc = patch("--uninstall", tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert "kept      utils/qat/" in proc.stdout
    assert sorted(p.name for p in (tree / "utils/qat").iterdir()) == ["mine.txt"]
    assert not (tree / "segment").exists() and not (tree / MANIFEST).exists()


def test_missing_dir_fails(fake, tmp_path):
    repo, _ = fake
    proc = patch(tmp_path / "nowhere", repo=repo)
    assert_one_error(proc, str(tmp_path / "nowhere"), "does not exist")
    assert not (tmp_path / "nowhere").exists()


def test_not_a_directory_fails(fake, tmp_path):
    repo, _ = fake
    path = tmp_path / "file.txt"
    path.write_text("x\n")
    proc = patch(path, repo=repo)
    assert_one_error(proc, str(path), "is not a directory")
    assert path.read_text() == "x\n"


def test_not_yolov9_names_what_is_missing(fake, tmp_path):
    repo, _ = fake
    other = tmp_path / "other"
    write_files(other, {"models/yolo.py": "", "utils/general.py": "", "README.md": "x"})
    before = snapshot(other)
    proc = patch(other, repo=repo)
    assert_one_error(proc, "is not a YOLOv9 tree", "models/common.py, models/experimental.py, val.py")
    assert "models/yolo.py" not in proc.stderr
    assert snapshot(other) == before
    assert_one_error(patch("--check", other, repo=repo), "is not a YOLOv9 tree")
    assert_one_error(patch("--uninstall", other, repo=repo), "is not a YOLOv9 tree")


def _world_readable_fake() -> tuple[Path, Path, Path]:
    """A fake repo and tree that an unprivileged user can read (pytest's tmp dirs are 0700)."""
    base = Path(tempfile.mkdtemp(prefix="yolov9-qat-ro-"))
    base.chmod(0o755)
    return base, make_fake_repo(base / "repo"), make_fake_tree(base / "yolov9")


def _make_read_only(root: Path) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def test_read_only_dir_as_unprivileged_user():
    base, repo, tree = _world_readable_fake()
    try:
        _make_read_only(tree)
        prefix: list[str] = []
        if os.geteuid() == 0:
            setpriv = shutil.which("setpriv")
            if not setpriv:
                pytest.skip("running as root without setpriv: cannot run the patcher as an unprivileged user")
            prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
            probe = subprocess.run([*prefix, "true"], capture_output=True)
            if probe.returncode != 0:
                pytest.skip(f"setpriv cannot switch to an unprivileged user here: {probe.stderr.decode().strip()}")
        before = snapshot(tree)
        proc = patch(tree, repo=repo, prefix=prefix)
        assert_one_error(proc, "cannot write to", str(tree), "nothing was changed")
        assert snapshot(tree) == before
        proc = patch("--uninstall", tree, repo=repo, prefix=prefix)
        assert proc.returncode == 0 and "nothing to uninstall" in proc.stdout  # nothing to write
    finally:
        for dirpath, _, _ in os.walk(base):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(base)


@pytest.mark.parametrize("immutable", [".", "utils"], ids=["tree-root", "subdir"])
def test_read_only_dir_even_for_root(fake, immutable):
    """chattr +i makes a directory read-only for root too: every target directory is probed first."""
    repo, tree = fake
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root; the unprivileged read-only case is tested above")
    chattr = shutil.which("chattr")
    target = (tree / immutable).resolve()
    if not chattr or subprocess.run([chattr, "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available on this file system")
    try:
        before = snapshot(tree)
        proc = patch(tree, repo=repo)
        assert_one_error(proc, "cannot write to", str(target), "nothing was changed")
        assert snapshot(tree) == before
    finally:
        subprocess.run([chattr, "-i", str(target)], check=True)


@pytest.mark.parametrize("identical", [False, True], ids=["different", "identical"])
def test_collision_with_upstream_file_is_refused(fake, identical):
    repo, tree = fake
    # The colliding path sorts last, so refusing it proves nothing was copied before the check.
    text = FAKE_OVERLAY["utils/qat/tool.py"] if identical else "# upstream's own tool.py\n"
    write_files(tree, {"utils/qat/tool.py": text})
    before = snapshot(tree)
    proc = patch(tree, repo=repo)
    assert_one_error(proc, "refusing to patch", "utils/qat/tool.py", "not installed by yolov9-qat",
                     "nothing was changed")
    assert snapshot(tree) == before
    code, statuses = check_statuses(tree, repo)
    assert code == 1 and statuses["utils/qat/tool.py"] == "unmanaged" and statuses["qat.py"] == "missing"


def test_file_in_the_way_of_an_overlay_directory_is_refused(fake):
    repo, tree = fake
    (tree / "segment").write_text("not a directory\n")
    before = snapshot(tree)
    proc = patch(tree, repo=repo)
    assert_one_error(proc, "segment (a file where the overlay needs a directory)")
    assert snapshot(tree) == before


def test_overlay_never_overwrites_an_upstream_name(fake):
    repo, tree = fake
    write_files(repo, {"utils/general.py": "# a toolkit file named like upstream's\n"})
    before = snapshot(tree)
    assert_one_error(patch(tree, repo=repo), "utils/general.py", "nothing was changed")
    assert snapshot(tree) == before


def test_edited_file_is_kept_and_force_overwrites(fake):
    repo, tree = fake
    assert patch(tree, repo=repo).returncode == 0
    edited = tree / "utils/qat/tool.py"
    edited.write_text("TOOL = 2  # my tweak\n")

    # Same toolkit version: the edit is reported and kept, the run succeeds.
    proc = patch(tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert "kept      utils/qat/tool.py" in proc.stdout
    assert edited.read_text() == "TOOL = 2  # my tweak\n"
    code, statuses = check_statuses(tree, repo)
    assert code == 1 and statuses["utils/qat/tool.py"] == "modified" and statuses["qat.py"] == "installed"

    # A new toolkit version changes that file too: refused as a whole, nothing changed.
    write_files(repo, {"utils/qat/tool.py": "TOOL = 3\n", "qat.py": "print('qat v2')\n"})
    before = snapshot(tree)
    proc = patch(tree, repo=repo)
    assert_one_error(proc, "you edited utils/qat/tool.py", "--force", "nothing was changed")
    assert snapshot(tree) == before

    proc = patch("--force", tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert edited.read_text() == "TOOL = 3\n" and (tree / "qat.py").read_text() == "print('qat v2')\n"
    assert check_statuses(tree, repo)[0] == 0


def test_update_adds_changes_and_drops_files(fake):
    repo, tree = fake
    assert patch(tree, repo=repo).returncode == 0
    (tree / "segment/qat_seg.py").write_text("SEG = 'mine'\n")  # edited by the user
    write_files(repo, {"models/quantize.py": "QUANTIZE = 2\n", "utils/qat/new.py": "NEW = 1\n"})
    (repo / "utils/qat/old.py").unlink()
    shutil.rmtree(repo / "segment")

    code, statuses = check_statuses(tree, repo)
    assert code == 1
    assert statuses == {**{rel: "installed" for rel in FAKE_OVERLAY}, "models/quantize.py": "outdated",
                        "utils/qat/new.py": "missing", "utils/qat/old.py": "obsolete",
                        "segment/qat_seg.py": "obsolete"}

    proc = patch(tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert (tree / "models/quantize.py").read_text() == "QUANTIZE = 2\n"
    assert (tree / "utils/qat/new.py").read_text() == "NEW = 1\n"
    assert not (tree / "utils/qat/old.py").exists()
    assert (tree / "segment/qat_seg.py").read_text() == "SEG = 'mine'\n"  # edited: kept, now the user's
    assert "kept      segment/qat_seg.py" in proc.stdout
    listed = {row[0] for row in read_manifest(tree)}
    assert "utils/qat/old.py" not in listed and "segment/qat_seg.py" not in listed
    assert check_statuses(tree, repo)[0] == 0

    proc = patch("--uninstall", tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert (tree / "segment/qat_seg.py").exists() and not (tree / "utils/qat").exists()


def test_unmodified_dropped_files_and_their_new_directories_go(fake):
    repo, tree = fake
    assert patch(tree, repo=repo).returncode == 0
    shutil.rmtree(repo / "segment")
    proc = patch(tree, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert "removed   segment/qat_seg.py" in proc.stdout
    assert not (tree / "segment").exists()
    assert "segment/" not in {row[0] for row in read_manifest(tree)}


def test_uninstall_refuses_edited_files_unless_forced(fake, tmp_path):
    repo, tree = fake
    pristine = make_fake_tree(tmp_path / "pristine")
    assert patch(tree, repo=repo).returncode == 0
    (tree / "models/quantize.py").write_text("QUANTIZE = 'mine'\n")
    before = snapshot(tree)
    proc = patch("--uninstall", tree, repo=repo)
    assert_one_error(proc, "refusing to uninstall", "models/quantize.py", "--force", "nothing was changed")
    assert snapshot(tree) == before
    assert patch("--uninstall", "--force", tree, repo=repo).returncode == 0
    assert snapshot(tree) == snapshot(pristine)


def test_check_reports_each_status(fake):
    repo, tree = fake
    code, statuses = check_statuses(tree, repo)
    assert code == 1 and set(statuses.values()) == {"missing"}
    assert "not installed" in patch("--check", tree, repo=repo).stdout

    assert patch(tree, repo=repo).returncode == 0
    code, statuses = check_statuses(tree, repo)
    assert code == 0 and set(statuses.values()) == {"installed"} and set(statuses) == set(FAKE_OVERLAY)

    (tree / "qat.py").unlink()
    (tree / "utils/qat/tool.py").write_text("edited\n")
    write_files(repo, {"models/quantize.py": "QUANTIZE = 2\n"})
    code, statuses = check_statuses(tree, repo)
    assert code == 1
    assert (statuses["qat.py"], statuses["utils/qat/tool.py"], statuses["models/quantize.py"],
            statuses["segment/qat_seg.py"]) == ("missing", "modified", "outdated", "installed")


@pytest.mark.parametrize("damage", [
    "garbage", "header", "short-sha", "parent-path", "absolute-path", "upstream-path", "duplicate", "empty",
    "directory",
])
def test_damaged_manifest_is_refused(fake, damage):
    repo, tree = fake
    assert patch(tree, repo=repo).returncode == 0
    manifest = tree / MANIFEST
    lines = manifest.read_text().splitlines()
    sha = "0" * 64
    if damage == "garbage":
        lines.append("this is not a manifest line")
    elif damage == "header":
        lines[0] = "# something else"
    elif damage == "short-sha":
        lines[1] = lines[1].replace(lines[1].split("\t")[1], "abc123")
    elif damage == "parent-path":
        lines.append(f"utils/../../outside.py\t{sha}\t9.9.9")
    elif damage == "absolute-path":
        lines.append(f"/etc/passwd\t{sha}\t9.9.9")
    elif damage == "upstream-path":
        lines.append(f"data/coco.yaml\t{sha}\t9.9.9")
    elif damage == "duplicate":
        lines.append(lines[1])
    elif damage == "empty":
        lines = []
    if damage == "directory":
        manifest.unlink()
        manifest.mkdir()
    else:
        manifest.write_text("".join(line + "\n" for line in lines))
    before = snapshot(tree)
    for args in ([tree], ["--check", tree], ["--uninstall", tree], ["--force", tree]):
        proc = patch(*args, repo=repo)
        assert_one_error(proc, "manifest", "is damaged")
        assert snapshot(tree) == before


def test_usage_errors_and_help(fake):
    repo, tree = fake
    proc = patch("--help", repo=repo)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--uninstall" in proc.stdout
    assert_one_error(patch(repo=repo), "missing YOLOV9_DIR", code=2)
    assert_one_error(patch("--bogus", tree, repo=repo), "unknown option --bogus", code=2)
    assert_one_error(patch("--check", "--uninstall", tree, repo=repo), "cannot be combined", code=2)
    assert_one_error(patch(tree, tree, repo=repo), "expected one YOLOV9_DIR", code=2)
    assert not (tree / MANIFEST).exists()


def test_works_from_any_directory_and_with_relative_paths(fake, tmp_path):
    repo, tree = fake
    proc = subprocess.run(["bash", str(repo / "patch_yolov9.sh"), "yolov9/"], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tree / "utils/qat/tool.py").is_file() and (tree / MANIFEST).is_file()
