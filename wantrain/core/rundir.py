"""Run directories: ``<output_dir>/<YYYYmmdd_HHMMSS>[__<run_id>]``, created once, never overwritten.

Nothing wantrain writes leaves its run directory: a resume refuses a run directory that holds a symbolic link
(:func:`refuse_links`, before anything is written), and the files a run appends to are opened without following
links (:func:`open_append`), so a link put there later is refused too instead of being written through.

**One writer per run directory.** A run (fresh or resumed) takes an OS lock on ``<run_dir>/.lock``
(:func:`lock_run_dir`, ``flock``) before it writes anything there, and holds it until it ends. A second process
(``--resume auto`` on a run that is still training, two resumes at once) is refused in one line naming the pid
that holds it. The kernel releases the lock when its process ends, however it ends (``kill -9`` included), so the
lock file a dead run left is never an obstacle; the file stays, holding the last holder's pid.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import time
from pathlib import Path
from typing import IO, Any

from wantrain.core.errors import UserError

_SAFE_NAME = re.compile(r"[A-Za-z0-9._-]+")

SAFE_NAME_RULE = "1-100 letters, digits, '.', '_' or '-', without '..'"


def is_safe_name(name: str) -> bool:
    """Whether ``name`` is safe as one path component written by wantrain (a run id, the LoRA files' base name).

    Allowed: letters, digits, ``.``, ``_`` and ``-``; at most 100 characters; not empty, no ``..``. The whole
    string must match (``fullmatch``: a trailing newline is refused too).
    """
    return bool(_SAFE_NAME.fullmatch(name)) and ".." not in name and name != "." and len(name) <= 100


def sanitize_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is a safe directory-name suffix (:func:`is_safe_name`), else raise a one-line
    :class:`UserError`. Unsafe ids are refused rather than rewritten, so the user sees exactly which id was used.
    """
    if not is_safe_name(run_id):
        raise UserError(f"run id {run_id!r} is not valid: use {SAFE_NAME_RULE}")
    return run_id


def create_run_dir(output_dir: Path, run_id: str | None = None, *, now: float | None = None) -> Path:
    """Create and return a new run directory. An existing directory is never reused: if the name is taken (two
    runs in the same second), a numeric suffix ``-2``, ``-3``, ... is added."""
    output_dir = Path(output_dir)
    stamp = time.strftime("%Y%m%d_%H%M%S", time.localtime(now))
    name = stamp if run_id is None else f"{stamp}__{sanitize_run_id(run_id)}"
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output folder '{output_dir}': {exc.strerror}") from None
    for attempt in range(1, 1000):
        candidate = output_dir / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            candidate.mkdir()  # exist_ok=False: atomic claim of the name
            return candidate
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"cannot create run directory '{candidate}': {exc.strerror}") from None
    raise UserError(f"cannot find a free run directory name under '{output_dir}'")


def links_inside(run_dir: Path) -> list[Path]:
    """Every symbolic link under ``run_dir`` (links are not followed), sorted."""
    found = []
    for folder, dirs, files in os.walk(run_dir):
        found.extend(Path(folder, name) for name in [*dirs, *files] if Path(folder, name).is_symlink())
    return sorted(found)


def refuse_links(run_dir: Path) -> None:
    """One line (``UserError``) if ``run_dir`` holds a symbolic link: a resume appends to the run's logs and
    writes checkpoints there, and would write through a link to wherever it points."""
    links = links_inside(run_dir)
    if links:
        first = links[0]
        raise UserError(f"run directory '{run_dir}' holds {len(links)} symbolic link(s), e.g. "
                        f"'{first.relative_to(run_dir)}' -> '{os.readlink(first)}'; a resume writes only regular "
                        "files inside its run directory: replace the link with a copy of its target, or remove it")


def open_append(path: Path, *, text: bool = False, encoding: str = "utf-8") -> IO[Any]:
    """``path`` opened to append (created if missing), refusing a symbolic link with one line (``UserError``)
    instead of writing to its target (``O_NOFOLLOW``)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"'{path}' is a symbolic link; wantrain appends only to regular files in a run "
                            "directory: replace the link with a copy of its target, or remove it") from None
        raise
    return os.fdopen(fd, "a", encoding=encoding) if text else os.fdopen(fd, "ab")


LOCK_FILE = ".lock"


class RunDirLock:
    """The OS lock a run holds on its run directory (:func:`lock_run_dir`). :meth:`release` (or the process's end)
    gives it up; releasing twice does nothing."""

    def __init__(self, run_dir: Path, fd: int) -> None:
        self.run_dir = run_dir
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> RunDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take the run directory's lock (see the module docstring) or raise a one-line ``UserError`` naming the pid of
    the process that holds it. A file system without locks (some network mounts) is not refused: the lock is then
    only as good as the user's care, and the returned lock holds nothing."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"'{path}' is a symbolic link; remove it (wantrain keeps its lock there)") from None
        raise UserError(f"cannot lock run directory '{run_dir}': {exc.strerror} ('{path}'); free space or fix "
                        "permissions there") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return RunDirLock(run_dir, fd)  # ENOLCK, EOPNOTSUPP: no locks on this file system
        holder = _read_pid(fd)
        os.close(fd)
        who = f"process {holder}" if holder else "another process"
        raise UserError(f"run directory '{run_dir}' is in use by {who} (a run or resume still writing there); wait "
                        "for it to end or stop it, then run again; one process writes a run directory at a time"
                        ) from None
    if _read_pid(fd) != os.getpid():  # unchanged when it is ours already: a refused resume touches nothing
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            pass  # a full disk: the lock holds all the same, only the pid in messages is missing
    return RunDirLock(run_dir, fd)


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
