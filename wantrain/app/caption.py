"""The ``caption`` mode: caption a prepared folder's clips with a local vision-language model
(:mod:`wantrain.data.prepare_caption`). With a run config the folder is its ``data.path`` and the caption files take
its ``data.caption_extension``."""

from __future__ import annotations

from pathlib import Path

import attrs

from wantrain.core.errors import UserError
from wantrain.data.prepare_caption import DEFAULT_TEMPLATE, CaptionerSettings, CaptionSummary, caption_folder

__all__ = ["DEFAULT_TEMPLATE", "CaptionerSettings", "caption"]


def caption(folder: Path | None, settings: CaptionerSettings, *, config: Path | None = None,
            overrides: tuple[str, ...] = (), progress: bool = True, log=print) -> CaptionSummary:
    """Resolve the folder (and the caption extension) from ``config`` when given, then caption."""
    if config is not None:
        from wantrain.app.config import load_config

        cfg = load_config(config, list(overrides))
        if folder is None:
            if cfg.data.path is None:
                raise UserError(f"{config} has no 'data.path' folder; give the clip folder as the argument")
            folder = cfg.data.path
        ext = cfg.data.caption_extension
        settings = attrs.evolve(settings, extension=ext if ext.startswith(".") else "." + ext)
    if folder is None:
        raise UserError("give the clip folder (the argument) or --config with a 'data.path'")
    return caption_folder(Path(folder), settings, progress=progress, log=log)
