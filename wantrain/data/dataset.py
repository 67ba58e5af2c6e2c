"""Scan, probe and plan: from folders of media to bucketed :class:`Clip` s and the pre-flight report.

:func:`build_dataset` decodes nothing: every usable medium becomes one or more clips (one per clip cut and per area
budget), each in a bucket ``(width, height, frames)``; unusable files are skipped with a reason in the report.
:class:`~wantrain.data.training.TrainingData` then yields the batches.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog

from wantrain.core.errors import UserError
from wantrain.core.problems import Problem, Rule, refuse
from wantrain.data import cache as cachelib
from wantrain.data.captions import caption_texts, split_variants
from wantrain.data.clips import Clip
from wantrain.data.config import DataConfig
from wantrain.data.controls import split_media
from wantrain.data.media import MediaError, cropped_fraction, fingerprint, kind_of, probe, read_caption_text
from wantrain.data.metadata import read_metadata
from wantrain.data.plan import (
    clip_starts,
    covered_frames,
    nearest_bucket,
    pick_frame_bucket,
    retimed_count,
    size_buckets,
)
from wantrain.data.prepare import PREPARE_DIRNAME
from wantrain.data.report import BucketRow, PreflightReport, display_path
from wantrain.data.training import TrainingData

log = structlog.get_logger("wantrain.data")


def _normalise_ext(ext: str) -> str:
    return ext if ext.startswith(".") else "." + ext


def _scan(root: Path, caption_ext: str, cache_dir: Path) -> tuple[list[Path], list[Path], list[dict[str, str]],
                                                                   list[dict[str, str]]]:
    """Every file under ``root``, each in one list: media files (by extension), caption files, files skipped with a
    reason (a broken symbolic link, a folder reached twice through links) and files ignored with a reason (not a
    supported extension, hidden). Symbolic links to folders are followed (each real folder is scanned once); the
    cache folder and ``wantrain prepare``'s folder (manifests) are wantrain's own and not listed. Each list sorted."""
    media: list[Path] = []
    captions: list[Path] = []
    skipped: list[dict[str, str]] = []
    ignored: list[dict[str, str]] = []
    seen: set[str] = set()
    for folder, dirs, files in os.walk(root, followlinks=True):
        here = Path(folder)
        real = os.path.realpath(here)
        if real in seen:
            skipped.append({"path": str(here), "reason": f"a link to folder '{real}', which is scanned already"})
            dirs[:] = []
            continue
        seen.add(real)
        for name in sorted(dirs):
            path = here / name
            if name.startswith(".") and name != PREPARE_DIRNAME and not _same_folder(path, cache_dir):
                ignored.append({"path": str(path), "reason": "hidden folder (not scanned)"})
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = here / name
            if name.startswith("."):
                ignored.append({"path": str(path), "reason": "hidden file"})
            elif path.is_symlink() and not path.exists():
                skipped.append({"path": str(path), "reason": f"broken symbolic link (its target "
                                                            f"'{os.readlink(path)}' does not exist)"})
            elif not path.is_file():
                ignored.append({"path": str(path), "reason": "not a regular file"})
            elif kind_of(path) is not None:
                media.append(path)
            elif path.suffix.lower() == caption_ext.lower():
                captions.append(path)
            else:
                ignored.append({"path": str(path), "reason": f"not a supported image or video extension "
                                                            f"({path.suffix or 'none'}; docs/data.md)"})
    return sorted(media), sorted(captions), skipped, sorted(ignored, key=lambda r: r["path"])


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


class NoUsableSample(UserError):
    """No file of the dataset folders can train. ``report`` lists every skipped and ignored file (``wantrain
    check`` prints it); the message names the first skipped one."""

    def __init__(self, report: PreflightReport) -> None:
        first = report.skipped[0] if report.skipped else None
        detail = f"; first: {display_path(first['path'])}: {first['reason']}" if first else "; no media files found"
        self.summary = (f"no usable sample in {', '.join(d['path'] for d in report.datasets)}: "
                        f"{len(report.skipped)} files skipped{detail}")
        super().__init__(self.summary + " (run 'wantrain check' for the full list)")
        self.report = report


DATA_RULES = (
    I2V_SINGLE_FRAME := Rule("i2v-single-frame-bucket", ("data.frames", "model.variant"),
                             "a 1-frame bucket for an image-to-video variant",
                             ("data.frames containing 1", "model.variant = an i2v variant")),
)


def frame_bucket_problems(cfg: DataConfig, spec: Any) -> list[Problem]:
    """Every dataset's frame buckets against the variant ``spec`` (a ``VariantSpec``): no 1-frame bucket for a
    variant conditioned on a clip's first frame. From the config alone."""
    out: list[Problem] = []
    for ds in cfg.dataset_list():
        r = cfg.resolved(ds)
        for p in _frame_problems(sorted(set(r.frames or [spec.default_frames])), spec):
            if p not in out:
                out.append(p)
    return out


