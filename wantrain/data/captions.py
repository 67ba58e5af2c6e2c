"""Which text each sample trains with: caption variants, a prefix (trigger word), shuffled tags and caption dropout.

Every clip has a fixed tuple of **texts** (:func:`caption_texts`), known when the dataset is built:

* the caption variants: the whole caption file (``caption_variants = "whole"``, the default), each non-empty line of
  it (``"lines"``), or the list a metadata file gives;
* with ``tag_shuffles = N``, each variant's tags (split at ``tag_separator``) in N shuffled orders, the first
  ``keep_tags`` tags kept in place (diffusion-pipe's ``cache_shuffle_num``, ai-toolkit's ``keep_tokens``); the orders
  are drawn from the run seed and the clip's path, so they are the same in every run with that seed;
* ``caption_prefix`` (a trigger word) put in front of each, verbatim.

Each distinct text is encoded once into the text cache (the key is the text, as before), plus the empty prompt when
some dataset has ``caption_dropout > 0``. Nothing about the choice is part of a cache key, so turning dropout on or
off, or changing the share, re-encodes no caption.

Per sample, :func:`draw` picks one text, or the empty prompt with probability ``caption_dropout``. The draws of the
batch at plan position (epoch, index) come from a Philox stream keyed by the run seed and that position
(:func:`batch_draws`): a pure function of the data position that every checkpoint stores, so a resumed run draws
what the uninterrupted run drew, and seeking to a position (resume) needs no replay. The dropout coin and the variant
are separate draws, so changing the dropout share does not change which variant an undropped sample gets.
"""

from __future__ import annotations

import hashlib

import attrs
import numpy as np

CAPTION_STREAM = 0xCA9710  # spawn key of the caption draws (the data order uses the epoch alone)
SHUFFLE_STREAM = 0x5A0FF1E  # spawn key of the tag shuffles
EMPTY = ""  # the prompt a dropped caption trains with


@attrs.frozen
class CaptionSettings:
    """The caption keys of one dataset (resolved: dataset value, else ``[data]``'s)."""

    prefix: str = ""
    variants: str = "whole"  # "whole" | "lines"
    tag_shuffles: int = 0
    keep_tags: int = 0
    tag_separator: str = ","
    dropout: float = 0.0


def split_variants(text: str, mode: str) -> list[str]:
    """The caption variants of a caption file's text: the whole text with whitespace collapsed (``whole``), or each
    non-empty line (``lines``), whitespace collapsed."""
    if mode == "lines":
        lines = [" ".join(line.split()) for line in text.splitlines()]
        return [line for line in lines if line] or [""]
    return [" ".join(text.split())]


def shuffled_tags(text: str, settings: CaptionSettings, rng: np.random.Generator) -> str:
    """``text`` with its tags after the first ``keep_tags`` in a random order (``rng``), joined by the separator
    and one space."""
    sep = settings.tag_separator
    tags = [t.strip() for t in text.split(sep)]
    tags = [t for t in tags if t]
    keep, rest = tags[:settings.keep_tags], tags[settings.keep_tags:]
    order = rng.permutation(len(rest)) if rest else []
    return f"{sep} ".join([*keep, *(rest[i] for i in order)])


def _path_key(path: str) -> int:
    return int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little")


def caption_texts(variants: list[str], settings: CaptionSettings, *, seed: int, path: str) -> tuple[str, ...]:
    """The distinct texts a clip trains with (dropout aside), in a fixed order: every variant, or with
    ``tag_shuffles = N`` N shuffled orders of each (drawn from ``seed`` and ``path``), each with the prefix."""
    texts: list[str] = []
    for k, variant in enumerate(variants):
        if settings.tag_shuffles:
            rng = np.random.Generator(np.random.Philox(np.random.SeedSequence(
                seed % 2**64, spawn_key=(SHUFFLE_STREAM, _path_key(path), k))))
            texts.extend(shuffled_tags(variant, settings, rng) for _ in range(settings.tag_shuffles))
        else:
            texts.append(variant)
    out = [(settings.prefix + t).strip() if settings.prefix else t for t in texts]
    return tuple(dict.fromkeys(out))


def batch_draws(seed: int, epoch: int, index: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(dropout coins, variant draws) in [0, 1) for the ``n`` slots of the plan entry (epoch, index)."""
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence(seed % 2**64,
                                                                       spawn_key=(CAPTION_STREAM, epoch, index))))
    return rng.random(n), rng.random(n)


def draw(texts: tuple[str, ...], dropout: float, coin: float, pick: float) -> str:
    """The text of one sample: the empty prompt when ``coin < dropout``, else ``texts[floor(pick * len)]``."""
    if coin < dropout:
        return EMPTY
    return texts[min(int(pick * len(texts)), len(texts) - 1)]
