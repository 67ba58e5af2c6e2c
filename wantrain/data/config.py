"""Config section ``[data]``: where the media are and how they become training clips (``docs/data.md``).

Two forms, which may not be mixed:

* simple: ``[data] path = "demo_data"`` is one dataset with the ``[data]`` defaults;
* full: one ``[[data.datasets]]`` table per folder; each may override ``repeats``, ``caption_extension``,
  ``resolutions``, ``frames``, ``clip_mode`` and the caption keys (``caption_dropout``, ``caption_prefix``,
  ``caption_variants``, ``tag_shuffles``, ``keep_tags``); every other key is read from ``[data]``.

Unset ``resolutions``, ``frames`` and ``fps`` come from the model variant (``VariantSpec``) when the dataset is
built, so one config trains any variant.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import attrs

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.problems import Problem, bad_value, refuse
from wantrain.data.captions import CaptionSettings

ClipMode = Literal["head", "uniform", "slide"]
CaptionVariants = Literal["whole", "lines"]

DEFAULT_ASPECT_RATIOS = (0.5, 0.5625, 0.6667, 0.75, 1.0, 1.3333, 1.5, 1.7778, 2.0)  # 1:2 ... 9:16, 3:4, 1:1 ... 2:1


def _frames_problems(where: str, frames: list[int] | None) -> list[Problem]:
    if frames is None:
        return []
    if not frames:
        return [bad_value(where, f"config key '{where}' is empty; give frame counts of the form 4k+1 (1, 5, 9, ..., "
                                 "81)")]
    bad = [f for f in frames if f < 1 or (f - 1) % 4]
    if bad:
        return [bad_value(where, f"config key '{where}' = {frames!r}: {bad[0]} is not of the form 4k+1; valid counts "
                                 "are 1, 5, 9, 13, ..., 81")]
    return []


def _metadata_problems(where: str, path: Path | None) -> list[Problem]:
    if path is not None and path.suffix.lower() not in (".jsonl", ".csv"):
        return [bad_value(where, f"config key '{where}' = '{path}' is neither a .jsonl nor a .csv file")]
    return []


def _resolutions_problems(where: str, resolutions: list[int] | None) -> list[Problem]:
    if resolutions is not None and (not resolutions or any(r < 16 for r in resolutions)):
        return [bad_value(where, f"config key '{where}' = {resolutions!r}: give one or more square sides of at least "
                                 "16 pixels (each is an area budget: 512 means 512*512 pixels per frame)")]
    return []


@section
class DatasetConfig:
    """One folder of media. Unset keys are taken from `[data]`."""

    path: Path | None = setting(
        None, doc="Folder of images and videos; each has a same-named caption file (searched recursively).")
    metadata: Path | None = setting(
        None, doc="Instead of `path`: a `.jsonl` or `.csv` file listing media (relative to the file), their captions "
        "and optional `repeats` (docs/data.md).")
    repeats: int | None = setting(None, doc="Times each clip of this folder appears per epoch.", range=at_least(1))
    caption_extension: str | None = setting(None, doc="Caption file extension, for example `.txt`.")
    resolutions: list[int] | None = setting(
        None, doc="Area budgets of this folder's buckets, as square sides in pixels (`[256, 512]`)."
    )
    frames: list[int] | None = setting(None, doc="Frame-count buckets of this folder's videos (each 4k+1).")
    clip_mode: ClipMode | None = setting(None, doc="How clips are cut from this folder's videos.")
    caption_dropout: float | None = setting(
        None, doc="Share of this folder's samples trained with the empty prompt.", range=between(0.0, 1.0))
    caption_prefix: str | None = setting(None, doc="Text put in front of each of this folder's captions.")
    caption_variants: CaptionVariants | None = setting(None, doc="`whole` or `lines` for this folder's captions.")
    tag_shuffles: int | None = setting(None, doc="Shuffled orders per caption for this folder (0: off).",
                                       range=at_least(0))
    keep_tags: int | None = setting(None, doc="Leading tags kept in place when shuffling this folder's captions.",
                                    range=at_least(0))

    def __attrs_post_init__(self) -> None:
        """Its values' problems, collected (``core.problems.refuse``: raised outside the loader)."""
        found = []
        if (self.path is None) == (self.metadata is None):
            found.append(bad_value("data.datasets", "a [[data.datasets]] table needs exactly one of 'path' (a folder "
                                   "of media with caption files) and 'metadata' (a .jsonl or .csv file listing them)"))
        where = f"data.datasets (path = {str(self.source)!r})"
        refuse([*found, *_metadata_problems("data.datasets.metadata", self.metadata),
                *_frames_problems(f"{where}.frames", self.frames),
                *_resolutions_problems(f"{where}.resolutions", self.resolutions)])

    @property
    def source(self) -> Path:
        """The folder or the metadata file."""
        return self.path if self.path is not None else self.metadata


