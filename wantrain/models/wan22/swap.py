"""Block swap: the frozen base weights of the last N transformer blocks live on the host and visit the device one
block at a time (``model.blocks_to_swap``, docs/models.md "Memory").

The blocks are counted in the order a forward pass runs them (:func:`run_order`): a VACE transformer runs its VACE
blocks first (they compute every control hint before the main blocks start) and then its main blocks, so its last N
blocks are main blocks, and N above the main blocks' count swaps VACE blocks too, the last one first. The backward
pass (gradient checkpointing's recompute) runs them in the reverse order: autograd's ready queue takes the most
recently created node first, and every main block's node is younger than every VACE block's.

Each swapped block keeps one host copy of its frozen tensors (the loaded tensors; copying to CUDA, copies carved
from a few pinned slabs, ``pinned.py``, without the pinned allocator's power-of-two rounding) and, while it is not
needed, a ``meta`` placeholder of the same shape on the module: running an unloaded block fails loudly instead of
computing with stale weights. A small ring of ``ring`` device slots holds the loaded blocks; loading a block into a
full ring evicts the block used longest ago. Just before block ``k`` runs (forward
pre-hook: the forward pass and gradient checkpointing's recompute in the backward pass alike) it is made resident
and the next swapped block in run order is copied ahead, on a side CUDA stream (no stream on the CPU: the copy is
synchronous); the run order is reversed inside the backward pass (recompute goes from the last block to the first).
Nothing is ever copied back: the base weights never change. LoRA parameters (``requires_grad``) are never touched,
so their gradients and optimizer state stay on the device.

Frozen tensors are swapped by replacing the module's ``Parameter`` objects, not their ``.data``: the non-reentrant
checkpoint saves a frozen parameter used by an op (a norm's weight) as the object itself, so a fresh object per load
keeps every tensor saved for backward valid whenever the ring evicts it; the evicted buffer's memory is freed when
the last saved reference to it goes. Needs gradient checkpointing in training (without it every block's weights
would stay referenced until the backward pass, and the swap would save nothing): the model config refuses that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from wantrain.core.devices import resolve_device
from wantrain.models.wan22 import pinned
from wantrain.models.wan22.single_file import trim_heap


def run_order(transformer: nn.Module) -> list[nn.Module]:
    """``transformer``'s blocks in the order its forward pass runs them: a VACE transformer's ``vace_blocks``, then
    the main ``blocks`` (every other Wan transformer: its ``blocks``)."""
    return [*getattr(transformer, "vace_blocks", ()), *transformer.blocks]


def run_order_names(transformer: nn.Module) -> list[str]:
    """The module names of :func:`run_order` (``vace_blocks.0``, ..., ``blocks.0``, ...)."""
    vace = [f"vace_blocks.{k}" for k in range(len(getattr(transformer, "vace_blocks", ())))]
    return [*vace, *(f"blocks.{k}" for k in range(len(transformer.blocks)))]


def swapped_blocks(transformer: nn.Module, count: int) -> tuple[list[nn.Module], range]:
    """(:func:`run_order` of ``transformer``, the indices into it of its last ``count`` blocks): what a
    :class:`BlockSwap` of ``model.blocks_to_swap = count`` takes."""
    blocks = run_order(transformer)
    return blocks, range(len(blocks) - count, len(blocks))


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (checkpoint recompute runs inside it)."""
    return torch._C._current_graph_task_id() != -1


