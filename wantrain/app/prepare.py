"""The ``prepare`` mode: resolve the frame buckets, rate and output folder from a run config (or from flags) and run
:func:`wantrain.data.prepare.prepare_folder`.

With a config, the clips land on the buckets training will use: ``data.frames`` (unset: the variant's default
count) at ``data.fps`` (unset: the variant's rate; ``data.retime = "off"``: each source's own rate), written into
``data.path`` unless an output folder is given; with ``[[data.datasets]]`` the output folder names the dataset whose
``frames`` apply. Flags override the config. Every refusal is found before anything is written and reported
together (:func:`wantrain.data.prepare.problems`).
"""

from __future__ import annotations

from pathlib import Path

import attrs

from wantrain.core.errors import UserError
from wantrain.data.prepare import PrepareSettings, PrepareSummary, prepare_folder, problems
from wantrain.data.prepare_scenes import DetectorSettings
from wantrain.data.prepare_write import EncodeSettings

DEFAULT_FPS = 16.0
"""The rate without a config or ``--fps``: the A14B models' (docs/data.md, Frame rate)."""


@attrs.frozen
class PrepareRequest:
    """What the command line asked for; None: from the config, else the defaults."""

    source: Path
    out: Path | None = None
    config: Path | None = None
    overrides: tuple[str, ...] = ()
    frames: tuple[int, ...] | None = None
    fps: float | None = None
    stride: int | None = None
    threshold: float = 27.0
    min_scene_len: int = 15
    max_side: int | None = None
    crf: int = 18
    preset: str = "veryfast"


def resolve(request: PrepareRequest) -> tuple[Path, PrepareSettings]:
    """The output folder and the settings, or a :class:`UserError` naming every problem."""
    out, frames, fps = request.out, request.frames, request.fps
    retime_off = False
    if request.overrides and request.config is None:
        raise UserError("--set overrides a config key: give the config with --config")
    if request.config is not None:
        from wantrain.app.config import load_config
        from wantrain.models.wan22.variants import variant_spec

        cfg = load_config(request.config, list(request.overrides))
        spec = variant_spec(cfg.model.variant)
        datasets = cfg.data.dataset_list()
        if out is None:
            if cfg.data.path is None:
                raise UserError(f"{request.config} has no 'data.path' folder to write the clips into; give the "
                                "output folder as the second argument")
            out = cfg.data.path
        chosen = next((d for d in datasets if d.path is not None and Path(d.path).resolve() == out.resolve()), None)
        if frames is None:
            resolved = cfg.data.resolved(chosen) if chosen is not None else None
            frames = tuple(sorted(set((resolved.frames if resolved else None) or cfg.data.frames
                                      or [spec.default_frames])))
        retime_off = cfg.data.retime == "off"
        if fps is None and not retime_off:
            fps = float(cfg.data.fps or spec.target_fps)
    if out is None:
        raise UserError("give the output folder (the second argument) or --config with a 'data.path'")
    if frames is None:
        raise UserError("give the frame buckets (--frames 33,81) or --config, whose data.frames are used")
    if fps is None and not retime_off:
        fps = DEFAULT_FPS
    settings = PrepareSettings(
        buckets=tuple(sorted(set(frames))), fps=fps, stride=request.stride,
        detector=DetectorSettings(threshold=request.threshold, min_scene_len=request.min_scene_len),
        encode=EncodeSettings(crf=request.crf, preset=request.preset, max_side=request.max_side))
    found = problems(request.source, out, settings)
    if found:
        raise UserError("; ".join(found))
    return out, settings


def prepare(request: PrepareRequest, *, progress: bool = True, log=print) -> PrepareSummary:
    """Resolve, then prepare (Ctrl-C: ``KeyboardInterrupt`` saying what is kept)."""
    out, settings = resolve(request)
    return prepare_folder(request.source, out, settings, progress=progress, log=log)
