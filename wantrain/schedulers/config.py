"""Config section ``[lr_scheduler]`` (stub: the schedulers helper owns it)."""

from __future__ import annotations

from typing import Any

from wantrain.core.config import section, setting


@section
class SchedulerConfig:
    """Learning-rate schedule."""

    __wantrain_extra__ = "extra"

    type: str = setting("constant", doc="Schedule type.", choices=("constant",))
    extra: dict[str, Any] = setting(factory=dict, doc="Arguments of an external scheduler class.")
