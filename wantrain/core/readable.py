"""How values read on the console: a path relative to the working directory when it lies under it, a float with
four significant digits (as the progress line, the run page and ``wantrain report`` write a loss). The run's files
(``log.jsonl``, ``events.jsonl``, ``metrics.jsonl``) keep the full values; only what a person reads goes through
here: the console log (``wantrain.app.logs``) and the lines ``wantrain run`` prints when it ends."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


def shown_path(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the working directory when it lies under it (``runs/20260101_120000``), else as
    given."""
    text = os.fspath(path)
    if not os.path.isabs(text):
        return text
    try:
        return str(Path(text).relative_to(Path.cwd())) or "."
    except (ValueError, OSError):  # not under it, or the working directory is gone
        return text


def shown_float(value: float) -> str:
    """Four significant digits: ``1.609``, ``0.0002``, ``1.235e+04``; ``nan`` and ``inf`` as such."""
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def shown(value: Any) -> Any:
    """A console log value as a person reads it: floats and absolute paths under the working directory shortened,
    in lists, tuples and dicts too; anything else as it is."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float):
        return shown_float(value)
    if isinstance(value, os.PathLike) or (isinstance(value, str) and os.path.isabs(value) and "\n" not in value):
        return shown_path(value)
    if isinstance(value, list | tuple):
        return type(value)(shown(v) for v in value)
    if isinstance(value, dict):
        return {k: shown(v) for k, v in value.items()}
    return value
