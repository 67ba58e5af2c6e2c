"""Rank 0's calls of an expert whose forward every rank must run (``model.parallel = "fsdp"``: each block's
all-gather; ``model.sequence_degree``: each attention's all-to-all), repeated on every other rank
(docs/distributed.md, "Validation and samples under fsdp and Ulysses").

A round of samples runs diffusers' pipeline on rank 0 alone (the scheduler's state, the VAE, the files), yet each
call of a sharded or sequence-split transformer is a collective: the other ranks must make the same call at the
same point or rank 0 waits in its first all-gather for ever. So rank 0 announces each call before it starts --
the expert and its keyword arguments, broadcast on the host-side gloo group (``ProcessGroupSync._patient_group``:
no collective timeout while a round takes minutes) -- and every other rank, following, runs the same expert on the
same inputs and drops the output: under FSDP the inputs only need the right shapes, under Ulysses they must be
rank 0's (each rank of a sequence group attends over its part of the same clip). An expert only rank 0 holds (the
sampling-only expert of a one-expert run) is not announced: its calls involve no other rank.

Protocol: each message is a broadcast of its length, then one broadcast of ``expert_relay.pack_message``'s buffer
(the JSON header and the tensors' raw bytes: bitwise). ``{"done": true}`` ends a follower's loop; rank 0 sends it
when its round ends, also after an error, so no follower waits for a call that will not come. A follower whose own
call fails raises: its exception leaves the run and ``core.parallel.failures`` ends rank 0, which waits inside that
call's collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from wantrain.core.parallel.expert_relay import pack_kwargs, pack_message, unpack_kwargs, unpack_message


class MirroredCalls:
    """Rank 0's announcements of its collective experts' calls and every other rank's repetition of them.
    ``group``: a callable returning the gloo process group of every rank (created lazily by the sync)."""

    def __init__(self, group: Callable[[], Any], rank: int, device: torch.device) -> None:
        self._group, self.rank, self.device = group, rank, device
        self.calls = 0  # calls announced (rank 0) or repeated (the others), over the run

    def _broadcast(self, header: dict[str, Any] | None = None, tensors: list[torch.Tensor] = ()
                   ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Rank 0's message on every rank (rank 0 passes it, the others receive it)."""
        import torch.distributed as dist

        group = self._group()
        buffer = pack_message(header, list(tensors)) if self.rank == 0 else None
        length = torch.tensor([buffer.numel() if buffer is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=group)
        if buffer is None:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=group)
        return (header, list(tensors)) if self.rank == 0 else unpack_message(buffer)

    # -- rank 0 ------------------------------------------------------------------------------------------------
    def announce(self, expert: str | None, kwargs: Mapping[str, Any]) -> None:
        """Tell every other rank that ``expert`` is called on ``kwargs`` (tensors and JSON values) now."""
        header, tensors = pack_kwargs(dict(kwargs))
        header["expert"] = expert
        self._broadcast(header, tensors)
        self.calls += 1

    def done(self) -> None:
        """End every follower's :meth:`follow` loop (rank 0, once per round; also after an error)."""
        self._broadcast({"done": True})

    @contextmanager
    def announced(self, transformers: Mapping[str | None, nn.Module]) -> Iterator[None]:
        """Inside, every call of one of ``transformers`` (by expert) on rank 0 is announced before anything of it
        runs: a forward pre-hook placed ahead of FSDP's and diffusers' own (``prepend``), so the followers reach
        the call's first collective with rank 0. Positional arguments are refused (the pipelines pass keywords)."""
        def hook_for(expert: str | None) -> Callable[..., None]:
            def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                if args:
                    raise TypeError(f"a mirrored call of the {expert} expert takes keyword arguments only")
                self.announce(expert, kwargs)
            return hook

        handles = [t.register_forward_pre_hook(hook_for(e), prepend=True, with_kwargs=True)
                   for e, t in transformers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- the other ranks -----------------------------------------------------------------------------------------
    def follow(self, run: Callable[..., Any]) -> int:
        """Repeat rank 0's announced calls, ``run(expert, **kwargs)`` each (the output is dropped), until rank 0
        sends done; returns the number of calls repeated. The inputs arrive on :attr:`device`."""
        repeated = 0
        while True:
            header, tensors = self._broadcast()
            if header.get("done"):
                return repeated
            run(header["expert"], **unpack_kwargs(header, tensors, self.device))
            repeated += 1
            self.calls += 1


__all__ = ["MirroredCalls"]
