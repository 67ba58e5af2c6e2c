"""What a config may run: the trust rule for code that a config names (docs/observers.md, "What a config may run").

A config file is data; it may come from anyone (a forum post, a colleague's zip with a ``.py`` beside it). Naming
code in it must not be enough to run that code. The rule, the same for every command that reads a config
(``run``, the LR finder, ``check``, ``cache``, ``schedule``, ``replay``) and for the Python API:

* Without the person's consent a config may import only **wantrain's own modules and the libraries wantrain
  lists**: ``torch.optim`` for ``[optimizer] type = "external"``; ``torch.optim.lr_scheduler``, ``timm.scheduler``
  and ``transformers.optimization`` for ``[lr_scheduler] type = "external"``; ``wantrain.*`` for
  ``[observers] extra``. That is judged from the dotted name alone, before anything is imported (importing a
  module runs its top-level code).
* Anything else -- a users' observer beside the config, in the working directory or installed, an optimizer or a
  scheduler from another package -- is imported only when the person running wantrain says so: ``--allow-code`` on
  the command line, ``allow_code=True`` in :func:`wantrain.train` or :func:`wantrain.app.replay.replay`, or
  :func:`allowing_code` around their own calls. A config cannot say so itself: ``allow_external_code = true`` in
  a config table is accepted (older configs have it) and grants nothing.

The consent is a :class:`contextvars.ContextVar`, set for the length of one call by the CLI or the API entry point
(no process-wide switch that one call could leave on for the next); the plug-ins read it with
:func:`code_allowed` when they resolve a class named in a config.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_ALLOWED: ContextVar[bool] = ContextVar("wantrain_code_allowed", default=False)

FLAG = "--allow-code"
HOW = (f"run with {FLAG} (or allow_code=True in wantrain.train()) if you trust it; a config cannot allow code "
       "itself")
"""The end of every refusal: what the person (not the config) does to allow the code."""


def code_allowed() -> bool:
    """Whether the current call may import code that a config names outside wantrain's allowed modules."""
    return _ALLOWED.get()


@contextmanager
def allowing_code(allowed: bool = True) -> Iterator[None]:
    """Within the block, code named by a config is (``allowed``) or is not imported; restored afterwards."""
    token = _ALLOWED.set(bool(allowed))
    try:
        yield
    finally:
        _ALLOWED.reset(token)


def refusal(key: str, value: str, allowed: str) -> str:
    """The one line that refuses ``key = value``: what it would run, what a config may name, how to allow it."""
    return (f"{key} = {value!r} would import and run code from outside wantrain's allowed modules ({allowed}); "
            f"{HOW}")
