"""Pinned (page-locked) host memory carved from a few large slabs, without the pinned allocator's power-of-two waste.

torch's pinned-memory allocator (``CachingHostAllocator``) rounds every allocation up to a power of two, so pinning
tensor by tensor takes up to twice their bytes: an A14B block's 71 MB fp8 feed-forward Linears take 128 MB each and
activation offload's 320 MiB buffers 512 MiB (+53 % on the experts, +60 % on the buffers). Block swap
(``swap.py``), the expert placement's waiting copies (``placement.py``) and activation offload (``offload.py``)
instead carve their host tensors from slabs whose sizes are powers of two (which that allocator gives exactly):

* :func:`slab_layout` packs byte sizes into slabs: every size aligned to :data:`ALIGN` bytes (each carved tensor
  starts on a 512-byte boundary, so copies stay fast); slab after slab, a slab's size is the largest power of two
  not above the bytes still to place (at least the largest tensor still to place, at most ``max_slab``), filled
  largest tensor first with whatever still fits, then shrunk to the power of two its content needs. The waste is
  the slabs' unused ends: 2-3 % for the A14B experts' tensors, 2-7 % for the offload buffers.
  ``memory.host_estimate`` counts the slabs with this same function (:func:`slab_bytes`), so the estimate and the
  run cannot drift.
* :class:`PinnedSlabs` (fixed sets: the swapped blocks, the waiting copies) hands out the views slab by slab,
  allocating each slab only when it is reached: the caller copies each tensor in and drops the original, so
  building the copies holds at most one slab (:data:`WEIGHT_SLAB_MAX`, 1 GiB) more than the tensors themselves.
* :class:`SlabPool` (activation offload: requests that repeat every step, sizes known only once a forward ran)
  serves each request from the best-fitting free place; a forward whose requests did not all fit (the first one)
  gets pageable buffers for the rest, and the next forward re-plans the slabs for the larger of what was planned
  and what that forward asked for (:func:`slab_layout` of them). A place is free again once the tensor handed out
  is gone.

Pinning that fails (no CUDA, the driver refuses more page-locked memory) falls back to pageable memory with one
warning (logger ``wantrain.memory``) per owner, never an error. All copies in and out of these views are issued by
their owners on one stream each (the swap's and offload's side streams), so a place reused by its owner is never
written while an earlier copy from it is in flight; slabs freed at a re-plan go back to torch's pinned allocator,
which waits on the copies it saw before reusing them (and is asked to give its cached free blocks back).
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterator, Sequence

import attrs
import torch

log = logging.getLogger("wantrain.memory")

ALIGN = 512  # bytes: every carved tensor starts on this boundary
MIN_SLAB = 4096  # bytes: the smallest slab (one page)
WEIGHT_SLAB_MAX = 1 << 30  # swapped blocks' and waiting copies' slabs: the most building them holds extra
OFFLOAD_SLAB_MAX = 8 << 30  # activation offload's slabs (offload buffers of 300 MiB-1.2 GiB pack with little waste)


def pow2_ceil(n: int) -> int:
    """What torch's pinned allocator takes for an ``n``-byte allocation: ``n`` rounded up to a power of two."""
    return 1 << max(n - 1, 0).bit_length() if n > 0 else 0


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@attrs.frozen
class SlabLayout:
    """``slabs``: the byte size of every slab (powers of two); ``places``: (slab, byte offset) of every size given
    to :func:`slab_layout`, in its order ((-1, 0) for a size of 0, which takes no place)."""

    slabs: tuple[int, ...]
    places: tuple[tuple[int, int], ...]

    @property
    def total(self) -> int:
        return sum(self.slabs)


@functools.lru_cache(maxsize=64)
def slab_layout(sizes: tuple[int, ...], max_slab: int = WEIGHT_SLAB_MAX) -> SlabLayout:
    """Pack byte ``sizes`` into power-of-two slabs (module docstring). Deterministic; the slab sizes depend only on
    the multiset of sizes, not on their order."""
    order = sorted((i for i, s in enumerate(sizes) if s > 0), key=lambda i: (-sizes[i], i))
    left = [(aligned(sizes[i]), i) for i in order]
    remaining = sum(a for a, _ in left)
    slabs: list[int] = []
    places: list[tuple[int, int]] = [(-1, 0)] * len(sizes)
    while left:
        cap = max(pow2_ceil(left[0][0]), min(max_slab, 1 << (remaining.bit_length() - 1)), MIN_SLAB)
        used, keep = 0, []
        for size, i in left:  # largest first, whatever still fits
            if used + size <= cap:
                places[i] = (len(slabs), used)
                used += size
            else:
                keep.append((size, i))
        slabs.append(max(pow2_ceil(used), MIN_SLAB))
        remaining -= used
        left = keep
    return SlabLayout(tuple(slabs), tuple(places))


def slab_bytes(sizes: Sequence[int], max_slab: int = WEIGHT_SLAB_MAX) -> int:
    """Pinned bytes the slabs of ``sizes`` take (what ``memory.host_estimate`` counts)."""
    return slab_layout(tuple(int(s) for s in sizes), max_slab).total


def pinnable(device: torch.device) -> bool:
    """Whether host copies for ``device`` are pinned: CUDA, where asynchronous copies need page-locked memory."""
    return device.type == "cuda" and torch.cuda.is_available()