def _frame_problems(frame_buckets: list[int], spec: Any) -> list[Problem]:
    out = []  # counts of Wan's 4k+1 form: data.frames refuses others itself (every variant's frame multiple is 4)
    if spec.conditioning == "i2v" and 1 in frame_buckets:
        out.append(I2V_SINGLE_FRAME.problem(
            f"frame bucket 1 in 'data.frames' does not suit {spec.name}: it conditions on a clip's first frame, so a "
            f"clip needs more than one; use 5, 9, ..., {spec.default_frames}", ""))
    return out


def build_dataset(cfg: DataConfig, *, spec: Any, seed: int, batch_size: int, warn_skipped: bool = True,
                  ) -> TrainingData:
    """Scan, probe and bucket every dataset of ``cfg`` for the variant ``spec`` (a ``VariantSpec``). Skipped files
    are counted in one ``data.files_skipped`` warning, by kind of reason, unless ``warn_skipped`` is False (the
    validation clips taken from the training data: their files were counted already).

    Decodes nothing. Raises :class:`UserError` when a dataset folder is missing, a frame bucket does not suit the
    variant, or no usable sample is left.
    """
    datasets = cfg.dataset_list()
    if not datasets:
        raise UserError("no training data: set 'data.path' to a folder of media (or 'data.metadata' to a JSONL/CSV "
                        "file listing them), or add [[data.datasets]] tables")
    target_fps = None if cfg.retime == "off" else float(cfg.fps or spec.target_fps)
    report = PreflightReport(variant=spec.name, target_fps=target_fps, retime=cfg.retime, batch_size=batch_size,
                             remainder_policy=cfg.remainder)
    clips: list[Clip] = []
    cropped: list[float] = []
    for ds in datasets:
        r = cfg.resolved(ds)
        if r.metadata:
            if not r.path.is_file():
                raise UserError(f"metadata file '{r.path}' does not exist (set 'data.metadata' or 'metadata' in "
                                "[[data.datasets]] to a .jsonl or .csv file)")
        elif not r.path.is_dir():
            raise UserError(f"data path '{r.path}' is not a folder (set 'data.path' or 'path' in [[data.datasets]])")
        default_side = round(math.sqrt(spec.default_resolution[0] * spec.default_resolution[1]))
        sides = sorted(set(r.resolutions or [default_side]))
        frame_buckets = sorted(set(r.frames or [spec.default_frames]))
        refuse(_frame_problems(frame_buckets, spec))  # app.preflight asked these before: a guard for callers in code
        sizes = {s: size_buckets(s, cfg.aspect_ratios, spec.spatial_multiple) for s in sides}
        home = r.path.parent if r.metadata else r.path  # a metadata dataset's cache sits next to its file
        cache_dir = (cfg.cache_dir or (home / cachelib.CACHE_DIRNAME)).resolve()
        cachelib.check_writable(cache_dir, "data.cache_dir" if cfg.cache_dir else None)
        verified = cachelib.read_verified(cache_dir)
        ext = _normalise_ext(r.caption_extension)
        if r.clip_mode not in report.clip_modes:
            report.clip_modes.append(r.clip_mode)
        counts = Counter()
        skipped_here = 0
        clips_before = len(clips)

        def skip(path: Path, reason: str) -> None:
            nonlocal skipped_here
            report.skipped.append({"path": str(path), "reason": reason})
            skipped_here += 1

        for path, caption_source, repeats, where, controls in _entries(r, ext, report, skip, cache_dir):
            kind = kind_of(path)
            counts[kind] += 1
            if kind == "image" and spec.conditioning == "i2v":
                skip(where, f"an image cannot train {spec.name}: its condition (the first frame) would be the target "
                            "itself, which teaches only copying; train images with t2v-a14b or ti2v-5b")
                continue
            if isinstance(caption_source, tuple):  # a metadata line's caption(s)
                variants = [v for c in caption_source for v in split_variants(c, r.captions.variants)]
            elif caption_source is not None and caption_source.is_file():
                try:
                    variants = split_variants(read_caption_text(caption_source), r.captions.variants)
                except MediaError as exc:
                    skip(where, str(exc))
                    continue
            elif cfg.missing_caption == "empty":
                variants = [""]
            else:
                missing = (f"no caption file {caption_source.name}" if caption_source is not None
                           else "the line has no caption")
                skip(where, f"{missing} (set data.missing_caption = \"empty\" to train it with an empty caption)")
                continue
            try:
                info = probe(path)
                content = _fingerprint(path)
            except MediaError as exc:
                skip(where, str(exc))
                continue
            frames_real = info.frames
            if content in verified:
                frames_real = min(frames_real, verified[content])
            if controls and not getattr(spec, "vace", False):
                report.ignored_files.extend({"path": str(f), "reason": f"a {role} file: only the VACE variants read "
                                             f"control files ({spec.name} does not)"} for role, f in controls.items())
                controls = {}
            mismatches = _control_mismatches(controls, info.kind, frames_real)
            for reason in mismatches:
                skip(where, reason)
            if mismatches:
                continue
            try:
                control_prints = {role: _fingerprint(f) for role, f in controls.items()}
            except MediaError as exc:
                skip(where, str(exc))
                continue
            if info.kind == "video":
                if info.container_frames and info.container_frames != frames_real:
                    report.frame_count_mismatches.append(
                        {"path": str(path), "container_frames": info.container_frames, "frames": frames_real})
                available = retimed_count(frames_real, info.fps, target_fps)
                report.retimed.append({"path": str(path), "source_fps": info.fps, "source_frames": frames_real,
                                       "target_fps": target_fps or info.fps, "frames": available})
                length = pick_frame_bucket(available, frame_buckets)
                if length is None:
                    via = "" if available == frames_real else f" ({frames_real} at {info.fps:g} fps)"
                    skip(where, f"too short: {available} frames at {target_fps or info.fps:g} fps{via}; "
                               f"the shortest frame bucket is {frame_buckets[0]}")
                    continue
                starts = clip_starts(available, length, r.clip_mode, clips_per_video=cfg.clips_per_video,
                                     stride=cfg.clip_stride)
                report.source_frames_total += available
                report.frames_left_over += available - covered_frames(starts, length)
            else:
                length, starts = 1, [0]
            texts = caption_texts(variants, r.captions, seed=seed, path=str(path))
            caption_file = str(caption_source) if isinstance(caption_source, Path) and caption_source.is_file() else ""
            for side in sides:
                sb = nearest_bucket(info.width, info.height, sizes[side])
                for start in starts:
                    clips.append(Clip(
                        path=path, kind=info.kind, caption=texts[0], width=sb.width, height=sb.height, frames=length,
                        start=start, source_fps=info.fps, target_fps=target_fps if info.kind == "video" else None,
                        source_frames=frames_real, source_width=info.width, source_height=info.height,
                        fingerprint=content, cache_dir=cache_dir, repeats=repeats,
                        frame_buckets=tuple(frame_buckets), rotation=info.rotation, texts=texts,
                        caption_dropout=r.captions.dropout, caption_file=caption_file,
                        controls=controls, control_fingerprints=control_prints,
                    ))
                    cropped.append(cropped_fraction(info.width, info.height, sb.width, sb.height))
        n_clips = len(clips) - clips_before
        report.datasets.append({"path": str(r.path), "videos": counts["video"], "images": counts["image"],
                                "clips": n_clips, "repeats": r.repeats, "skipped": skipped_here,
                                "resolutions": sides, "frames": frame_buckets, "clip_mode": r.clip_mode,
                                "cache_dir": str(cache_dir)})
    if report.skipped and warn_skipped:
        reasons = Counter(_reason_kind(s["reason"]) for s in report.skipped)
        log.warning("data.files_skipped", count=len(report.skipped), reasons=dict(reasons),
                    listed_by="wantrain check")
    if not clips:
        raise NoUsableSample(report)
    mixed = _mixed_controls(clips) if batch_size > 1 else None
    if mixed is not None:
        raise UserError(mixed)
    report.set_captions(clips)
    report.pixels_cropped_pct = 100.0 * float(np.mean(cropped))
    report.frames_left_over_pct = (100.0 * report.frames_left_over / report.source_frames_total
                                   if report.source_frames_total else 0.0)
    return TrainingData(clips, report, batch_size=batch_size, remainder=cfg.remainder, shuffle=cfg.shuffle,
                        seed=seed, spec=spec)


