"""Data fingerprints a checkpoint carries, so that a resume notices data that changed under the same names.

:func:`file_fingerprints` maps each medium a run trains on to two short hashes: its content (the cache's
fingerprint of the file, ``data.media.fingerprint``: size, modification time and three sampled blocks, already
computed when the dataset is read: nothing is hashed again; with control files beside it, theirs too) and its
caption texts (every text the medium may train
with, from its caption file or its metadata line). ``wantrain run`` stores them in every checkpoint's metadata
(``state.json``: ``data_files``); on resume :func:`compare` sets them against the data as it is now.

What a resume does with the difference (``wantrain.app.assemble``): a medium whose content or caption changed is
refused by default, naming each file; ``--allow-data-changes`` trains on the changed files and records them in the
event log as :class:`DataChanged`. Files added or removed are always refused (the checkpoint's data position counts
clips of the list it was saved with), naming them. A ``touch`` of a file changes its modification time and counts
as a change of content, as it does for the cache (which encodes such a file again).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from wantrain.core.events import Event, register_event_type

NAMED = 8
"""At most this many files are named per kind of change in a message (then: "and N more")."""


@register_event_type
@attrs.frozen(slots=True, kw_only=True)
class DataChanged(Event):
    """A resumed run continues on media whose content or caption changed since its checkpoint, as
    ``--allow-data-changes`` allowed. ``changed``: ``"<path> (content)"`` / ``"<caption file> (caption of <name>)"``
    (``"<path> (caption)"`` for a caption from a metadata file) for every such change; ``checkpoint``: the
    checkpoint resumed from. Emitted once, right after ``RunStarted``; nobody needs to act on it (it is on record
    for whoever reads the log)."""

    changed: tuple[str, ...]
    checkpoint: str


def file_fingerprints(clips: Iterable[Any]) -> dict[str, list[str]]:
    """``{path: [content fingerprint, caption hash]}`` for each medium of ``clips`` (``data.clips.Clip``s)."""
    out: dict[str, list[str]] = {}
    for clip in clips:
        key = str(clip.path)
        if key not in out:
            caption = hashlib.sha256("\0".join(clip.texts).encode()).hexdigest()[:16]
            out[key] = [getattr(clip, "content", clip.fingerprint), caption]  # with its control files' fingerprints
    return out


def caption_files(clips: Iterable[Any]) -> dict[str, str]:
    """``{path: caption file}`` for each medium of ``clips`` whose caption is a file of its own (a sidecar)."""
    return {str(clip.path): clip.caption_file for clip in clips if clip.caption_file}


@attrs.frozen
class DataDifference:
    """What differs between a checkpoint's fingerprints and the data now: ``changed`` as ``"<path> (content)"``
    and/or ``"<caption file> (caption of <name>)"`` (the file a user edits; ``"<path> (caption)"`` when the
    caption has no file of its own), ``added`` and ``removed`` as paths."""

    changed: tuple[str, ...]
    added: tuple[str, ...]
    removed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.changed or self.added or self.removed)


def compare(saved: Mapping[str, Any], current: Mapping[str, list[str]],
            captions: Mapping[str, str] | None = None) -> DataDifference:
    """The difference between ``saved`` (a checkpoint's ``data_files``) and ``current`` (:func:`file_fingerprints`
    of the data now), in path order; ``captions`` (:func:`caption_files`) names a changed caption by its file."""
    changed = []
    for path in sorted(set(saved) & set(current)):
        (old_content, old_caption), (content, caption) = saved[path], current[path]
        if old_content != content:
            changed.append(f"{path} (content)")
        if old_caption != caption:
            own = (captions or {}).get(path)
            changed.append(f"{own} (caption of {Path(path).name})" if own else f"{path} (caption)")
    return DataDifference(tuple(changed), tuple(sorted(set(current) - set(saved))),
                          tuple(sorted(set(saved) - set(current))))


def name_some(items: tuple[str, ...]) -> str:
    """``a, b, c`` -- at most :data:`NAMED` of ``items``, then how many more."""
    shown = ", ".join(items[:NAMED])
    return shown + (f" and {len(items) - NAMED} more" if len(items) > NAMED else "")
