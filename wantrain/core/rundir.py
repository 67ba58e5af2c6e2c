"""Run directories: ``<output_dir>/<YYYYmmdd_HHMMSS>[__<run_id>]``, created once, never overwritten."""

from __future__ import annotations

import re
import time
from pathlib import Path

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
