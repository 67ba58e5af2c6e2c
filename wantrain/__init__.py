"""wantrain: a LoRA trainer for the Wan 2.2 video diffusion models, built on an event-driven core.

``wantrain.train(config, overrides=(), resume=None)`` trains from a config file or a loaded ``RunConfig`` and
returns a ``wantrain.app.assemble.RunOutcome`` (see ``wantrain.app.train``). Heavy libraries load only when it is
called.
"""

from __future__ import annotations

from typing import Any

from wantrain.core.version import __version__

__all__ = ["__version__", "train"]


def train(config: Any, **kwargs: Any) -> Any:
    """Train a LoRA; see :func:`wantrain.app.train.train` for the arguments."""
    from wantrain.app.train import train as _train

    return _train(config, **kwargs)
