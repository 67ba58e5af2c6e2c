"""Activation offload (``model.offload_activations``): tensors autograd saves outside the checkpointed blocks go
to host memory during the forward pass and come back when the backward pass unpacks them.

With gradient checkpointing the saved tensors that stay on the device are each block's inputs (torch's
non-reentrant checkpoint saves them through the saved-tensor hooks in force around the block call) and the few
activations of the layers outside the blocks; everything the blocks' recompute saves is made inside the backward
pass, under the checkpoint's own hooks, and is not offloaded. A tensor saved several times (the text embeddings and
RoPE tables every block receives) is copied once. Small tensors (under ``min_bytes``) stay where they are.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch


class ActivationOffload:
    """Saved-tensor hooks moving large device tensors to ``host`` (pinned on CUDA). ``on_pack(nbytes)`` is called
    for every copy made (tests, benchmarks)."""

    def __init__(self, device: torch.device, host: torch.device | str = "cpu", *, min_bytes: int = 1 << 20,
                 on_pack: Callable[[int], None] | None = None) -> None:
        self.device = torch.device(device)
        self.host = torch.device(host)
        self.min_bytes = min_bytes
        self.on_pack = on_pack
        self._pin = self.device.type == "cuda" and self.host.type == "cpu"
        self._copies: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}

    def _pack(self, tensor: torch.Tensor):
        if tensor.device != self.device or tensor.numel() * tensor.element_size() < self.min_bytes:
            return tensor
        key = id(tensor)
        seen = self._copies.get(key)
        if seen is not None and seen[0]() is tensor and seen[1] == tensor._version:
            return (tensor.device, seen[2])
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.host, pin_memory=self._pin)
        host.copy_(tensor, non_blocking=self._pin)
        self._copies[key] = (weakref.ref(tensor, lambda _r, key=key: self._copies.pop(key, None)), tensor._version,
                             host)
        if self.on_pack is not None:
            self.on_pack(tensor.numel() * tensor.element_size())
        return (tensor.device, host)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=self._pin)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Offload what autograd saves inside this context."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._copies.clear()
