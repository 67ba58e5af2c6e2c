"""Errors a user can cause.

A :class:`UserError` is something the person running wantrain can fix (a config key, a value, a path, a media
file, a checkpoint). The CLI prints its message as one line and exits with code 2, without a traceback. Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input. ``str(err)`` is one line naming what is wrong and what would be valid."""

    exit_code = 2

    def __init__(self, message: str) -> None:
        # One line, always: the CLI prints it verbatim.
        super().__init__(" ".join(str(message).split()))


class ConfigError(UserError):
    """A config key or value is wrong."""


class CriticalObserverError(RuntimeError):
    """A critical observer raised; the run stopped cleanly. ``__cause__`` is the observer's exception."""

    def __init__(self, observer: str, event_type: str, error: BaseException) -> None:
        super().__init__(f"critical observer {observer!r} failed on {event_type}: {error!r}")
        self.observer = observer
        self.event_type = event_type