def allocate_pinned(nbytes: int) -> torch.Tensor:
    """``nbytes`` (a power of two: no rounding) of page-locked host memory as a uint8 tensor, from torch's pinned
    allocator; ``RuntimeError`` when it refuses."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _release_cached_pinned() -> None:
    """Hand the pinned allocator's cached free blocks (slabs a re-plan dropped) back to the system: torch keeps freed
    pinned blocks for reuse, which a re-plan's slabs of other sizes would not get. Blocks still waiting on a copy
    stay."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _view(slab: torch.Tensor, offset: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return slab[offset: offset + _nbytes(shape, dtype)].view(dtype).view(shape)


class PinnedSlabs:
    """Host tensors of a fixed set of shapes and dtypes carved from pinned slabs (module docstring). ``what`` names
    the owner in the fallback warning; ``pinned`` is false once pinning failed (everything after is pageable);
    ``slabs`` lists the bytes of the slabs allocated."""

    def __init__(self, what: str, *, max_slab: int = WEIGHT_SLAB_MAX) -> None:
        self.what = what
        self.max_slab = max_slab
        self.pinned = True
        self.slabs: list[int] = []

    def views(self, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> Iterator[tuple[int, torch.Tensor | None]]:
        """Yield ``(index, empty pinned host tensor)`` for every (shape, dtype) of ``specs``, slab by slab (each slab
        is allocated when its first tensor is yielded: a caller that copies each tensor in and drops the original
        as it goes holds at most one slab extra). ``None`` instead of a tensor: not pinned (a size of 0, or pinning
        failed), the caller keeps a pageable tensor of its own."""
        layout = slab_layout(tuple(_nbytes(s, d) for s, d in specs), self.max_slab)
        members: list[list[int]] = [[] for _ in layout.slabs]
        for i, (slab, _) in enumerate(layout.places):
            if slab < 0:
                yield i, None
            else:
                members[slab].append(i)
        for slab_index, indices in enumerate(members):
            slab = self._allocate(layout.slabs[slab_index]) if self.pinned else None
            for i in indices:
                shape, dtype = specs[i]
                yield i, None if slab is None else _view(slab, layout.places[i][1], shape, dtype)
            del slab  # its views keep it alive

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        try:
            slab = allocate_pinned(nbytes)
        except RuntimeError as exc:
            self.pinned = False
            log.warning("%s: pinning host memory failed (%s); its host copies use pageable memory from here on "
                        "(synchronous copies)", self.what, str(exc).splitlines()[0])
            return None
        self.slabs.append(nbytes)
        return slab


class SlabPool:
    """Host buffers for requests that repeat every forward (activation offload), carved from pinned slabs planned
    from the requests seen (module docstring). Call :meth:`start` as each forward begins and :meth:`take` for every
    buffer; ``slabs`` lists the bytes of the slabs held."""

    def __init__(self, what: str, *, max_slab: int = OFFLOAD_SLAB_MAX) -> None:
        self.what = what
        self.max_slab = max_slab
        self.pinned = True
        self._slabs: list[torch.Tensor] = []
        self.slabs: list[int] = []
        self._capacities: list[int] = []  # every place's bytes
        self._free: list[tuple[int, int, int]] = []  # (bytes, slab, offset), sorted
        self._live = 0
        self._requests: list[int] = []  # bytes asked for since the last start()
        self._missed = False

    def start(self) -> None:
        """A forward begins: if the last one had requests no free place fitted, and nothing handed out is still
        alive, re-plan the slabs for the larger of what was planned and what it asked for."""
        if self._missed and self._live == 0 and self.pinned:
            planned = sorted(self._capacities, reverse=True)
            asked = sorted(self._requests, reverse=True)
            longer, shorter = (planned, asked) if len(planned) >= len(asked) else (asked, planned)
            sizes = tuple(max(a, shorter[k]) if k < len(shorter) else a for k, a in enumerate(longer))
            self._plan(sizes)
        self._requests = []
        self._missed = False

    def _plan(self, sizes: tuple[int, ...]) -> None:
        replaced = bool(self._slabs)
        self._slabs, self.slabs, self._capacities, self._free = [], [], [], []
        if replaced:
            _release_cached_pinned()
        layout = slab_layout(sizes, self.max_slab)
        slabs = []
        for nbytes in layout.slabs:
            try:
                slabs.append(allocate_pinned(nbytes))
            except RuntimeError as exc:
                self.pinned = False
                log.warning("%s: pinning host memory failed (%s); its buffers use pageable memory from here on "
                            "(slower copies)", self.what, str(exc).splitlines()[0])
                return
        self._slabs, self.slabs = slabs, list(layout.slabs)
        for size, (slab, offset) in zip(sizes, layout.places, strict=True):
            if slab >= 0:
                self._capacities.append(aligned(size))
                self._free.append((aligned(size), slab, offset))
        self._free.sort()

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor of ``shape`` and ``dtype``: a view of the smallest free place that holds it, else
        a pageable tensor (and the next :meth:`start` plans for this forward's requests)."""
        nbytes = _nbytes(shape, dtype)
        if self.pinned:
            self._requests.append(nbytes)
            for k, (capacity, slab, offset) in enumerate(self._free):
                if capacity >= nbytes:
                    del self._free[k]
                    view = _view(self._slabs[slab], offset, shape, dtype)
                    self._live += 1
                    weakref.finalize(view, self._release, (capacity, slab, offset))
                    return view
            self._missed = True
        return torch.empty(tuple(shape), dtype=dtype)

    def _release(self, place: tuple[int, int, int]) -> None:
        """The tensor handed out from ``place`` is gone (a re-plan waits for every one of them)."""
        self._live -= 1
        self._free.append(place)
        self._free.sort()
