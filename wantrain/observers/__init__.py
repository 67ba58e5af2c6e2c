"""Observers: independent features that subscribe to the bus.

Users write their own by subclassing :class:`Observer` and marking handlers with :func:`on`; list them in the
config as ``[observers] extra = ["package.module:ClassName"]``. See the README for a complete example. The
built-in ones and how a config turns them on: ``wantrain.app.observers``.
"""

from __future__ import annotations

from wantrain.core.bus import Observer, Priority, on

__all__ = ["Observer", "Priority", "on"]
