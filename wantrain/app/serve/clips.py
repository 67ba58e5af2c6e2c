"""The page's data view: the clips of a run's data folders (or of a folder given to ``wantrain serve --data``), each
with a strip of frames and its caption, and the caption saved back when a person edits it.

A run's folders are the ``[data] path`` and each ``[[data.datasets]] path`` of its ``config.toml`` (metadata
datasets hold their captions in one file and are not listed). A clip is any image or video under a folder, hidden
files and folders left out (the cache and ``wantrain prepare``'s manifests); its caption is the same-named file
with the folder's caption extension. A clip's ``manifest`` is the one ``wantrain prepare`` wrote, when there is one.

Safety: a clip is named by its path relative to its folder; a name that is absolute, holds ``..`` or a hidden part,
or leads outside the folder after links are resolved, or is not an image or video, is refused (:class:`ClipGone`).
A caption is written atomically (``core.atomic``), as UTF-8 with one trailing newline; the training data's
fingerprints then name the edited caption file on resume (``wantrain.data.fingerprints``).
"""

from __future__ import annotations

import io
import json
import tomllib
from pathlib import Path
from typing import Any

from wantrain.core.atomic import atomic_write
from wantrain.data.media import kind_of
from wantrain.data.prepare import manifest_path
from wantrain.data.prepare_caption import clips_of, sample_frames

STRIP_FRAMES = 6
STRIP_HEIGHT = 72
MAX_CAPTION = 20_000  # characters: a caption longer than this is a paste gone wrong
_MANIFEST_KEYS = ("source", "scene", "start_time", "end_time", "frames", "fps", "cut_score")


class ClipGone(Exception):
    """The clip named is not a clip of the folder (or the folder is not the run's)."""


def run_folders(run_dir: Path) -> list[tuple[Path, str]]:
    """``(folder, caption extension)`` of each folder dataset of the run's ``config.toml``."""
    try:
        config = tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    data = config.get("data") or {}
    ext = data.get("caption_extension") or ".txt"
    found = []
    if data.get("path"):
        found.append((Path(data["path"]), ext))
    for ds in data.get("datasets") or []:
        if ds.get("path"):
            found.append((Path(ds["path"]), ds.get("caption_extension") or ext))
    return [((run_dir / p) if not p.is_absolute() else p, e if e.startswith(".") else "." + e) for p, e in found]


def list_clips(folder: Path, ext: str) -> list[dict[str, Any]]:
    """Every clip of ``folder`` with its caption (None: no caption file) and its manifest's main facts."""
    if not folder.is_dir():
        return []
    out = []
    for clip in clips_of(folder):
        caption_file = clip.with_suffix(ext)
        try:
            caption = caption_file.read_text(encoding="utf-8") if caption_file.is_file() else None
        except (OSError, UnicodeDecodeError):
            caption = None
        manifest = None
        try:
            full = json.loads(manifest_path(folder, clip).read_text(encoding="utf-8"))
            manifest = {k: full.get(k) for k in _MANIFEST_KEYS}
        except (OSError, ValueError):
            pass
        out.append({"clip": clip.relative_to(folder).as_posix(), "kind": kind_of(clip), "caption": caption,
                    "caption_file": caption_file.relative_to(folder).as_posix(), "manifest": manifest})
    return out


def resolve_clip(folder: Path, relative: str) -> Path:
    """The clip ``relative`` names inside ``folder`` (see Safety in the module docstring); else :class:`ClipGone`."""
    parts = relative.split("/")
    if not relative or relative.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") or "\\" in p
                                                        for p in parts):
        raise ClipGone(f"{relative!r} is not a clip of the folder")
    try:
        real = (folder / relative).resolve(strict=True)
    except OSError:
        raise ClipGone(f"no clip {relative!r} in {folder}") from None
    if not real.is_relative_to(folder.resolve()) or not real.is_file() or kind_of(real) is None:
        raise ClipGone(f"{relative!r} is not a clip of the folder")
    return folder / relative


def frame_strip(clip: Path, frames: int = STRIP_FRAMES, height: int = STRIP_HEIGHT) -> bytes:
    """A JPEG of ``frames`` frames of ``clip`` side by side (evenly spread; an image: itself), ``height`` pixels
    high. Raises ``MediaError`` for a clip that cannot be read."""
    from PIL import Image

    pictures = sample_frames(clip, frames, max_side=4 * height)  # wide enough for a 4:1 clip at ``height``
    pictures = [p.resize((max(1, round(p.width * height / p.height)), height)) for p in pictures]
    strip = Image.new("RGB", (sum(p.width for p in pictures) + 2 * (len(pictures) - 1), height), (255, 255, 255))
    x = 0
    for p in pictures:
        strip.paste(p, (x, 0))
        x += p.width + 2
    buffer = io.BytesIO()
    strip.save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


def save_caption(folder: Path, relative: str, text: str, ext: str) -> Path:
    """Write the caption of clip ``relative`` atomically; returns the caption file. ValueError for a text that is
    not one (too long, or holding a NUL)."""
    clip = resolve_clip(folder, relative)
    if len(text) > MAX_CAPTION or "\x00" in text:
        raise ValueError(f"a caption is text of at most {MAX_CAPTION} characters")
    target = clip.with_suffix(ext)
    atomic_write(target, text.strip() + "\n", what="caption")
    return target
