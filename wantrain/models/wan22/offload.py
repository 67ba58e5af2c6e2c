"""Activation offload (``model.offload_activations``): tensors autograd saves outside the checkpointed blocks go
to host memory during the forward pass and come back ahead of the backward pass's need for them.

With gradient checkpointing the saved tensors that stay on the device are each block's inputs (torch's
non-reentrant checkpoint saves them through the saved-tensor hooks in force around the block call) and the few
activations of the layers outside the blocks; everything the blocks' recompute saves is made inside the backward
pass, under the checkpoint's own hooks, and is not offloaded. A tensor saved several times (the text embeddings and
RoPE tables every block receives) is copied to the host once. Small tensors (under ``min_bytes``) stay where they
are.

Streams (CUDA): both directions run on one side stream, so they overlap compute. The device->host copy of a saved
tensor starts once the compute stream has written it (the side stream waits on the compute stream) and the tensor is
marked as used by the side stream (``record_stream``): the caching allocator does not hand its memory out again
until the copy has read it, even when autograd drops the tensor at once. A buffer a prefetch writes is allocated on
the side stream, so an exception in the backward pass (an out-of-memory error) that frees the graph returns it to
that stream's pool, where only work queued after its copy can reuse it: no buffer is freed under a copy in flight.
Once unpacked it is marked as used by the compute stream. The pinned host buffers are carved from a few pinned slabs
(``pinned.SlabPool``: no power-of-two rounding), planned from the buffers the first forward asked for (that forward
uses pageable buffers); a buffer's place is reused once its tensor is gone, by a copy queued on the same side
stream, behind every copy that used it before. The adapter's device and a tensor's are compared with
``wantrain.core.devices.same_device`` (``cuda`` and ``cuda:0`` are one device). Pinning that fails falls back to
pageable host memory with one warning.

Prefetch: every tensor sent to the host gets a place in the order it was saved. The backward pass unpacks them in
about the reverse order (block ``i``'s recompute starts by unpacking block ``i``'s inputs), so each unpack issues
the host->device copy of the nearest earlier saved tensor not yet copied back: while block ``i`` recomputes, block
``i - 1``'s inputs are on their way. On CUDA that copy runs on a side stream and the compute stream waits on its
event only when the tensor is unpacked; on a CPU the copy is synchronous (and the order of the copies is what tests
observe). At most one block's inputs are on the device ahead of their use.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from wantrain.core.devices import resolve_device, same_device
from wantrain.models.wan22 import pinned


class _Packed:
    """One saved tensor sent to the host: its place in the save order, the host copy, and the device copy issued
    ahead of its unpack (with its CUDA event)."""

    __slots__ = ("__weakref__", "device", "event", "host", "index", "ready")

    def __init__(self, index: int, device: torch.device, host: torch.Tensor) -> None:
        self.index, self.device, self.host = index, device, host
        self.ready: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None


class ActivationOffload:
    """Saved-tensor hooks moving large device tensors to ``host`` (pinned on CUDA) and prefetching them back.
    ``on_pack(nbytes)`` is called for every device->host copy, ``on_copy_back(index, nbytes)`` for every
    host->device copy with the tensor's place in the save order (tests, benchmarks). ``prefetch=False``: each
    tensor is copied back only when the backward pass unpacks it. ``pin`` false: pageable host buffers."""

    def __init__(self, device: torch.device, host: torch.device | str = "cpu", *, min_bytes: int = 1 << 20,
                 on_pack: Callable[[int], None] | None = None, on_copy_back: Callable[[int, int], None] | None = None,
                 prefetch: bool = True, pin: bool = True) -> None:
        self.device = resolve_device(device)
        self.host = torch.device(host)
        self.min_bytes = min_bytes
        self.on_pack = on_pack
        self.on_copy_back = on_copy_back
        self.prefetch = prefetch
        self._pin = pin and self.host.type == "cpu" and pinned.pinnable(self.device)
        self._pool = pinned.SlabPool("activation offload") if self._pin else None
        self._async = self.device.type == "cuda" and self.host.type == "cpu"
        self._stream = torch.cuda.Stream(self.device) if self._async and torch.cuda.is_available() else None
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
        # every _Packed of the last forward, in save order; weak: autograd's graph owns them, and they go with it
        self._order: list[weakref.ref] = []
        self._next = -1  # the highest place that may still need a prefetch

    @property
    def packed(self) -> int:
        """How many saved tensors of the current forward went to the host (each place in the save order)."""
        return len(self._order)

    def _pack(self, tensor: torch.Tensor):
        if not same_device(tensor.device, self.device) or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        key = id(tensor)
        seen = self._copies.get(key)
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            host = seen[2]
        else:
            host = self._host_buffer(tensor)
            if self._stream is None:
                host.copy_(tensor, non_blocking=self._pin)
            else:  # off the compute stream: it waits for nothing; the side stream waits for the tensor's writer
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._stream)  # its memory is not reused before the copy has read it
            self._copies[key] = (weakref.ref(tensor, lambda _r, key=key: self._copies.pop(key, None)),
                                 tensor._version, host)
            if self.on_pack is not None:
                self.on_pack(tensor.numel() * tensor.element_size())
        packed = _Packed(len(self._order), tensor.device, host)
        self._order.append(weakref.ref(packed))
        self._next = packed.index
        return packed

    def _host_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """An empty host tensor for ``tensor``: on CUDA from the pinned slabs (``pinned.SlabPool``; pageable in a
        forward whose buffers the slabs do not hold yet, and from here on, with one warning, once pinning failed)."""
        if self._pool is not None:
            return self._pool.take(tuple(tensor.shape), tensor.dtype)
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=self.host)

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        if packed.ready is None:
            self._copy_back(packed)
        out = packed.ready
        if packed.event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(packed.event)
            out.record_stream(compute)  # the side stream's pool must not reuse it while compute still reads it
            packed.event = None
        packed.ready = None  # the caller owns it now; a second unpack copies again
        if self.prefetch:
            self._prefetch_before(packed.index)
        return out

    def _prefetch_before(self, index: int) -> None:
        """Issue the copy back of the nearest tensor saved before place ``index`` that is still waiting."""
        self._next = min(self._next, index - 1)
        while self._next >= 0:
            packed = self._order[self._next]()
            self._next -= 1
            if packed is not None and packed.ready is None:
                self._copy_back(packed)
                return

    def _copy_back(self, packed: _Packed) -> None:
        if self.on_copy_back is not None:
            self.on_copy_back(packed.index, packed.host.numel() * packed.host.element_size())
        if self._stream is None:
            packed.ready = packed.host.to(packed.device, non_blocking=self._pin)
            return
        # Allocated on the side stream, so its memory belongs to that stream's pool: freed early (an exception in the
        # backward pass drops the graph), it is reused only by later work on the side stream, queued behind this
        # copy. The side stream first waits for the compute stream's earlier work.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            buffer = packed.host.to(packed.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        packed.ready, packed.event = buffer, event

    def _reset(self) -> None:
        """Drop the previous forward's prefetched copies (a backward that never ran, or stopped part way)."""
        for ref in self._order:
            packed = ref()
            if packed is not None:  # a buffer still being written is the side stream's: no copy lands in reuse
                packed.ready = packed.event = None
        self._order.clear()
        self._next = -1

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Offload what autograd saves inside this context."""
        self._reset()
        if self._pool is not None:
            self._pool.start()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._copies.clear()
