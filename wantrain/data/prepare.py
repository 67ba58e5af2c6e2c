"""``wantrain prepare``: a folder of long videos (and images) becomes a training folder of clips on the buckets.

For each video under the source folder (recursively, hidden files and folders left out), in path order:

1. **scene cuts**: one decode pass through PySceneDetect's content detector (:mod:`.prepare_scenes`); the cuts are
   kept in ``<out>/.wantrain_prepare/scenes/`` under the file's fingerprint and the detector's settings, so a
   second run does not detect again;
2. **clips**: each scene retimed to ``fps`` and cut into windows on the frame buckets (:mod:`.prepare_plan`); a
   scene shorter than the shortest bucket is dropped and named in the summary and the report;
3. **writing**: one decode pass feeds every clip of the file (:mod:`.prepare_write`), each written atomically as
   ``<out>/<the file's subfolder>/<stem>_scene<NNN>_clip<NN>.mp4``, then its **manifest**
   ``<out>/.wantrain_prepare/clips/<same path>.json``: the source file, its fingerprint, the scene, the first and
   last source frame and time, the cut scores, the frame bucket, the rate and the settings.

Images are copied as they are (an image trains as a 1-frame clip), with a manifest.

**Resumable.** A clip whose file and manifest exist and whose manifest matches this plan (same source content, same
source frames, rate and size) is kept and not decoded again; a source whose clips are all kept is not opened.
Temporary files a killed run left are removed first. **Ctrl-C** stops at once: every clip already named stays, the
clip being encoded is removed, the report says what is done, and the same command continues.

**Accounting.** Every file is named once in the summary when it cannot be read (one line each, with the reason);
files of other extensions are counted as ignored; ``<out>/.wantrain_prepare/report.json`` lists everything.
The training scanner treats ``.wantrain_prepare`` as wantrain's own folder (not listed, like the cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from wantrain.core.atomic import atomic_write, remove_temporaries
from wantrain.data.media import MediaError, fingerprint, kind_of, probe
from wantrain.data.prepare_plan import DroppedScene, PlannedClip, plan_scene, scenes_from_cuts
from wantrain.data.prepare_scenes import Detection, DetectorSettings, detect_cuts
from wantrain.data.prepare_write import ClipJob, EncodeSettings, output_size, write_clips

PREPARE_DIRNAME = ".wantrain_prepare"
"""wantrain's own folder inside a prepared folder: manifests, detected cuts, the report."""


@attrs.frozen
class PrepareSettings:
    """What shapes the clips. ``fps`` None keeps each source's rate (``data.retime = "off"``)."""

    buckets: tuple[int, ...]
    fps: float | None
    stride: int | None = None
    detector: DetectorSettings = attrs.field(factory=DetectorSettings)
    encode: EncodeSettings = attrs.field(factory=EncodeSettings)


def problems(source: Path, out: Path, settings: PrepareSettings) -> list[str]:
    """Every reason ``prepare`` cannot start, each one line naming what is wrong and what would be valid."""
    found = []
    if not source.exists():
        found.append(f"source '{source}' does not exist (give a folder of videos and images, or one video)")
    elif source.is_dir() and out.resolve() == source.resolve():
        found.append(f"the output folder is the source folder '{source}'; give another folder for the clips")
    if out.exists() and not out.is_dir():
        found.append(f"output '{out}' is a file; give a folder for the clips")
    bad = [b for b in settings.buckets if b < 1 or (b - 1) % 4]
    if not settings.buckets or bad:
        found.append(f"frame buckets {list(settings.buckets)}: give one or more counts of the form 4k+1 "
                     "(5, 9, 17, 33, 81, ...)")
    if settings.stride is not None and settings.stride < 1:
        found.append(f"stride {settings.stride}: give at least 1 frame between window starts")
    return found


