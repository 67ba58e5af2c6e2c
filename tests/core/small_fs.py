"""Real small file systems for the storage-error tests: a tmpfs of a given size mounted on a folder (as root), so
that a full disk is the kernel's ENOSPC and a read-only one its EROFS, not an injected exception.

``small_tmpfs(folder, size)`` mounts, yields, and unmounts; on a machine where mounting is not permitted (not root,
a container without CAP_SYS_ADMIN) the test is skipped with the reason. The injected-error tests beside them run
everywhere.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


def mount_problem() -> str | None:
    """Why a tmpfs cannot be mounted here, or None when it can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "mounting a small tmpfs needs root (CI runs as root)"
    return None


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``"2m"``) mounted on ``folder`` (created), unmounted afterwards."""
    problem = mount_problem()
    if problem:
        pytest.skip(problem)
    folder.mkdir(parents=True, exist_ok=True)
    done = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder))
    if done.returncode != 0:
        pytest.skip(f"this machine does not permit mounting a tmpfs: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


@contextlib.contextmanager
def read_only_bind(folder: Path) -> Iterator[Path]:
    """``folder`` made read-only in place, while processes may hold files in it open for writing (a read-only bind
    mount over it: what is opened by name from then on is read-only, ``EROFS``; a tmpfs cannot be remounted
    read-only while a file in it is open for writing). Writable again afterwards."""
    problem = mount_problem()
    if problem:
        pytest.skip(problem)
    done = _mount("--bind", str(folder), str(folder))
    if done.returncode != 0:
        pytest.skip(f"this machine does not permit a bind mount: {done.stderr.strip()}")
    try:
        remount(folder, "bind,ro")
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30)


def remount(folder: Path, options: str) -> None:
    """Change a mounted tmpfs's options (``"ro"``, ``"rw"``, ``"size=8m"``)."""
    done = _mount("-o", f"remount,{options}", str(folder))
    assert done.returncode == 0, done.stderr


def fill(folder: Path, leave: int = 0) -> Path:
    """Fill the file system of ``folder`` with one file until at most ``leave`` bytes are free; returns it."""
    filler = folder / "filler.bin"
    with open(filler, "wb") as fh:
        chunk = b"\0" * 65536
        while True:
            free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
            if free <= leave:
                break
            try:
                fh.write(chunk[: max(4096, min(len(chunk), free - leave))])
                fh.flush()
            except OSError:
                break
    return filler