class BlockSwap:
    """Swap the frozen tensors of ``blocks[i]`` for ``i`` in ``swapped`` through a ring of ``ring`` device slots.
    ``blocks``: every block of ``root`` in the order its forward pass runs them (:func:`run_order`), swapped or not
    (each one's forward pre-hook prefetches the next swapped block).

    The frozen tensors the blocks hold when this is built are taken as the host copies (they must not be on the
    device). ``on_copy(block_index)`` is called for every host->device block copy (tests, benchmarks). ``pin``
    false (``model.pin_host_copies = false``): the host copies stay pageable.
    """

    def __init__(self, root: nn.Module, blocks: Sequence[nn.Module], swapped: Sequence[int], device: torch.device, *,
                 ring: int = 2, on_copy: Callable[[int], None] | None = None, pin: bool = True) -> None:
        if ring < 1:
            raise ValueError(f"the swap ring needs at least one slot, got {ring}")
        self.device = resolve_device(device)
        self.blocks = blocks
        self.swapped: tuple[int, ...] = tuple(sorted(set(swapped)))
        self.ring = ring
        self.on_copy = on_copy
        self.pin = pin
        self._host: dict[int, list[tuple[nn.Module, str, bool, torch.Tensor]]] = {i: [] for i in self.swapped}
        entries = []  # (block, module, name, is_parameter) of every frozen tensor of the swapped blocks
        for i in self.swapped:
            for module in blocks[i].modules():
                for name, param in module._parameters.items():
                    if param is not None and not param.requires_grad:
                        entries.append((i, module, name, True))
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        entries.append((i, module, name, False))
        for (i, module, name, is_param), host in zip(entries, self._host_copies(entries), strict=True):
            self._host[i].append((module, name, is_param, host))
        self._loaded: list[int] = []  # least recently used first
        self.dropped = False  # the host copies were dropped (drop_host): the expert waits on disk
        self._refs: dict[int, list[StorageWeakRef]] = {}
        self._events: dict[int, torch.cuda.Event] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        for i in self.swapped:
            self._set(i, None)
        self._handles = [root.register_forward_pre_hook(self._before_model)]
        self._handles += [block.register_forward_pre_hook(self._before_block(k)) for k, block in enumerate(blocks)]

    def _host_copies(self, entries: list[tuple[int, nn.Module, str, bool]]) -> list[torch.Tensor]:
        """The host copy of every entry: the tensor the module holds, or, copying to CUDA (asynchronous copies need
        page-locked memory), a copy carved from pinned slabs (``pinned.py``: no power-of-two rounding). Each
        original is replaced by its placeholder once copied, so building holds at most one slab more than the
        tensors. Where pinning fails the originals stay (pageable; one warning)."""
        def held(module: nn.Module, name: str, is_param: bool) -> torch.Tensor:
            return module._parameters[name].data if is_param else module._buffers[name]

        hosts = [held(m, n, p) for _, m, n, p in entries]
        if not (self.pin and pinned.pinnable(self.device) and all(h.device.type == "cpu" for h in hosts)):
            return hosts
        specs = [(tuple(h.shape), h.dtype) for h in hosts]
        hosts = [None] * len(entries)  # the originals: only the modules hold them now
        for index, view in pinned.PinnedSlabs("block swap").views(specs):
            _, module, name, is_param = entries[index]
            original = held(module, name, is_param)
            if view is None:
                hosts[index] = original
                continue
            view.copy_(original)
            hosts[index] = view
            placeholder = torch.empty_like(view, device="meta")
            if is_param:
                module._parameters[name] = nn.Parameter(placeholder, requires_grad=False)
            else:
                module._buffers[name] = placeholder
            del original
        return hosts

    # -- hooks ---------------------------------------------------------------------------------------------
    def _before_model(self, module: nn.Module, args) -> None:
        if self.swapped and not _in_backward():
            self.prefetch(self.swapped[0])

    def _before_block(self, k: int):
        def hook(module: nn.Module, args) -> None:
            backward = _in_backward()
            if k in self._host:
                self.load(k)
                self._wait(k)
                self._loaded.remove(k)
                self._loaded.append(k)  # most recently used: the last one the ring evicts
            following = self._following(k, -1 if backward else 1)
            if following is not None and self.ring > 1:
                self.prefetch(following)
        return hook

    def _following(self, k: int, direction: int) -> int | None:
        later = [i for i in self.swapped if (i - k) * direction > 0]
        if not later:
            return None
        return min(later) if direction > 0 else max(later)

    # -- loading -------------------------------------------------------------------------------------------
    def prefetch(self, k: int) -> None:
        """Start copying block ``k`` to the device (on the side stream on CUDA) unless it is resident."""
        self.load(k)

    def load(self, k: int) -> None:
        if k in self._loaded:
            return
        if len(self._loaded) >= self.ring:
            self.evict(self._loaded[0])
        buffers = []
        if self._stream is not None:
            # The buffers are allocated on the compute stream; the copy must not start before the work queued there
            # that may still use the memory they reuse.
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for _, _, _, host in self._host[k]:
                    buffers.append(self._copy(host))
            event = torch.cuda.Event()
            event.record(self._stream)
            self._events[k] = event
        else:
            buffers = [self._copy(host) for _, _, _, host in self._host[k]]
        self._set(k, buffers)
        self._refs[k] = [StorageWeakRef(b.untyped_storage()) for b in buffers]
        self._loaded.append(k)
        if self.on_copy is not None:
            self.on_copy(k)

    def _copy(self, host: torch.Tensor) -> torch.Tensor:
        buffer = torch.empty_like(host, device=self.device)
        buffer.copy_(host, non_blocking=self._stream is not None)
        return buffer

    def _wait(self, k: int) -> None:
        event = self._events.pop(k, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def evict(self, k: int) -> None:
        """Put the placeholders back on block ``k``; its device memory goes with the last reference to it."""
        self._wait(k)  # a prefetched copy that never ran must not land in freed memory
        self._loaded.remove(k)
        self._set(k, None)

    def release(self) -> None:
        """Evict every loaded block (the expert leaves the device)."""
        for k in list(self._loaded):
            self.evict(k)

    def _set(self, k: int, buffers: list[torch.Tensor] | None) -> None:
        for j, (module, name, is_param, host) in enumerate(self._host[k]):
            value = torch.empty_like(host, device="meta") if buffers is None else buffers[j]
            if is_param:
                module._parameters[name] = nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[name] = value

    @contextlib.contextmanager
    def excluded(self) -> Iterator[None]:
        """Evict every block and take the swapped frozen tensors off the modules for the duration (``Module.to`` of
        the whole expert then moves everything else and leaves the host copies alone)."""
        self.release()
        for entries in self._host.values():
            for module, name, is_param, _ in entries:
                (module._parameters if is_param else module._buffers)[name] = None
        try:
            yield
        finally:
            for k in self.swapped:
                self._set(k, None)

    # -- the waiting expert on disk (model.waiting_expert = "disk", waiting.py) ------------------------------
    def drop_host(self) -> None:
        """Evict every block and drop the host copies (empty ``meta`` placeholders keep their shapes and dtypes):
        the expert leaves for disk. :meth:`restore_host` brings them back."""
        self.release()
        for entries in self._host.values():
            entries[:] = [(m, n, p, torch.empty_like(h, device="meta")) for m, n, p, h in entries]
        self.dropped = True
        trim_heap()  # the freed copies' pages back to the system (pinned slabs: torch's host allocator keeps them)

    def restore_host(self, read: Callable[[nn.Module, str], torch.Tensor]) -> None:
        """New host copies after :meth:`drop_host`: ``read(module, name)`` gives each tensor (from the waiting
        file), copied into pinned slabs as at the build (``pinned.py``; the slabs the expert that left dropped are
        what torch's pinned allocator hands out again: same sizes), else kept as read."""
        if not self.dropped:
            return
        entries = [(i, k, entry) for i, rows in self._host.items() for k, entry in enumerate(rows)]
        pin = self.pin and pinned.pinnable(self.device)
        views = pinned.PinnedSlabs("block swap").views([(tuple(e[3].shape), e[3].dtype) for *_, e in entries]) \
            if pin else ((index, None) for index in range(len(entries)))
        for index, view in views:
            i, k, (module, name, is_param, _) = entries[index]
            value = read(module, name)
            if view is not None:
                view.copy_(value)
                value = view
            self._host[i][k] = (module, name, is_param, value)
        self.dropped = False

    # -- inspection ----------------------------------------------------------------------------------------
    @property
    def loaded(self) -> tuple[int, ...]:
        """Swapped blocks whose weights are on the device now (least recently used first)."""
        return tuple(self._loaded)

    def live_blocks(self) -> list[int]:
        """Swapped blocks any of whose device copies is still alive (loaded, or kept by autograd after eviction)."""
        return sorted(k for k, refs in self._refs.items() if any(not r.expired() for r in refs))

    def host_bytes(self) -> int:
        return sum(h.numel() * h.element_size() for entries in self._host.values() for *_, h in entries)

    def block_bytes(self) -> int:
        """Device bytes of the largest swapped block (one ring slot)."""
        return max((sum(h.numel() * h.element_size() for *_, h in e) for e in self._host.values()), default=0)

    def remove(self) -> None:
        """Detach the hooks and put the host copies back on the modules (the blocks become ordinary host blocks)."""
        for handle in self._handles:
            handle.remove()
        self._loaded.clear()
        for entries in self._host.values():
            for module, name, is_param, host in entries:
                if is_param:
                    module._parameters[name] = nn.Parameter(host, requires_grad=False)
                else:
                    module._buffers[name] = host
