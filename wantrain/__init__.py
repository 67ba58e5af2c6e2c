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


def _drop_bitsandbytes_kernel_notice() -> None:
    """bitsandbytes (imported by diffusers/peft whenever it is installed) logs at import, on CPUs with AVX512-BF16,
    that an optional package for its 4-bit CPU kernel is missing. wantrain never runs 4-bit kernels, so the line
    would be noise on every run; the filter drops that one message and nothing else."""
    import logging

    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "gemm_4bit_forward" not in record.getMessage())


_drop_bitsandbytes_kernel_notice()