def missing_data(cfg: DataConfig) -> list[str]:
    """The data folders and metadata files the config names that are not there (the placeholder of a shipped
    example, ``/path/to/dataset``, or a dataset still to be copied), one each; empty when every one is there."""
    out = []
    for ds in cfg.dataset_list():
        r = cfg.resolved(ds)
        if not (r.path.is_file() if r.metadata else r.path.is_dir()):
            out.append(str(r.path))
    return out


@attrs.frozen
class PlannedData:
    """The data as the config describes it, for a plan without the media (``wantrain check`` before the dataset is
    there): no clips; the report's buckets are every bucket the config's sizes and frame counts make."""

    report: PreflightReport
    clips: tuple = ()


def planned_data(cfg: DataConfig, *, spec: Any, batch_size: int) -> PlannedData:
    """Every bucket of ``cfg`` for the variant ``spec`` (each dataset's area budgets x aspect ratios x frame counts,
    or the variant's defaults), with no clip in any: what the memory plan needs when the media are not there."""
    target_fps = None if cfg.retime == "off" else float(cfg.fps or spec.target_fps)
    report = PreflightReport(variant=spec.name, target_fps=target_fps, retime=cfg.retime, batch_size=batch_size,
                             remainder_policy=cfg.remainder)
    seen = set()
    for ds in cfg.dataset_list():
        r = cfg.resolved(ds)
        default_side = round(math.sqrt(spec.default_resolution[0] * spec.default_resolution[1]))
        for side in sorted(set(r.resolutions or [default_side])):
            for size in size_buckets(side, cfg.aspect_ratios, spec.spatial_multiple):
                for frames in sorted(set(r.frames or [spec.default_frames])):
                    if (size.width, size.height, frames) not in seen:
                        seen.add((size.width, size.height, frames))
                        report.buckets.append(BucketRow(size.width, size.height, frames, 0, 0, 0, 0))
    return PlannedData(report)