@attrs.define
class PrepareSummary:
    """What a ``prepare`` run did; :meth:`format` is what the command prints, :meth:`to_json` the report file."""

    out: Path
    videos: int = 0
    images: int = 0
    scenes: int = 0
    footage_seconds: float = 0.0
    written: list[str] = attrs.field(factory=list)
    kept: list[str] = attrs.field(factory=list)
    dropped: list[dict[str, Any]] = attrs.field(factory=list)
    unreadable: list[dict[str, str]] = attrs.field(factory=list)
    incomplete: list[dict[str, str]] = attrs.field(factory=list)
    ignored: list[str] = attrs.field(factory=list)
    stopped: bool = False

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        out["out"] = str(self.out)
        return out

    def format(self, max_listed: int = 20) -> str:
        clips = len(self.written) + len(self.kept)
        lines = [f"prepare: {self.videos} videos ({self.footage_seconds / 60:.1f} min), {self.images} images -> "
                 f"{clips} clips in {self.out} ({len(self.written)} written, {len(self.kept)} kept from before); "
                 f"{self.scenes} scenes, {len(self.dropped)} dropped as too short"]
        for d in self.dropped[:max_listed]:
            lines.append(f"  dropped: {d['source']} scene {d['scene']} (frames {d['start_frame']}-{d['end_frame']}, "
                         f"{d['start_time']:.2f}-{d['end_time']:.2f} s): {d['reason']}")
        if len(self.dropped) > max_listed:
            lines.append(f"  ... and {len(self.dropped) - max_listed} more dropped scenes "
                         f"(all in {self.out / PREPARE_DIRNAME / 'report.json'})")
        for c in self.incomplete:
            lines.append(f"  not written: {c['clip']}: {c['reason']}")
        for u in self.unreadable:
            lines.append(f"unreadable: {u['path']}: {u['reason']}")
        if self.ignored:
            lines.append(f"ignored: {len(self.ignored)} files that are neither video nor image (listed in the report)")
        return "\n".join(lines)


class _Progress:
    """One bar over the whole job, in decoded frames (detection pass + clip pass per video), with an ETA."""

    def __init__(self, total: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="frame", unit_scale=True, dynamic_ncols=True, disable=not enabled,
                        desc="prepare")

    def advance(self, n: int) -> None:
        self.bar.update(n)

    def shrink(self, n: int) -> None:
        """Work planned that will not be done (cuts cached, clips kept)."""
        if n > 0:
            self.bar.total = max(self.bar.n, self.bar.total - n)
            self.bar.refresh()

    def status(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=False)

    def close(self) -> None:
        self.bar.close()


def _walk(source: Path, out: Path) -> tuple[list[Path], list[str]]:
    """Media under ``source`` (a folder, or one file) in path order, and the other files (ignored). Hidden files and
    folders, and the output folder when it sits inside the source, are left out."""
    if source.is_file():
        return ([source], []) if kind_of(source) else ([], [str(source)])
    media, ignored = [], []
    out_real = os.path.realpath(out)
    for folder, dirs, files in os.walk(source, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                         and os.path.realpath(os.path.join(folder, d)) != out_real)
        for name in sorted(files):
            path = Path(folder) / name
            if name.startswith(".") or not path.is_file():
                continue
            (media if kind_of(path) else ignored).append(path)
    return sorted(media), [str(p) for p in sorted(ignored)]


def _relative(path: Path, source: Path) -> Path:
    return Path(path.name) if source.is_file() else path.relative_to(source)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(data, indent=1, sort_keys=True) + "\n", what="manifest")


def manifest_path(out: Path, clip: Path) -> Path:
    """Where the manifest of ``clip`` (a file under ``out``) is kept."""
    return out / PREPARE_DIRNAME / "clips" / clip.relative_to(out).with_suffix(".json")


def _plan_identity(manifest: dict) -> tuple:
    """The manifest fields that decide the clip's pixels: equal ones mean the clip on disk is this plan's."""
    return tuple(manifest.get(k) for k in ("source_fingerprint", "kind", "start_frame", "end_frame", "frames", "fps",
                                           "source_indices_sha", "width", "height"))


