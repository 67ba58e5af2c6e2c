"""Counters of a run, owned and updated by the core."""

from __future__ import annotations

import attrs


@attrs.define
class TrainState:
    """Counters of the run. Plain ints, updated by the core only."""

    step: int = 0  # optimizer steps taken (including skipped ones)
    micro_step: int = 0
    total_steps: int = 0
    expert: str | None = None
    consecutive_oom: int = 0
    skipped_steps: int = 0
