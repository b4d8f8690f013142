"""Write files so that an interrupted or failed run never leaves a truncated one behind.

:func:`atomic_file` writes into an unnamed file in the destination folder (Linux ``O_TMPFILE``) and links it
into place only once it is complete and synced: Ctrl-C, a full disk or even SIGKILL leave nothing behind
but whole files. Where the filesystem has no unnamed files, and for writers that need a path
(:func:`atomic_path`: ONNX export, engines), a hidden ``.NAME.*.part`` beside the destination is renamed
onto it instead; such a file (``PARTIAL``) can only outlive its run through SIGKILL.

Failures to write (no space, no permission) become a :class:`QATError` naming the file, the cause and the
fix, and saying which files this process saved before (``errors.saved_summary``, also what Ctrl-C prints).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from utils.qat.core.errors import QATError, record_saved, saved_summary

PARTIAL = ".*.part"  # the pattern of the named temporary files (hidden, beside their destination)


def _partial_name(dest: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the result should have the usual permissions
    return Path(tmp)


def _unnamed(folder: Path) -> int | None:
    """A file descriptor of a new unnamed file in ``folder`` (O_TMPFILE), or None where there is none."""
    if not hasattr(os, "O_TMPFILE") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o666)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None  # this filesystem has no unnamed files
        raise


def _link(fd: int, dest: Path) -> None:
    """Give the unnamed file ``fd`` the name ``dest`` (replacing it atomically if it exists). linkat() with
    AT_SYMLINK_FOLLOW on /proc/self/fd/N, as open(2) documents for O_TMPFILE (os.link uses linkat only
    when given a folder descriptor)."""
    source = f"/proc/self/fd/{fd}"
    folder = os.open(dest.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            os.link(source, dest.name, dst_dir_fd=folder, follow_symlinks=True)
            return
        except FileExistsError:
            pass
        tmp = f".{dest.name}.{os.getpid()}.{fd}.part"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=folder)
        os.link(source, tmp, dst_dir_fd=folder, follow_symlinks=True)  # complete: outlives the next line only
        os.replace(tmp, dest.name, src_dir_fd=folder, dst_dir_fd=folder)  # through SIGKILL
    finally:
        os.close(folder)


def write_error(dest: Path, e: OSError) -> QATError:
    """The sentence for a file that could not be written."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        cause, fix = "no space left on the device", "free some space there or write to another disk"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause, fix = e.strerror.lower() if e.strerror else "not writable", "choose a writable folder"
    else:
        cause, fix = (e.strerror or str(e)).lower(), "check the disk and the folder"
    return QATError(f"cannot write {dest} ({cause}): {fix}, then run the command again ({saved_summary()}; "
                    f"nothing half-written was kept).")


@contextlib.contextmanager
def _write_errors(dest: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise write_error(dest, e) from e


@contextlib.contextmanager
def atomic_file(dest: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write; it appears at ``dest`` only if the block succeeds (whole, synced)."""
    dest = Path(dest)
    with _write_errors(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd = _unnamed(dest.parent)
        if fd is None:
            with atomic_path(dest) as tmp, open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            return
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
            _link(f.fileno(), dest)
    record_saved(dest)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest`` (for writers that need a path); rename it onto ``dest`` only if
    the block succeeds."""
    dest = Path(dest)
    with _write_errors(dest):
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = _partial_name(dest)
        try:
            yield tmp
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    record_saved(dest)


def write_bytes(dest: str | os.PathLike, data: bytes | memoryview) -> Path:
    with atomic_file(dest) as f:
        f.write(data)
    return Path(dest)


def write_text(dest: str | os.PathLike, text: str) -> Path:
    return write_bytes(dest, text.encode())


def copy_file(src: str | os.PathLike, dest: str | os.PathLike) -> Path:
    with open(src, "rb") as source, atomic_file(dest) as f:
        shutil.copyfileobj(source, f, length=1 << 20)
    return Path(dest)
