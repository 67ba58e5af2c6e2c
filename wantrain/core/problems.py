"""What a config asks that wantrain refuses, as values: a compiler's diagnostics, every one at once.

Each capability that can refuse a config (the model plug-in, data, an optimizer, a scheduler, evaluation, a
parallel layout, the LR finder, the alpha schedule) declares its rules as :class:`Rule` values and states them as
one function next to the code they protect, ``problems(cfg, machine) -> list[Problem]`` (or, for one section's
own keys, a function of that section). ``app.preflight`` holds the list of those functions and asks them all once,
before anything is loaded or written; ``wantrain check`` prints every problem, grouped by section, and ``wantrain
run`` refuses with all of them (:class:`Refused`, exit code 2, one line per problem).

A section's rules across its own keys also run when the section is built (``ModelConfig(...)`` in code refuses as
it always did): its ``__attrs_post_init__`` hands its problems to :func:`refuse`, which raises them, or, inside
:func:`collecting` (the config loader), keeps them to report beside the document's other problems.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs

from wantrain.core.errors import ConfigError


@attrs.frozen
class Rule:
    """One refusal rule, declared where its capability lives. ``id``: stable name (``"fsdp-dora"``); ``keys``: the
    config keys it reads; ``summary``: what it refuses, in a few words. ``pair``: for a rule refusing two settings
    together, the two as written in docs/config.md's compose table (``("model.parallel = fsdp", "lora.type =
    dora")``); None for a rule on one setting."""

    id: str
    keys: tuple[str, ...]
    summary: str
    pair: tuple[str, str] | None = None

    def problem(self, what: str, fix: str | None = None, *, keys: tuple[str, ...] | None = None) -> Problem:
        """This rule's problem: ``what`` is wrong, ``fix`` what would be valid (None: the part of ``what`` after its
        last ``"; "``, the house style of a one-line refusal); ``keys``: when a case of the rule reads other keys
        than it declares."""
        if fix is None:
            what, _, fix = what.rpartition("; ") if "; " in what else (what, "", "")
        return Problem(keys=self.keys if keys is None else keys, what=what, fix=fix, rule=self.id)


@attrs.frozen
class Problem:
    """One thing a config asks that cannot run: the ``keys`` involved, ``what`` is wrong, the ``fix`` (what would
    be valid), and the ``rule`` that found it."""

    keys: tuple[str, ...]
    what: str
    fix: str = ""
    rule: str = ""

    @property
    def section(self) -> str:
        """The table of its first key (``model``), the group ``wantrain check`` prints it in."""
        return self.keys[0].split(".")[0].strip("[]") if self.keys else "config"

    def line(self) -> str:
        """The problem as the one line the user reads."""
        return f"{self.what}; {self.fix}" if self.fix else self.what


class Refused(ConfigError):
    """Problems found in one pass (at least one). ``str()``: one problem's line, or several as a count and a line
    each on one line (logs); :meth:`lines` gives them one per line, grouped by section (the CLI prints those)."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = tuple(problems)
        lines = [p.line() for p in self.problems]
        super().__init__(lines[0] if len(lines) == 1 else
                         f"{len(lines)} problems in the config, all of them: "
                         + "; ".join(f"({i}) {line}" for i, line in enumerate(lines, 1)))

    def lines(self) -> list[str]:
        """The header (several problems only) and one line per problem, ``[section] line``, grouped by section in
        the order each section first appears."""
        if len(self.problems) == 1:
            return [self.problems[0].line()]
        order = list(dict.fromkeys(p.section for p in self.problems))
        ordered = sorted(self.problems, key=lambda p: order.index(p.section))
        return [f"{len(self.problems)} problems in the config, all of them:",
                *(f"  [{p.section}] {' '.join(p.line().split())}" for p in ordered)]


_found: contextvars.ContextVar[list[Problem] | None] = contextvars.ContextVar("wantrain_problems", default=None)


@contextlib.contextmanager
def collecting() -> Iterator[list[Problem]]:
    """Inside it :func:`refuse` keeps problems in the yielded list instead of raising (the config loader reads a
    whole document and reports every problem of it)."""
    found: list[Problem] = []
    token = _found.set(found)
    try:
        yield found
    finally:
        _found.reset(token)


def refuse(problems: Iterable[Problem]) -> None:
    """Raise :class:`Refused` with ``problems`` (nothing when empty); inside :func:`collecting`, keep them there."""
    problems = list(problems)
    if not problems:
        return
    found = _found.get()
    if found is not None:
        found.extend(problems)
        return
    raise Refused(problems)


VALUE = "value"
"""The ``rule`` of a value a section refuses by itself (:func:`bad_value`): no declared rule across keys, the key's
own check."""


def bad_value(key: str, what: str) -> Problem:
    """A value a section refuses by itself at construction (its own check of one key, or of its keys together),
    as a problem instead of a raise: ``key`` the config key (``data.frames``), ``what`` the one line naming it and
    what would be valid. The section is still built, so the loader judges its other keys and the rules across
    sections too; a rule reading ``key`` is dropped there (it would judge the bad value), as for a wrong type."""
    return Problem(keys=(key,), what=what, rule=VALUE)


def asked(check: Callable[..., Iterable[Problem]], *args: Any) -> list[Problem]:
    """The problems of one rule function, ``check(*args)``. Inside :func:`collecting` with a value already refused
    (:func:`bad_value`), a rule that fails on the section holding it is dropped, as the loader drops a rule that
    reads a refused key: it tripped on that value (reported already). Anywhere else its exception is a bug, raised."""
    try:
        return list(check(*args))
    except Exception:
        found = _found.get()
        if found is not None and any(p.rule == VALUE for p in found):
            return []
        raise


def as_problem(exc: ConfigError | str, keys: tuple[str, ...] = (), rule: str = "") -> Problem:
    """A one-line refusal raised by code that does not state problems yet, as a problem."""
    return Problem(keys=keys, what=str(exc), rule=rule)


@attrs.frozen
class Machine:
    """The launch a config is judged against. ``world_size``: the ranks of this launch (``WORLD_SIZE``; ``check
    --gpus N``); ``cuda``: whether this machine has a CUDA GPU; ``resuming``: ``--resume`` was given; ``planning``:
    ``wantrain check`` plans for the machine the run will have (a CUDA device this one lacks is a note then, not a
    problem: the plan is for the card of ``model.vram_budget_gb`` or ``--vram-gb``)."""

    world_size: int = 1
    cuda: bool = False
    resuming: bool = False
    planning: bool = False

    @classmethod
    def here(cls, *, world_size: int = 1, resuming: bool = False, planning: bool = False) -> Machine:
        import torch

        return cls(world_size=world_size, cuda=torch.cuda.is_available(), resuming=resuming, planning=planning)