@section
class DataConfig:
    """Training data: folders of images and videos with captions, cut into clips and grouped into buckets."""

    path: Path | None = setting(
        None, doc="Simple form: one folder of images and videos with same-named caption files. "
        "Use either this or `[[data.datasets]]`."
    )
    metadata: Path | None = setting(
        None, doc="Simple form, instead of `path`: a `.jsonl` or `.csv` file listing media and captions.")
    datasets: list[DatasetConfig] = setting(factory=list, doc="One table per folder or metadata file (full form).")
    repeats: int = setting(1, doc="Times each clip appears per epoch (default for every dataset).", range=at_least(1))
    caption_extension: str = setting(".txt", doc="Caption file extension (default for every dataset).")
    missing_caption: Literal["skip", "empty"] = setting(
        "skip", doc="A medium without a caption file is skipped (`skip`, reported) or trained with an empty caption."
    )
    resolutions: list[int] | None = setting(
        None, doc="Area budgets of the buckets as square sides in pixels (`[512]` = 512*512 pixels per frame); "
        "unset: the variant's default resolution."
    )
    aspect_ratios: list[float] = setting(
        factory=lambda: list(DEFAULT_ASPECT_RATIOS),
        doc="Width/height ratios of the buckets; each medium goes to the nearest (in log ratio).",
    )
    frames: list[int] | None = setting(
        None, doc="Frame-count buckets for videos (each 4k+1); a clip takes the longest that fits. "
        "Unset: the variant's default frame count. Images are always 1-frame clips."
    )
    fps: float | None = setting(
        None, doc="Frame rate clips are retimed to; unset: the variant's (16 for A14B, 24 for TI2V-5B).",
        range=above(0.0),
    )
    retime: Literal["resample", "off"] = setting(
        "resample", doc="`resample` drops or repeats frames to reach `fps`; `off` uses every source frame (motion "
        "plays faster or slower than in the source)."
    )
    clip_mode: ClipMode = setting(
        "head", doc="`head`: one clip from the start; `uniform`: `clips_per_video` clips spread over the video; "
        "`slide`: a clip every `clip_stride` frames."
    )
    clips_per_video: int = setting(3, doc="Clips per video in `uniform` mode.", range=at_least(1))
    clip_stride: int | None = setting(
        None, doc="Frames between clip starts in `slide` mode (after retiming); unset: the clip length "
        "(clips do not overlap).", range=at_least(1)
    )
    remainder: Literal["carry", "smaller_batch"] = setting(
        "carry", doc="Samples of a bucket that do not fill a batch: `carry` them into the next epoch's first batch "
        "of that bucket, or train them as a `smaller_batch`."
    )
    shuffle: bool = setting(True, doc="Shuffle clips within buckets and the order of batches, from the run seed.")
    cache_dir: Path | None = setting(
        None, doc="Folder for cached latents and text embeddings; unset: `.wantrain_cache` inside each dataset folder."
    )
    caption_dropout: float = setting(
        0.0, doc="Share of samples trained with the empty prompt (each sample drawn from the run seed; the empty "
        "prompt's embedding is cached once).", range=between(0.0, 1.0)
    )
    caption_prefix: str = setting(
        "", doc="Text put in front of every caption, verbatim (a trigger word: `\"ohwx, \"`); not in front of the "
        "empty prompt of a dropped caption."
    )
    caption_variants: CaptionVariants = setting(
        "whole", doc="`whole`: a caption file is one caption (whitespace and line breaks collapsed); `lines`: each "
        "non-empty line is a caption of its own, one of them drawn per sample."
    )
    tag_shuffles: int = setting(
        0, doc="Shuffled orders of each caption's tags (split at `tag_separator`) cached per caption; one is drawn "
        "per sample. 0: captions are used as written.", range=at_least(0)
    )
    keep_tags: int = setting(0, doc="Leading tags that stay in place when `tag_shuffles` shuffles the rest.",
                             range=at_least(0))
    tag_separator: str = setting(",", doc="What separates the tags of a caption (for `tag_shuffles`).")

    def __attrs_post_init__(self) -> None:
        """Its values' problems, every one (``core.problems.refuse``: collected by the loader, raised in code)."""
        found = []
        if self.path is not None and self.datasets:
            found.append(bad_value("data.path", "config keys 'data.path' and '[[data.datasets]]' are both set; use "
                                   "'data.path' for one folder or one [[data.datasets]] table per folder, not both"))
        if self.metadata is not None and (self.path is not None or self.datasets):
            found.append(bad_value("data.metadata", "config key 'data.metadata' is set with 'data.path' or "
                                   "'[[data.datasets]]'; give one dataset as 'data.path' or 'data.metadata', or one "
                                   "[[data.datasets]] table each"))
        found += [*_metadata_problems("data.metadata", self.metadata), *_frames_problems("data.frames", self.frames),
                  *_resolutions_problems("data.resolutions", self.resolutions)]
        if not self.tag_separator.strip():
            found.append(bad_value("data.tag_separator", "config key 'data.tag_separator' is empty or blank; give the "
                                   "character that separates tags, for example \",\""))
        if not self.aspect_ratios or any(r <= 0 for r in self.aspect_ratios):
            found.append(bad_value("data.aspect_ratios", f"config key 'data.aspect_ratios' = {self.aspect_ratios!r}: "
                                   "give positive width/height ratios"))
        refuse(found)

    def dataset_list(self) -> list[DatasetConfig]:
        """The datasets of either form; empty when neither ``path`` nor ``datasets`` is set."""
        if self.path is not None:
            return [DatasetConfig(path=self.path)]
        if self.metadata is not None:
            return [DatasetConfig(metadata=self.metadata)]
        return list(self.datasets)

    def resolved(self, ds: DatasetConfig) -> ResolvedDataset:
        """``ds`` with every unset key taken from ``[data]`` (variant defaults are applied later)."""
        return ResolvedDataset(
            path=ds.source, metadata=ds.metadata is not None,
            repeats=ds.repeats if ds.repeats is not None else self.repeats,
            caption_extension=ds.caption_extension if ds.caption_extension is not None else self.caption_extension,
            resolutions=ds.resolutions if ds.resolutions is not None else self.resolutions,
            frames=ds.frames if ds.frames is not None else self.frames,
            clip_mode=ds.clip_mode if ds.clip_mode is not None else self.clip_mode,
            captions=CaptionSettings(
                prefix=_pick(ds.caption_prefix, self.caption_prefix),
                variants=_pick(ds.caption_variants, self.caption_variants),
                tag_shuffles=_pick(ds.tag_shuffles, self.tag_shuffles),
                keep_tags=_pick(ds.keep_tags, self.keep_tags),
                tag_separator=self.tag_separator,
                dropout=float(_pick(ds.caption_dropout, self.caption_dropout)),
            ),
        )


def _pick(value, default):
    return default if value is None else value


@attrs.frozen
class ResolvedDataset:
    path: Path  # the folder, or the metadata file
    metadata: bool
    repeats: int
    caption_extension: str
    resolutions: list[int] | None
    frames: list[int] | None
    clip_mode: str
    captions: CaptionSettings = attrs.field(factory=CaptionSettings)