def _reason_kind(reason: str) -> str:
    """What went wrong, without the line number, the file or the detail (the report lists every file):
    ``line 5: clips/a.mp4 does not exist`` -> ``does not exist``; ``cannot decode: ...`` -> ``cannot decode``."""
    text = re.sub(r"^line \d+: ", "", reason).split(":")[0]
    text = re.sub(r"\s*\(.*$", "", text).strip()
    first, _, rest = text.partition(" ")
    return rest if rest and ("/" in first or "." in first) else text


def _entries(r, ext: str, report: PreflightReport, skip, cache_dir: Path
             ) -> list[tuple[Path, Any, int, str, dict[str, Path]]]:
    """``(medium, caption source, repeats, where, control files)`` of each medium of dataset ``r``: a folder's
    media with their caption files (a ``Path``) and control files (``controls.py``: by role), or a metadata file's
    lines with their captions (a tuple, or None when the line has none) and control columns; ``where`` names the
    medium in the report (``file:line`` for a metadata line). Lines and files that cannot be used are skipped
    through ``skip``."""
    if not r.metadata:
        media, captions, broken, ignored = _scan(r.path, ext, cache_dir)
        for entry in broken:
            skip(Path(entry["path"]), entry["reason"])
        media, controls, orphans = split_media(media)
        report.ignored_files.extend(ignored)
        report.ignored_files.extend(orphans)
        with_media = {p.with_suffix(ext) for p in [*media, *(Path(b["path"]) for b in broken)]}
        report.ignored_files.extend({"path": str(p), "reason": "caption of no medium (no image or video of its name)"}
                                    for p in captions if p not in with_media)
        return [(p, p.with_suffix(ext), r.repeats, str(p), controls.get(p, {})) for p in media]
    try:
        items, problems = read_metadata(r.path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"metadata file '{r.path}' cannot be read as UTF-8 text ({exc})") from None
    for problem in problems:
        skip(f"{r.path}:{problem.line}", f"line {problem.line}: {problem.reason}")
    out = []
    for item in items:
        where = f"{r.path}:{item.line}"
        if not item.path.is_file():
            skip(where, f"line {item.line}: {item.path} does not exist")
        elif kind_of(item.path) is None:
            skip(where, f"line {item.line}: {item.path.name} is not a supported image or video")
        else:
            out.append((item.path, item.captions, item.repeats or r.repeats, where, item.controls))
    return out


