"""Metadata datasets: one JSONL or CSV file listing the media and their captions, instead of sidecar caption files.

A line (JSONL: one JSON object per line; CSV: one row under a header) names a medium and its caption(s)::

    {"path": "clips/dance_01.mp4", "caption": "a woman dancing in a red dress"}
    {"video": "clips/dance_02.mp4", "caption": ["a woman dancing", "dancing, red dress, studio"]}
    {"image": "stills/pose.png", "caption": "a woman in a red dress", "repeats": 3}

    path,caption,repeats
    clips/dance_01.mp4,a woman dancing in a red dress,2

The medium's column is ``path`` (also read: ``video``, ``image``, ``file_name``, ``video_path``, ``image_path``, the
spellings of musubi-tuner's JSONL and DiffSynth's ``metadata.csv``); the caption's ``caption`` (also ``prompt``,
``text``), a string or (JSONL) a list of caption variants; ``repeats`` is optional. A VACE clip's control files
(``data/controls.py``) are optional columns: ``control`` (also ``control_video``), ``mask`` (``mask_video``) and
``ref`` (``reference``, ``reference_image``). Paths are relative to the metadata file's folder. A line that
cannot be used (not JSON, no medium, no caption, a missing file, a bad ``repeats``) is skipped and named with its
line number and reason in the pre-flight report; training goes on.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import attrs

PATH_KEYS = ("path", "video", "image", "file_name", "video_path", "image_path", "media")
CAPTION_KEYS = ("caption", "prompt", "text", "captions")
CONTROL_KEYS = {"control": ("control", "control_video"), "mask": ("mask", "mask_video"),
                "ref": ("ref", "reference", "reference_image")}  # role (data/controls.py) -> its column names


@attrs.frozen
class MetadataItem:
    line: int
    path: Path
    captions: tuple[str, ...] | None  # None: the line has no caption (missing_caption decides)
    repeats: int | None
    controls: dict[str, Path] = attrs.field(factory=dict)  # role -> control file (VACE variants read them)


@attrs.frozen
class MetadataProblem:
    line: int
    reason: str


def read_metadata(file: Path) -> tuple[list[MetadataItem], list[MetadataProblem]]:
    """The usable lines of a ``.jsonl`` or ``.csv`` metadata file and the problems of the others (line numbers
    1-based; a CSV's header is line 1). Raises ``OSError``/``UnicodeDecodeError`` for an unreadable file."""
    text = Path(file).read_bytes().decode("utf-8-sig")
    if Path(file).suffix.lower() == ".csv":
        rows = _csv_rows(text)
    else:
        rows = _jsonl_rows(text)
    items, problems = [], []
    base = Path(file).parent
    for line, row in rows:
        if isinstance(row, str):
            problems.append(MetadataProblem(line, row))
            continue
        try:
            items.append(_item(line, row, base))
        except ValueError as exc:
            problems.append(MetadataProblem(line, str(exc)))
    return items, problems


def _jsonl_rows(text: str) -> list[tuple[int, dict[str, Any] | str]]:
    rows: list[tuple[int, dict[str, Any] | str]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except ValueError as exc:
            rows.append((number, f"not a JSON object ({exc.args[0] if exc.args else exc})"))
            continue
        rows.append((number, row if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"))
    return rows


def _csv_rows(text: str) -> list[tuple[int, dict[str, Any] | str]]:
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    if header is None:
        return []
    names = [h.strip().lower() for h in header]
    rows: list[tuple[int, dict[str, Any] | str]] = []
    for row in reader:
        number = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) > len(names):
            rows.append((number, f"{len(row)} columns, the header has {len(names)}"))
            continue
        rows.append((number, {k: v for k, v in zip(names, row, strict=False) if v.strip()}))
    return rows


def _item(line: int, row: dict[str, Any], base: Path) -> MetadataItem:
    key = next((k for k in PATH_KEYS if k in row), None)
    if key is None or not isinstance(row[key], str) or not row[key].strip():
        raise ValueError(f"no medium: give its path in a '{PATH_KEYS[0]}' field (or {', '.join(PATH_KEYS[1:])})")
    path = _resolve(base, row[key])
    captions = None
    ckey = next((k for k in CAPTION_KEYS if k in row), None)
    if ckey is not None:
        value = row[ckey]
        if isinstance(value, str):
            captions = (" ".join(value.split()),)
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            captions = tuple(" ".join(v.split()) for v in value)
        else:
            raise ValueError(f"'{ckey}' must be a string or a list of strings")
    repeats = row.get("repeats")
    if repeats is not None:
        try:
            repeats = int(repeats)
        except (TypeError, ValueError):
            raise ValueError(f"'repeats' = {repeats!r} is not a whole number") from None
        if repeats < 1:
            raise ValueError(f"'repeats' = {repeats} must be at least 1")
    controls = {}
    for role, names in CONTROL_KEYS.items():
        column = next((k for k in names if k in row), None)
        if column is None:
            continue
        if not isinstance(row[column], str) or not row[column].strip():
            raise ValueError(f"'{column}' must be the path of a file")
        controls[role] = _resolve(base, row[column])
        if not controls[role].is_file():
            raise ValueError(f"{role} file {row[column].strip()} does not exist")
    return MetadataItem(line=line, path=path, captions=captions, repeats=repeats, controls=controls)


def _resolve(base: Path, text: str) -> Path:
    return Path(text.strip()) if Path(text.strip()).is_absolute() else (base / text.strip()).resolve()
