"""The pre-flight report (``wantrain check``).

:class:`PreflightReport` is built by ``build_dataset`` before anything is decoded; decode-time verification
appends to ``verification`` while training runs (a clip re-bucketed or skipped), so the JSON written at the end of
a run holds what really happened.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from wantrain.core.readable import shown_path


def display_path(path: str | Path) -> str:
    """``path`` for one report line: relative to the working directory when under it (``core.readable``), and
    quoted with escapes (``'a\\nb.mp4'``) when it holds a character that is not printable (a newline would split
    the line)."""
    text = shown_path(path)
    return text if text.isprintable() else repr(text)


@attrs.define
class BucketRow:
    width: int
    height: int
    frames: int
    clips: int  # distinct clips
    samples: int  # clips x repeats: what one epoch trains
    batches: int  # micro-batches in the first epoch
    remainder: int  # samples that do not fill a batch in the first epoch


@attrs.define
class PreflightReport:
    """Everything ``wantrain check`` prints. ``to_json()`` is the machine form written into the run directory."""

    variant: str
    target_fps: float | None
    retime: str
    batch_size: int
    remainder_policy: str
    datasets: list[dict[str, Any]] = attrs.field(factory=list)
    buckets: list[BucketRow] = attrs.field(factory=list)
    skipped: list[dict[str, str]] = attrs.field(factory=list)  # {"path", "reason"}
    retimed: list[dict[str, Any]] = attrs.field(factory=list)  # per video: source frames/fps -> frames
    frame_count_mismatches: list[dict[str, Any]] = attrs.field(factory=list)  # container header vs demuxed
    clip_modes: list[str] = attrs.field(factory=list)
    ignored_files: list[dict[str, str]] = attrs.field(factory=list)  # {"path", "reason"}: not media, hidden, ...
    pixels_cropped_pct: float = 0.0
    frames_left_over_pct: float = 0.0
    source_frames_total: int = 0
    frames_left_over: int = 0
    steps_per_epoch: int = 0
    memory_plan: dict[str, Any] = attrs.field(factory=dict)  # wantrain.app.memory_plan.plan_memory, part by part
    host_memory: dict[str, Any] = attrs.field(factory=dict)  # wantrain.app.memory_plan.plan_host, part by part
    verification: list[dict[str, Any]] = attrs.field(factory=list)  # appended while decoding
    # texts per medium, distinct texts to encode, expected share of samples trained with the empty prompt
    captions: dict[str, Any] = attrs.field(factory=dict)
    # epoch keys resolved to optimizer steps (filled by the run assembly / `wantrain check`, wantrain.app.epochs)
    epochs: dict[str, Any] = attrs.field(factory=dict)
    # what the run loads from where, one line per part (filled by `wantrain check`; a problem is its one line)
    model_files: list[str] = attrs.field(factory=list)
    speed: dict[str, Any] = attrs.field(factory=dict)  # wantrain.app.device_plan.speed_plan: kernel and compile
    # one line each, about the config against this plan (an expert that gets no step: wantrain.app.epochs); `run`
    # logs them as `config_warning`, `check` prints them last
    warnings: list[str] = attrs.field(factory=list)

    def set_captions(self, clips: list[Any]) -> None:
        """Fill :attr:`captions` from the clips (``Clip.texts``, ``caption_dropout``, ``repeats``)."""
        per_medium: dict[str, int] = {}
        for c in clips:
            per_medium[str(c.path)] = len(c.texts)
        samples = sum(c.repeats for c in clips)
        dropped = sum(c.repeats * c.caption_dropout for c in clips)
        texts = {t for c in clips for t in c.texts}
        if dropped:
            texts.add("")
        counts = list(per_medium.values()) or [0]
        self.captions = {
            "variants_min": min(counts), "variants_max": max(counts),
            "variants_mean": round(sum(counts) / len(counts), 3), "distinct_texts": len(texts),
            "dropped_pct": round(100.0 * dropped / samples, 3) if samples else 0.0,
            "dropout": sorted({c.caption_dropout for c in clips}),
        }

    @property
    def clips(self) -> int:
        return sum(b.clips for b in self.buckets)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=True)
        out["clips"] = self.clips
        out["samples_per_epoch"] = sum(b.samples for b in self.buckets)
        return out

    def format(self, max_listed: int = 20) -> str:
        """The human report. Every skipped file is listed; retimed videos, frame-count mismatches and verification
        events are listed up to ``max_listed`` each (all of them are in ``to_json()``)."""
        lines: list[str] = []
        fps = f"{self.target_fps:g} fps" if self.target_fps else "source rate"
        lines.append(f"wantrain data check: variant {self.variant}, clips retimed to {fps} ({self.retime}), "
                     f"clip mode {'/'.join(self.clip_modes) or '-'}")
        for ds in self.datasets:
            lines.append(f"  dataset {display_path(ds['path'])}: {ds['videos']} videos, {ds['images']} images, "
                         f"{ds['clips']} clips, repeats {ds['repeats']}, {ds['skipped']} skipped")
        lines.append("")
        lines.append(f"buckets (width x height x frames), batch size {self.batch_size}, "
                     f"remainder {self.remainder_policy}:")
        lines.append(f"  {'bucket':>16} {'clips':>6} {'samples':>8} {'batches':>8} {'remainder':>9}")
        for b in self.buckets:
            name = f"{b.width}x{b.height}x{b.frames}"
            lines.append(f"  {name:>16} {b.clips:>6} {b.samples:>8} {b.batches:>8} {b.remainder:>9}")
        samples = sum(b.samples for b in self.buckets)
        lines.append(f"  {'total':>16} {self.clips:>6} {samples:>8} {self.steps_per_epoch:>8}")
        lines.append("")
        lines.append(f"steps per epoch: {self.steps_per_epoch} micro-batches")
        if self.epochs:
            e = self.epochs
            per = ", ".join(str(n) for n in e["micro_batches"])
            lines.append(f"epochs: the first is {e['steps_per_epoch']} optimizer steps (micro-batches per epoch: "
                         f"{per}; grad_accum {e['grad_accum']})")
            for key in ("max_epochs", "save_every_epochs", "validation.every_epochs", "sample.every_epochs"):
                if key in e:
                    name = key if "." in key else f"train.{key}"
                    target = {"max_epochs": "train.max_steps", "save_every_epochs": "train.save_every"}.get(
                        key, key.replace("every_epochs", "every"))
                    lines.append(f"  {name} = {e[key]['epochs']} -> {target} = {e[key]['steps']}")
        if self.captions:
            c = self.captions
            spread = (f"{c['variants_min']}" if c["variants_min"] == c["variants_max"] else
                      f"{c['variants_mean']:g} on average ({c['variants_min']}-{c['variants_max']})")
            rates = ", ".join(f"{d:g}" for d in c["dropout"])
            lines.append(f"captions: {spread} per medium, {c['distinct_texts']} distinct texts to encode; "
                         f"{c['dropped_pct']:.1f}% of samples trained with the empty prompt "
                         f"(caption_dropout {rates})")
        lines.append(f"pixels cropped: {self.pixels_cropped_pct:.1f}% (resize to cover, then centre crop)")
        lines.append(f"frames left over: {self.frames_left_over_pct:.1f}% ({self.frames_left_over} of "
                     f"{self.source_frames_total} frames after retiming not in any clip)")
        changed = [r for r in self.retimed if r["frames"] != r["source_frames"]]
        if changed:
            lines.append(f"retimed videos: {len(changed)}")
            for r in changed[:max_listed]:
                lines.append(f"  {display_path(r['path'])}: {r['source_frames']} frames at {r['source_fps']:g} fps -> "
                             f"{r['frames']} frames at {r['target_fps']:g} fps")
            if len(changed) > max_listed:
                lines.append(f"  ... and {len(changed) - max_listed} more (see the JSON report)")
        if self.frame_count_mismatches:
            lines.append(f"container frame counts that were wrong: {len(self.frame_count_mismatches)}")
            for r in self.frame_count_mismatches[:max_listed]:
                lines.append(f"  {display_path(r['path'])}: container says {r['container_frames']}, "
                             f"stream holds {r['frames']}")
        lines.append(f"ignored files: {len(self.ignored_files)}")
        for s in self.ignored_files:  # every one: a file a user expected to train must be findable here
            lines.append(f"  {display_path(s['path'])}: {s['reason']}")
        lines.append(f"skipped files: {len(self.skipped)}")
        for s in self.skipped:  # every one: this is the list a user acts on
            lines.append(f"  {display_path(s['path'])}: {s['reason']}")
        if self.verification:
            lines.append(f"decode verification events: {len(self.verification)}")
            for v in self.verification[:max_listed]:
                lines.append(f"  {display_path(v['path'])}: {v['action']} ({v['reason']})")
        if self.model_files:
            lines.append("model files:")
            lines.extend(f"  {line}" for line in self.model_files)
        if self.speed:
            lines.append("speed (docs/models.md, Speed):")
            lines.extend(f"  {line}" for line in self.speed["lines"])
        lines.extend(memory_lines(self.memory_plan, self.host_memory))
        if self.warnings:
            lines.append("")
            lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def memory_lines(memory_plan: dict[str, Any], host_memory: dict[str, Any]) -> list[str]:
    """The VRAM plan and the host-memory plan as text, each after an empty line (what ``check`` prints and the run
    page's "Memory plan" box shows, from a report or its ``preflight.json``); empty when neither was planned."""
    lines: list[str] = []
    if memory_plan:
        chosen = memory_plan["settings"]
        head = f"memory plan for {memory_plan['bucket']}, one expert resident"
        head += (f", budget {memory_plan['budget_gib']:g} GiB" if memory_plan["budget_gib"] is not None
                 else " (settings as given)")
        lines.append("")
        recompute = f", {chosen['recompute']} recompute" if chosen.get("recompute") else ""  # older reports: none
        lines.append(f"{head}: {chosen['base_dtype']} base, {chosen['blocks_to_swap']} blocks swapped, activation "
                     f"offload {'on' if chosen['offload_activations'] else 'off'}{recompute} (docs/models.md, "
                     "Memory):")
        lines.extend(memory_plan["lines"])
    if host_memory:
        lines.append("")
        lines.append("host memory (RAM), part by part (docs/models.md, Host memory):")
        lines.extend(host_memory["lines"])
    return lines
