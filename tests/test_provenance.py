"""Provenance (utils/qat/core/provenance.py): the sha256 of a weights file, and the toolkit commit that patch_yolov9.sh
records in a tree's manifest when it installs from a git clone. report.json, checkpoints and `qat.py eval` are
checked in tests/test_qat_cli.py on its run."""
from __future__ import annotations

import hashlib
import shutil
import subprocess

import pytest

from conftest import REPO
from test_patcher import MANIFEST, make_fake_repo, make_fake_tree, patch, read_manifest

QS = REPO / "weights" / "gelan-qs-shapes.pt"


def test_sha256_reads_in_chunks(tmp_path):
    from utils.qat.core.provenance import sha256
    data = bytes(range(256)) * 14 + b"tail"  # 3.5 chunks of 1024 bytes and a few over
    path = tmp_path / "w.pt"
    path.write_bytes(data)
    assert sha256(path, chunk=1024) == hashlib.sha256(data).hexdigest()
    assert sha256(QS) == hashlib.sha256(QS.read_bytes()).hexdigest()


def test_record():
    from utils.qat import __version__
    from utils.qat.core.provenance import record, toolkit_commit
    assert record() == {"toolkit_version": __version__, "toolkit_commit": toolkit_commit()}
    assert record(QS) == {"weights": str(QS), "weights_sha256": hashlib.sha256(QS.read_bytes()).hexdigest(),
                          "toolkit_version": __version__, "toolkit_commit": toolkit_commit()}


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_commit_of_the_test_tree(yolov9_tree):
    """The session's tree was patched from this repository: it names the repository's HEAD (-dirty while overlay
    files have uncommitted changes), or nothing where the repository is not a git clone."""
    from utils.qat.core.provenance import TREE, toolkit_commit
    assert TREE == yolov9_tree
    if shutil.which("git") is None or not (REPO / ".git").exists():
        assert toolkit_commit() is None
        return
    head = _git(REPO, "rev-parse", "HEAD")
    dirty = _git(REPO, "status", "--porcelain", "--", "models", "utils", "scripts", "segment", ":(glob)*.py")
    assert toolkit_commit() == head + ("-dirty" if dirty else "")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_patcher_records_the_commit(tmp_path):
    """Installed from a git clone: every manifest line's version is 9.9.9+g<commit>, which toolkit_commit reads;
    an uncommitted change to an overlay file marks it .dirty (-dirty); a copy without git records the plain
    version and no commit (tests/test_patcher.py), and so does a copy inside another repository."""
    from utils.qat.core.provenance import toolkit_commit
    repo, tree = make_fake_repo(tmp_path / "repo"), make_fake_tree(tmp_path / "yolov9")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "toolkit")
    head = _git(repo, "rev-parse", "HEAD")
    assert patch(tree, repo=repo).returncode == 0
    assert {row[2] for row in read_manifest(tree)} == {f"9.9.9+g{head}"}
    assert toolkit_commit(tree) == head

    (repo / "utils/qat/tool.py").write_text("TOOL = 2\n")
    again = make_fake_tree(tmp_path / "yolov9-again")
    assert patch(again, repo=repo).returncode == 0
    assert toolkit_commit(again) == f"{head}-dirty"

    inner = make_fake_repo(repo / "vendored")  # a plain copy that happens to lie inside another clone
    third = make_fake_tree(tmp_path / "yolov9-third")
    assert patch(third, repo=inner).returncode == 0
    assert {row[2] for row in read_manifest(third)} == {"9.9.9"} and toolkit_commit(third) is None
    assert toolkit_commit(tmp_path) is None and not (tmp_path / MANIFEST).exists()  # no manifest at all
