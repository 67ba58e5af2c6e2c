"""What ``wantrain convert`` builds while it reads a peer's config: the wantrain keys written, the ``[[data.datasets]]``
tables, and a line for every peer key it could not map or whose default it wrote out.

Every peer key the converters meet ends in :meth:`Conversion.put` (mapped), :meth:`Conversion.skip` (named, with
why) or both; :attr:`Conversion.seen` holds each one, so that a test can hold "nothing dropped without a line" to
the peer's file key by key."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs


@attrs.define
class Conversion:
    flat: dict[str, Any] = attrs.field(factory=dict)  # "section.key" -> value
    datasets: list[dict[str, Any]] = attrs.field(factory=list)  # [[data.datasets]] tables (two or more)
    unmapped: list[str] = attrs.field(factory=list)  # "<peer key> = <value>: <why>", one per key not mapped
    defaults: list[str] = attrs.field(factory=list)  # "<wantrain key> = <value> (<why>)": a peer's default written
    seen: set[str] = attrs.field(factory=set)  # every peer key met ("[general] resolution", "train.lr")

    def put(self, source: str, key: str, value: Any) -> None:
        """``key`` = ``value`` does what the peer's ``source`` did; a value a converter could not read (None, or a
        list holding one) is named instead."""
        if value is None or (isinstance(value, list) and any(v is None for v in value)):
            self.skip(source, f"{source}: its value could not be read as {key}; set {key} by hand")
            return
        self.seen.add(source)
        self.flat[key] = value

    def skip(self, source: str, line: str) -> None:
        """The peer's ``source`` is not mapped (or only in part): ``line`` says its value and why."""
        self.seen.add(source)
        if line not in self.unmapped:  # a [general] key met once per dataset is named once
            self.unmapped.append(line)

    def default(self, key: str, value: Any, why: str) -> None:
        """The peer's default for ``key`` differs from wantrain's: write it out (unless the file set it)."""
        if key not in self.flat:
            self.flat[key] = value
            self.defaults.append(f"{key} = {json.dumps(value)} ({why})")

    def config(self) -> dict[str, Any]:
        """The nested config for ``tomli_w``; ``[[data.datasets]]`` when there are tables."""
        out: dict[str, Any] = {}
        for key, value in self.flat.items():
            *parents, leaf = key.split(".")
            table = out
            for p in parents:
                table = table.setdefault(p, {})
                if not isinstance(table, dict):  # a converter wrote a section name as a key: a bug, not input
                    raise AssertionError(f"wantrain convert wrote {key!r} under a value; report this")
            table[leaf] = value
        if self.datasets:
            out.setdefault("data", {})["datasets"] = self.datasets
        return out


def area_side(value: Any) -> int | None:
    """A peer's resolution as wantrain's area budget (the side of the square of the same pixel count): ``[960,
    544]`` (width, height) is 723 (522,729 pixels, 960 x 544 is 522,240); a single number is itself. ``None``
    when it is neither."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return int(value)
    if (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int | float) for v in value)
            and min(value) > 0):
        return round(math.sqrt(value[0] * value[1]))
    return None


def frames_4k1(n: int) -> int:
    """The frame count of the form 4k+1 at or below ``n`` (as musubi-tuner truncates ``target_frames``)."""
    return max(1, (int(n) - 1) // 4 * 4 + 1)


def shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | int | float | bool | list | dict) or value is None \
        else repr(value)