def _mixed_controls(clips: list[Clip]) -> str | None:
    """Why batches of more than one sample cannot be made (one line), or None: two clips of one bucket with other
    control files (a reference image adds a latent frame, a control video other tensors: a batch stacks them)."""
    first: dict[tuple, Clip] = {}
    for c in clips:
        seen = first.setdefault(c.bucket, c)
        if sorted(seen.controls) != sorted(c.controls):
            return (f"{seen.path.name} ({', '.join(sorted(seen.controls)) or 'no control files'}) and {c.path.name} "
                    f"({', '.join(sorted(c.controls)) or 'no control files'}) share the bucket "
                    f"{'x'.join(map(str, c.bucket))} but not their control files, and a batch stacks them; give every "
                    "clip of a dataset the same kinds of control file, or set train.batch_size = 1")
    return None


def _control_mismatches(controls: dict[str, Path], kind: str, frames: int) -> list[str]:
    """One reason per control or mask video of a clip whose frame count is not the clip's (``frames``: what the
    clip's file yields), or that cannot be probed; a video's control files of an image clip, and a file of the other
    kind than its role's (a metadata column may name any file), are refused too."""
    out = []
    for role, path in sorted(controls.items()):
        if role == "ref":
            if kind_of(path) != "image":
                out.append(f"reference {path.name} is not an image wantrain reads (docs/data.md, Supported media)")
            continue
        if kind_of(path) != "video":
            out.append(f"{role} video {path.name} is not a video wantrain reads (docs/data.md, Supported media)")
            continue
        if kind != "video":
            out.append(f"{role} video {path.name} belongs to an image; control and mask videos go with videos "
                       "(an image takes a .ref image only)")
            continue
        try:
            have = probe(path).frames
        except MediaError as exc:
            out.append(f"{role} video {path.name}: {exc}")
            continue
        if have != frames:
            out.append(f"{role} video {path.name} has {have} frames, the clip has {frames}; a {role} video follows "
                       "its clip frame for frame (docs/data.md, Control files)")
    return out


def _fingerprint(path: Path) -> str:
    try:
        return fingerprint(path)
    except OSError as exc:
        raise MediaError(f"cannot read file: {exc.strerror or exc}") from None
