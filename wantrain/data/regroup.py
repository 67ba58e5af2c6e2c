"""The rest of an interrupted epoch, planned for another global batch (a sharded run resumed on another number of
ranks; docs/distributed.md, "Every clip once").

A checkpoint's data position is ``(epoch, index)`` in that epoch's plan of global batches, which depends on the
global batch size (``train.batch_size`` x ranks). Read against a plan of another size, the same index names other
samples: some clips of the epoch would be trained twice, others not at all. What the position means at any world
size is the set of the epoch's samples not yet trained: :func:`remaining_samples` reads it off the plan the
checkpoint was written with, and :func:`regroup` cuts it into global batches of the new size, per bucket, in a
seeded order. That list (the epoch's *tail*) is then the epoch's plan: each remaining sample is trained exactly
once, and the next epoch is planned as usual.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Bucket = tuple[int, int, int]

TAIL_STREAM = 0x7A11
"""Spawn key of the tail's order (beside the epoch's own stream): the tail's batches are shuffled like an epoch."""


def remaining_samples(batches: list[tuple[Bucket, list[int]]], index: int,
                      carry_out: dict[Bucket, list[int]]) -> dict[Bucket, list[int]]:
    """The samples of an epoch plan not yet trained at ``index`` (entries ``index`` on, and what the plan carried
    into the next epoch: with the plan cut anew, they are this epoch's), per bucket, in plan order."""
    rest: dict[Bucket, list[int]] = {}
    for key, idx in batches[index:]:
        rest.setdefault(tuple(key), []).extend(idx)  # type: ignore[arg-type]
    for key, idx in carry_out.items():
        rest.setdefault(tuple(key), []).extend(idx)  # type: ignore[arg-type]
    return dict(sorted(rest.items()))


def regroup(rest: dict[Bucket, list[int]], plan_batch: int, seed: int, epoch: int,
            shuffle: bool) -> list[tuple[Bucket, list[int]]]:
    """``rest`` cut into global batches of ``plan_batch`` samples per bucket (the last of a bucket may be short: it
    is trained, its padded rows weigh nothing), shuffled with the epoch's seed when the plan shuffles."""
    out = [(key, idx[i:i + plan_batch]) for key, idx in rest.items() for i in range(0, len(idx), plan_batch)]
    if shuffle and out:
        rng = np.random.default_rng(np.random.SeedSequence(seed % 2**64, spawn_key=(epoch, TAIL_STREAM)))
        out = [out[j] for j in rng.permutation(len(out))]
    return out


def tail_state(tail: list[tuple[Bucket, list[int]]] | None) -> list[Any] | None:
    """The tail as JSON (a checkpoint's data position)."""
    return None if tail is None else [[list(key), list(idx)] for key, idx in tail]


def tail_from_state(state: list[Any] | None) -> list[tuple[Bucket, list[int]]] | None:
    return None if state is None else [(tuple(key), list(idx)) for key, idx in state]  # type: ignore[misc]
