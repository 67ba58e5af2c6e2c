"""Config section ``[data]`` (stub: the data helper owns it)."""

from __future__ import annotations

from pathlib import Path

from wantrain.core.config import at_least, section, setting


@section
class DataConfig:
    """Training data."""

    path: Path | None = setting(None, doc="Folder of images and videos with same-named .txt captions.")
    resolution: list[int] = setting(factory=lambda: [64, 64], doc="Training width and height in pixels.")
    frames: int = setting(5, doc="Frames per clip (4k+1).", range=at_least(1))
