"""The lines about what a user could mean but probably does not: ``wantrain check`` prints them after its report,
a run logs them as ``config_warning`` (none refuses, except an expert that gets no step in an epoch-length run)."""

from __future__ import annotations

from typing import Any


def config_warnings(cfg: Any, given: Any) -> list[str]:
    """One line each for what a user could mean but probably does not (``check`` prints them after its report, a
    run logs them as ``config_warning``): an expert without an optimizer step when the length comes from
    ``train.max_steps`` (with epochs that is refused here), a LoRA rank wider than the layers it adapts.
    ``cfg``: with epochs resolved into steps; ``given``: as the user wrote it."""
    from wantrain.app.epochs import check_every_expert_trains
    from wantrain.models.wan22.rules import check_rank

    found = [check_every_expert_trains(cfg, user_cfg=given), check_rank(cfg.model.variant, cfg.lora.rank)]
    return [line for line in found if line]


def data_warnings(data: Any) -> list[str]:
    """One line when videos train as stills: shorter than every multi-frame bucket of their ``data.frames``, they
    fall to the 1-frame bucket (musubi's ``frames = [1, 25, 45]`` on clips of 14-22 frames) -- how many, their
    share of the videos, and the bucket that would keep them moving."""
    available = {r["path"]: r["frames"] for r in data.report.retimed}
    stills: dict[str, int] = {}
    videos = set()
    for clip in data.clips:
        if clip.kind != "video":
            continue
        videos.add(str(clip.path))
        if clip.frames == 1 and any(b > 1 for b in clip.frame_buckets):
            stills[str(clip.path)] = available.get(str(clip.path), clip.source_frames)
    if not stills:
        return []
    buckets = sorted(data.clips[0].frame_buckets)
    fits = (min(stills.values()) - 1) // 4 * 4 + 1  # Wan's frame counts are 4k + 1
    return [f"{len(stills)} of {len(videos)} videos ({100 * len(stills) / len(videos):.0f} %) are shorter than every "
            f"frame bucket above 1 (the shortest is {min(b for b in buckets if b > 1)} frames; they have "
            f"{min(stills.values())}-{max(stills.values())} after retiming) and train as single frames: add a "
            + (f"bucket they reach, e.g. data.frames = {sorted({*buckets, fits})}" if fits > 1
               else "shorter bucket or use longer clips")]


def alpha_schedule_lines(cfg: Any) -> list[str]:
    """``wantrain check``'s lines on an enabled ``[lora.alpha_schedule]``: per phase the smallest slope its window
    resolves, and whether every phase is reachable within ``train.max_steps`` (docs/alpha_schedule.md)."""
    from wantrain.observers.alpha.report import resolution_lines

    if not cfg.lora.schedule_enabled:
        return []
    experts = len(cfg.model.trained_experts)
    return resolution_lines(cfg.lora.alpha_schedule, experts, cfg.train.max_steps)
