"""Files written whole or not at all, and storage errors as one line.

Every file wantrain writes under a name a reader looks for (config copies, checkpoints' files, LoRA files, cache
entries, preflight.json, reports, samples) goes through :func:`atomic_write`:

1. the content is written to a temporary sibling ``.<name>.tmp-<pid>-<random>`` (the same folder, so the same file
   system: the rename below cannot become a copy);
2. the temporary file is fsync'ed (its bytes are on the disk before its name is);
3. it is renamed over the final name (``os.replace``: a reader sees the old file or the new one, never a part);
4. the folder is fsync'ed (the rename itself survives a power loss).

A kill at any point leaves the old file (or none) under the final name and at most a ``*.tmp-*`` sibling, which the
next run in that folder removes. Any exception removes the temporary file before it propagates.

**Storage errors.** A write that fails because the file system is full (``ENOSPC``), over quota (``EDQUOT``),
read-only (``EROFS``), not writable for this user (``EACCES``, ``EPERM``) or the file too large (``EFBIG``) is a
:class:`StorageError`: a ``UserError`` (one line, exit code 2) naming the path, the reason and the free space of
its file system. :func:`os_error_of` finds the ``OSError`` behind an exception that is not one: safetensors raises
``SafetensorError`` with the OS error in its text (``... (os error 28)``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from wantrain.core.errors import UserError

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})
"""The ``errno`` values that say the storage cannot take a write (as opposed to a bug in the writer)."""

_OS_ERROR_IN_TEXT = re.compile(r"\(os error (\d+)\)")


class StorageError(UserError):
    """A file could not be written: disk full, over quota, read-only, no permission. ``path`` is the file the user
    knows (never the temporary one), ``errno`` the OS error number."""

    def __init__(self, message: str, *, path: Path | str | None = None, errno_value: int | None = None) -> None:
        super().__init__(message)
        self.path = Path(path) if path is not None else None
        self.errno = errno_value


def os_error_of(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: ``exc`` itself, one in its ``__cause__``/``__context__`` chain, or one
    rebuilt from the ``(os error N)`` text of a ``SafetensorError``. None when there is none."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        match = _OS_ERROR_IN_TEXT.search(str(current))
        if match:
            number = int(match.group(1))
            return OSError(number, os.strerror(number))
        current = current.__cause__ or current.__context__
    return None


def is_storage_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the storage cannot take a write (:data:`STORAGE_ERRNOS`), or is a
    :class:`StorageError` already."""
    if isinstance(exc, StorageError):
        return True
    found = os_error_of(exc)
    return found is not None and found.errno in STORAGE_ERRNOS


def free_space(path: Path | str) -> str:
    """``"1.4 MiB free"`` on the file system of ``path`` (or of its nearest existing parent), for messages."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return "free space unknown"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if free < 1024 or unit == "TiB":
            return f"{free} bytes free" if unit == "bytes" else f"{free:.1f} {unit} free"
        free /= 1024
    return "free space unknown"  # pragma: no cover


def storage_error(what: str, path: Path | str, exc: BaseException, *, hint: str | None = None) -> StorageError:
    """The one-line :class:`StorageError` for ``exc`` raised while writing ``what`` at ``path``: the reason, the
    free space there and what to do (``hint``, else: free space or fix permissions)."""
    if isinstance(exc, StorageError):
        return exc
    found = os_error_of(exc)
    reason = (found.strerror or str(found)) if found is not None else " ".join(str(exc).split())[:200]
    number = found.errno if found is not None else None
    advice = hint or "free space or fix permissions there"
    return StorageError(f"cannot write {what} '{path}': {reason} ({free_space(path)} there); {advice}",
                        path=path, errno_value=number)


def fsync_dir(path: Path | str) -> None:
    """fsync the folder ``path`` (a rename in it survives a power loss). File systems that cannot open a folder
    for that skip it: the rename is atomic all the same."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """The temporary sibling :func:`atomic_write` writes ``path`` through (unique per process and call)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}")


def _umask_at_import() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


_UMASK_AT_IMPORT = _umask_at_import()


def current_umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; ``os.umask`` sets it to read it, and
    another thread creating a file in between would get the wrong permissions). Where that file has no ``Umask``
    line, the umask at import."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return _UMASK_AT_IMPORT


def _default_mode() -> int:
    return 0o666 & ~current_umask()


def atomic_write(path: Path | str, content: bytes | str | Callable[[Path], None], *, what: str = "file",
                 hint: str | None = None) -> Path:
    """Write ``path`` whole or not at all (see the module docstring) and return it.

    ``content``: the bytes or text (UTF-8) to write, or a callable that writes the file it is given (the temporary
    path), for writers that take a file name (safetensors, PIL, PyAV, matplotlib). The file gets the permissions
    the umask gives a new file (safetensors makes its files owner-only otherwise; the umask is read, never set).
    Storage errors (:data:`STORAGE_ERRNOS`) raise :class:`StorageError` naming ``what`` and ``path``; other
    exceptions, other ``OSError`` s included (a missing folder), propagate unchanged; the temporary file is removed
    either way.
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        if callable(content):
            content(tmp)
        else:
            data = content.encode("utf-8") if isinstance(content, str) else content
            with open(tmp, "xb") as fh:
                fh.write(data)
        os.chmod(tmp, _default_mode())
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # the folder itself went read-only: nothing more to do here
            tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception) and is_storage_error(exc):
            raise storage_error(what, path, exc, hint=hint) from exc
        raise  # a missing folder, a bad name: the caller's bug, not the storage's
    return path


class _CriticalSection:
    depth = 0
    pending: BaseException | None = None


@contextlib.contextmanager
def critical_section() -> Iterator[None]:
    """Steps that must happen together (a checkpoint's two renames when it replaces one of the same step): an
    exception a signal handler hands to :func:`raise_when_safe` inside it is raised when it ends, not between them.
    Python runs signal handlers on the main thread between bytecodes, so this is all a handler needs."""
    _CriticalSection.depth += 1
    try:
        yield
    finally:
        _CriticalSection.depth -= 1
        if _CriticalSection.depth == 0 and _CriticalSection.pending is not None:
            pending, _CriticalSection.pending = _CriticalSection.pending, None
            raise pending


def raise_when_safe(exc: BaseException) -> None:
    """Raise ``exc`` now, or at the end of the :func:`critical_section` running now (signal handlers call it)."""
    if _CriticalSection.depth:
        _CriticalSection.pending = exc
        return
    raise exc


def remove_temporaries(folder: Path | str, pattern: str = ".*.tmp-*") -> list[Path]:
    """Remove the files :func:`atomic_write` left in ``folder`` when a writer was killed (call once the folder is
    this process's: a live writer's temporary file would go too). Returns what was removed."""
    removed = []
    for leftover in Path(folder).glob(pattern):
        if leftover.is_file() and not leftover.is_symlink():
            try:
                leftover.unlink()
                removed.append(leftover)
            except OSError:
                pass
    return removed
