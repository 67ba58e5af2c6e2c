"""Run directories: ``<output_dir>/<YYYYmmdd_HHMMSS>[__<run_id>]``, created once, never overwritten.

Nothing wantrain writes leaves its run directory: a resume refuses a run directory that holds a symbolic link
(:func:`refuse_links`, before anything is written), and the files a run appends to are opened without following
links (:func:`open_append`), so a link put there later is refused too instead of being written through.
"""

from __future__ import annotations

import errno
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