class Preparer:
    """One ``prepare`` run (see the module docstring). ``log(line)`` receives the lines said while it works (an
    unreadable file); the summary is returned by :meth:`run`."""

    def __init__(self, source: Path, out: Path, settings: PrepareSettings, *, progress: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.source, self.out, self.settings = Path(source), Path(out), settings
        self.state = self.out / PREPARE_DIRNAME
        self.progress_enabled, self.log = progress, log
        self.summary = PrepareSummary(out=self.out)

    def run(self) -> PrepareSummary:
        self.out.mkdir(parents=True, exist_ok=True)
        for folder, _, _ in os.walk(self.out):  # what a killed run left half-written
            remove_temporaries(folder)
        media, self.summary.ignored = _walk(self.source, self.out)
        infos = []
        for path in media:
            try:
                infos.append((path, probe(path)))
            except MediaError as exc:
                self._unreadable(path, str(exc))
        videos = [(p, i) for p, i in infos if i.kind == "video"]
        bar = _Progress(2 * sum(i.frames for _, i in videos), self.progress_enabled)
        try:
            for path, info in infos:
                bar.status(str(_relative(path, self.source)))
                if info.kind == "image":
                    self._image(path)
                else:
                    self._video(path, info, bar)
        except KeyboardInterrupt:
            self.summary.stopped = True
            raise KeyboardInterrupt(
                f"stopped (Ctrl-C): {len(self.summary.written)} clips written this time, "
                f"{len(self.summary.kept)} kept from before, all complete; run the same command again to continue"
            ) from None
        finally:
            bar.close()
            _write_json(self.state / "report.json", self.summary.to_json())
        return self.summary

    def _unreadable(self, path: Path, reason: str) -> None:
        self.summary.unreadable.append({"path": str(path), "reason": reason})
        self.log(f"unreadable: {path}: {reason}")

    def _image(self, path: Path) -> None:
        self.summary.images += 1
        rel = _relative(path, self.source)
        target = self.out / rel
        content = fingerprint(path)
        manifest = {"kind": "image", "source": str(rel), "source_path": str(path.resolve()),
                    "source_fingerprint": content, "frames": 1}
        mpath = manifest_path(self.out, target)
        old = _read_json(mpath)
        if target.exists() and old is not None and _plan_identity(old) == _plan_identity(manifest):
            self.summary.kept.append(str(target))
            return
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, lambda tmp: shutil.copyfile(path, tmp), what="image")
        _write_json(mpath, manifest)
        self.summary.written.append(str(target))

    def _detection(self, path: Path, rel: Path, content: str, fps: float, bar: _Progress) -> Detection:
        key = hashlib.sha256(str(rel).encode()).hexdigest()[:12]
        cache = self.state / "scenes" / f"{rel.stem}-{key}.json"
        identity = {"source": str(rel), "fingerprint": content, **self.settings.detector.identity()}
        old = _read_json(cache)
        if old is not None and old.get("identity") == identity:
            return Detection.from_json(old["detection"])
        detection = detect_cuts(path, fps, self.settings.detector, on_frame=bar.advance)
        _write_json(cache, {"identity": identity, "detection": detection.to_json()})
        return detection

    def _video(self, path: Path, info, bar: _Progress) -> None:
        self.summary.videos += 1
        rel = _relative(path, self.source)
        content = fingerprint(path)
        had = bar.bar.n
        detection = self._detection(path, rel, content, info.fps, bar)
        bar.shrink(info.frames - (bar.bar.n - had))  # cached cuts decode nothing
        if detection.frames == 0:
            self._unreadable(path, f"no frame could be decoded ({detection.error or 'empty stream'})")
            bar.shrink(info.frames)
            return
        if detection.error:
            self.log(f"note: {path}: decoding stopped after {detection.frames} frames ({detection.error}); "
                     "its scenes end there")
        self.summary.footage_seconds += detection.frames / info.fps
        scenes = scenes_from_cuts(list(detection.cuts), detection.frames, dict(zip(detection.cuts, detection.scores)))
        self.summary.scenes += len(scenes)
        fps = self.settings.fps or info.fps
        planned: list[PlannedClip] = []
        for scene in scenes:
            result = plan_scene(scene, rel.stem, source_fps=info.fps, fps=self.settings.fps,
                                buckets=list(self.settings.buckets), stride=self.settings.stride)
            if isinstance(result, DroppedScene):
                self.summary.dropped.append({
                    "source": str(rel), "scene": scene.index, "start_frame": scene.start, "end_frame": scene.end,
                    "start_time": scene.start / info.fps, "end_time": scene.end / info.fps, "reason": result.reason})
            else:
                planned.extend(result)
        width, height = output_size(info.width, info.height, self.settings.encode.max_side)
        if info.rotation in (90, 270):  # the probe's size is as displayed; the stream's is as stored
            width, height = output_size(info.height, info.width, self.settings.encode.max_side)
        manifests: dict[Path, dict] = {}
        jobs: list[ClipJob] = []
        for clip in planned:
            target = self.out / rel.parent / clip.name
            manifest = self._clip_manifest(clip, rel, path, content, info, fps, width, height)
            old = _read_json(manifest_path(self.out, target))
            if target.exists() and old is not None and _plan_identity(old) == _plan_identity(manifest):
                self.summary.kept.append(str(target))
                continue
            manifests[target] = manifest
            jobs.append(ClipJob(path=target, source_indices=clip.source_indices, fps=fps))
        needed = max((j.source_indices[-1] + 1 for j in jobs), default=0)
        bar.shrink(info.frames - needed)
        if not jobs:
            return
        (self.out / rel.parent).mkdir(parents=True, exist_ok=True)

        def written(job: ClipJob) -> None:
            _write_json(manifest_path(self.out, job.path), manifests[job.path])
            self.summary.written.append(str(job.path))

        had = bar.bar.n
        try:
            unwritten, error = write_clips(path, jobs, rotation=info.rotation, settings=self.settings.encode,
                                           on_frame=bar.advance, on_written=written)
        except (OSError, ValueError, RuntimeError) as exc:  # PyAV's errors: the file broke between the passes
            unwritten, error = jobs, " ".join(str(exc).split())[:200]
        bar.shrink(needed - (bar.bar.n - had))
        for job in unwritten:
            self.summary.incomplete.append({"clip": str(job.path), "reason": f"{path} ended before source frame "
                                            f"{job.source_indices[-1]} ({error or 'end of stream'})"})

    def _clip_manifest(self, clip: PlannedClip, rel: Path, path: Path, content: str, info, fps: float,
                       width: int, height: int) -> dict[str, Any]:
        indices = ",".join(map(str, clip.source_indices)).encode()
        return {
            "kind": "video", "source": str(rel), "source_path": str(path.resolve()), "source_fingerprint": content,
            "source_fps": info.fps, "scene": clip.scene.index, "scene_start_frame": clip.scene.start,
            "scene_end_frame": clip.scene.end, "cut_score": clip.scene.cut_score,
            "end_cut_score": clip.scene.end_score, "window": clip.window,
            "start_frame": clip.start_frame, "end_frame": clip.end_frame,
            "start_time": round(clip.start_frame / info.fps, 6), "end_time": round(clip.end_frame / info.fps, 6),
            "frames": clip.frames, "bucket": {"frames": clip.frames}, "fps": fps, "width": width, "height": height,
            "source_indices_sha": hashlib.sha256(indices).hexdigest()[:16],
            "detector": self.settings.detector.identity(), "encode": self.settings.encode.identity(),
        }


def prepare_folder(source: Path, out: Path, settings: PrepareSettings, *, progress: bool = True,
                   log: Callable[[str], None] = print) -> PrepareSummary:
    """Run ``prepare`` (the module docstring); raises ``KeyboardInterrupt`` with what is kept on Ctrl-C."""
    return Preparer(source, out, settings, progress=progress, log=log).run()
