"""How far two float32 runs of the same training may drift apart when they differ only in the order of their sums
(two ranks of batch 1 against one process of batch 2, a sequence split against one process): the bounds the
equality tests of several ranks assert, derived from the arithmetic rather than fitted to one machine's figures.

Why a bound at all. Such runs do the same operations on the same samples and draws, but a matmul, an attention
over split heads or tokens, and an all-reduce add their terms in another order, and the CPU's kernels (vector
width, BLAS blocking) choose the order too. The figures therefore move from one CPU to the next (the two-rank test
measured a whole-LoRA difference of 7.2e-7 on one machine, 1.15e-6 on an AMD EPYC and 1.7e-6 on an Intel Xeon,
all against a first tolerance of 1e-6 that had been read off the first machine).

The derivation (float32 unit roundoff ``U = 2**-24``):

- **Losses** are means over a clip's elements after the same forward: ``LOSS`` = 16 U (9.5e-7) relative. The
  tiny twin's reductions are short (at most a few hundred terms), so a reordering moves a sum by a few U; 16 U
  leaves a factor of four over the largest sum's probabilistic bound (``sqrt(n) U``, n <= 256). Measured: at most
  7.6e-8 (about 1.3 U).
- **First-step gradients** (max |a - b| / max |b| per tensor): the backward pass of a LoRA weight chains the
  reductions of two blocks (self- and cross-attention, feed-forward, norms: about 16 dependent sums of up to a few
  hundred terms) and one sum over the batch's tokens, each adding a few U of the tensor's largest term. ``GRAD`` =
  64 U (3.8e-6) allows 4 U for each of the 16. Measured: 8.4e-7 (dp), 1.02e-6 and 1.13e-6 (Ulysses) on two
  machines: 3.4x inside.
- **The LoRA after S AdamW steps.** AdamW moves an element by ``lr * m / (sqrt(v) + eps)``: at most about ``lr``
  a step (|m| <= sqrt(v) while beta1**2 <= beta2), and by a step that depends on the element's gradient *relative to
  itself*, not to the tensor. A gradient element a fraction 1/A of its tensor's largest carries, in the worst case,
  the tensor's whole absolute rounding error (``GRAD`` of the largest), so its relative error, and its step's, is
  up to ``A * GRAD``. Over S steps of one expert the element is then off by at most ``S * lr * A * GRAD``
  (absolute, whatever its magnitude: the bound is per element, so it holds for each tensor and for each expert as a
  whole; S counts the steps of the expert that trains most, ``steps_of_one_expert``). ``AMPLIFICATION`` = A = 100
  covers the elements down to 1 % of their tensor's largest gradient. Below that lie 8 % of the two-rank test's
  first nonzero gradient elements; their rounding error is a few U of their own sums (the tensor's worst absolute
  error comes from its largest elements), not the tensor's worst, so they stay inside the same bound.
  Measured against the bound: the two-rank test 3.6e-7 against 9.1e-6 (25x inside, 8 steps of one expert), the
  Ulysses test 5.7e-8 against 2.3e-6 (40x inside, 2 steps of each expert).

Runs whose computation is the same (one expert per GPU group against two one-expert runs, a resume against the
uninterrupted run) are compared bitwise, not with these bounds.
"""

from __future__ import annotations

import torch

U = 2.0**-24
"""float32's unit roundoff."""
LOSS = 16 * U
"""Relative bound on each logged loss."""
GRAD = 64 * U
"""Relative bound on each first-step gradient tensor (max |a - b| / max |b|)."""
AMPLIFICATION = 100
"""How much AdamW's per-element normalisation may enlarge a gradient's relative rounding error (the elements down
to 1 % of their tensor's largest gradient)."""


def adamw_drift(steps: int, lr: float) -> float:
    """The absolute bound on any LoRA element after ``steps`` AdamW steps of its expert at learning rate ``lr``."""
    return steps * lr * AMPLIFICATION * GRAD


def steps_of_one_expert(steps: int, switch_every: int) -> int:
    """The most optimizer steps one of two experts takes in ``steps`` when they alternate every ``switch_every``
    (the first expert's share: every other block of ``switch_every`` steps, the last block possibly short)."""
    blocks = -(-steps // switch_every)
    return min(steps, -(-blocks // 2) * switch_every)


def largest_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """max |got - expected| over every element of every tensor (the same names on both sides)."""
    assert sorted(got) == sorted(expected) and expected
    return max(float((got[k].double() - expected[k].double()).abs().max()) for k in expected)
