"""Calls of an expert that another group of ranks holds (``model.expert_groups``; docs/distributed.md).

With one expert per group of GPUs, rank 0 holds the high-noise expert only, yet a sample video needs both: the
sampling pipeline runs on rank 0, and each time it calls the low-noise transformer the call is relayed to the
low-noise group's leader, which runs its expert on the inputs and sends the output back. Rank 0 keeps the
pipeline's whole state (the scheduler's history, the latent); what crosses between the groups is each call's
inputs (the latent at that step, the timestep, the prompt embeddings) and its output.

Protocol, point to point on the host-side gloo group (``ProcessGroupSync._patient_group``: no device memory, no
collective timeout while a round of samples takes minutes), between rank 0 (the *caller*) and one *server*:

* a message is its length, then one buffer: the JSON header's length and UTF-8 bytes, then each tensor's raw
  bytes (its dtype viewed as ``uint8``: bitwise whatever the dtype, bf16 included), built whole before sending;
* a call's header names the expert, its keyword arguments (tensor shape and dtype, or a plain JSON value);
  the reply's header describes the output tensors, then their bytes;
* ``{"done": true}`` ends a :meth:`ExpertRelay.serve` loop; rank 0 sends it when its round ends, also on an error;
* an error of the server's expert goes back as ``{"error": ...}``: rank 0 raises it (its round ends, done is
  sent) and the server raises its own exception once done arrives: both ranks fail with the cause, none hangs.
  So does any failure on the server during a round, inside :meth:`ExpertRelay.serve` (a context's stacked LoRA,
  copying the inputs, packing the reply) or around it (bringing the expert in: :meth:`ExpertRelay.serving`).

Every other rank waits in the round's barrier (``sync.wait_for_rank0``) meanwhile; the server reaches it after
its loop ends. The output is computed by the same weights on the same kind of device as a one-process run would,
so a sample equals that run's bit for bit (tests/test_expert_groups_run.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class ExpertRelay:
    """Rank 0's link to the rank that holds ``expert`` (``server``). ``group``: a callable returning the gloo
    process group to use (it is created lazily by the sync). ``device``: where outputs go on rank 0 and inputs on
    the server."""

    def __init__(self, group: Callable[[], Any], rank: int, server: int, expert: str | None,
                 device: torch.device) -> None:
        self._group, self.rank, self.server, self.expert, self.device = group, rank, server, expert, device
        self.calls = 0  # relayed calls made (rank 0) or served (the server), over the run
        self._finished = True  # the server: rank 0's done of the current round arrived (serving())

    @property
    def serves(self) -> bool:
        """Whether this rank answers the calls (the holding group's leader)."""
        return self.rank == self.server

    # -- messages --------------------------------------------------------------------------------------------
    def _send(self, header: dict[str, Any], tensors: list[torch.Tensor], dst: int) -> None:
        """One message: its length, then the header and every tensor's bytes in one buffer, built whole before
        the first byte leaves (an error while building it sends nothing: the other end never waits for a part)."""
        import torch.distributed as dist

        group = self._group()
        buffer = pack_message(header, tensors)
        dist.send(torch.tensor([buffer.numel()], dtype=torch.int64), dst=dst, group=group)
        dist.send(buffer, dst=dst, group=group)

    def _receive(self, src: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
        import torch.distributed as dist

        group = self._group()
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, src=src, group=group)
        buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(buffer, src=src, group=group)
        return unpack_message(buffer)

    # -- rank 0 ----------------------------------------------------------------------------------------------
    def call(self, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        """Run the server's expert on ``kwargs`` (tensors and JSON values) and return its output tensors, on
        :attr:`device`. Blocks until the reply arrives (a device->host copy of the inputs: a sync)."""
        header, tensors = pack_kwargs(kwargs)
        header["expert"] = self.expert
        self._send(header, tensors, self.server)
        reply, outputs = self._receive(self.server)
        if "error" in reply:  # the serving rank's expert raised: it waits for done, then raises it there too
            raise RuntimeError(f"the {self.expert} expert on rank {self.server} failed on a relayed call: "
                               f"{reply['error']}")
        self.calls += 1
        return tuple(t.to(self.device) for t in outputs)

    def context(self, **values: Any) -> None:
        """Tell the server what holds until the next context (JSON values; the sample observer: the next video's
        stacked LoRAs for its expert). Its :meth:`serve` hands them to its ``context`` callback."""
        self._send({"context": values}, [], self.server)

    def done(self) -> None:
        """End the server's :meth:`serve` loop (rank 0, once per round; also after an error)."""
        self._send({"done": True}, [], self.server)

    # -- the server -------------------------------------------------------------------------------------------
    def serve(self, run: Callable[..., Any], context: Callable[[dict[str, Any]], None] | None = None, *,
              failed: BaseException | None = None) -> int:
        """Answer rank 0's calls with ``run(**kwargs)`` (a transformer: its output's tensors go back) until rank 0
        sends done; returns the number of calls answered. The inputs arrive on :attr:`device`. ``context``:
        called with the values of each :meth:`context` message. Whatever fails after a message arrived (a
        context's stacked LoRA, copying the inputs, the expert, packing the reply) is answered to rank 0's call
        as an error and raised here once done arrives (after a context's failure every later call is answered with
        it); ``failed``: a failure from before the loop (every call is answered with it)."""
        answered, blocking = 0, failed  # blocking: every later call fails with it (no expert, a LoRA not applied)
        while True:
            header, tensors = self._receive(0)
            if header.get("done"):
                self._finished = True
                if failed is not None:
                    raise failed
                return answered
            is_call = "context" not in header
            try:
                if blocking is not None:
                    raise blocking
                if not is_call:
                    if context is not None:
                        context(header["context"])
                    continue
                out = run(**unpack_kwargs(header, tensors, self.device))
                outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,))
                           if isinstance(t, torch.Tensor)]
                reply, _ = pack_kwargs({str(i): t for i, t in enumerate(outputs)})
            except Exception as exc:  # noqa: BLE001 -- said to rank 0 (which ends its round), raised here after done
                failed = failed or exc
                if not is_call:  # the video's context is not in place: its calls would compute something else
                    blocking = blocking or exc
                if is_call:
                    self._send({"error": f"{type(exc).__name__}: {exc}"}, [], 0)
                continue
            self._send(reply, outputs, 0)
            answered += 1
            self.calls += 1

    @contextmanager
    def serving(self) -> Iterator[None]:
        """On the serving rank, around everything it does for rank 0's round (bringing its expert in, applying a
        video's stacked LoRAs, :meth:`serve`): an exception raised inside before rank 0's done arrived is
        answered to each of rank 0's remaining calls and raised once done arrives, so rank 0's round ends with
        the cause and neither rank waits for the other."""
        self._finished = False
        try:
            yield
        except Exception as exc:
            if not self._finished:
                self.serve(lambda **_: None, failed=exc)  # drains rank 0's messages; raises exc at done
            raise


def pack_message(header: dict[str, Any], tensors: list[torch.Tensor]) -> torch.Tensor:
    """One message as one ``uint8`` buffer: the JSON header's length and UTF-8 bytes, then each tensor's raw bytes
    (its dtype viewed as ``uint8``: bitwise whatever the dtype), on the CPU."""
    data = json.dumps(header).encode()
    parts = [torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8),
             torch.frombuffer(bytearray(data), dtype=torch.uint8)]
    for t in tensors:  # a standard layout whatever the strides (an expanded timestep has stride 0)
        dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
        parts.append(dense.reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def unpack_message(buffer: torch.Tensor) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """:func:`pack_message`'s header and tensors (``header["tensors"]``: each one's shape and dtype, in order)."""
    size = int(buffer[:8].view(torch.int64).item())
    header = json.loads(bytes(buffer[8:8 + size].numpy().tobytes()))
    tensors, offset = [], 8 + size
    for spec in header.get("tensors", []):
        dtype = getattr(torch, spec["dtype"])
        count = torch.Size(spec["shape"]).numel() * torch.empty((), dtype=dtype).element_size()
        tensors.append(buffer[offset:offset + count].clone().view(dtype).reshape(spec["shape"]))
        offset += count
    return header, tensors


def pack_kwargs(values: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Keyword arguments -> (header with each tensor's place, shape and dtype; the tensors in order)."""
    plain, specs, tensors = {}, [], []
    for name, value in values.items():
        if isinstance(value, torch.Tensor):
            specs.append({"name": name, "shape": list(value.shape), "dtype": str(value.dtype).split(".")[-1]})
            tensors.append(value)
        else:
            plain[name] = value  # None, bools, numbers: JSON as they are (anything else is a bug: TypeError)
    return {"kwargs": plain, "tensors": specs}, tensors


def unpack_kwargs(header: dict[str, Any], tensors: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """:func:`pack_kwargs` undone, the tensors moved to ``device``."""
    kwargs = dict(header["kwargs"])
    for spec, t in zip(header["tensors"], tensors, strict=True):
        kwargs[spec["name"]] = t.to(device)
    return kwargs


class RelayedExpert(nn.Module):
    """Stands in on rank 0 for the expert another group holds, where the sampling pipeline expects a transformer:
    calling it relays the call (:class:`ExpertRelay`) and returns the server's output tuple (the pipelines pass
    ``return_dict=False``). It has no parameters: nothing of it is placed, trained or saved."""

    def __init__(self, relay: ExpertRelay) -> None:
        super().__init__()
        self.relay = relay

    @property
    def device(self) -> torch.device:
        """Where its outputs arrive (diffusers' pipelines ask each component for its device)."""
        return self.relay.device

    def forward(self, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        return self.relay.call(**kwargs)

    @contextmanager
    def cache_context(self, name: str, **_: Any) -> Iterator[None]:
        """diffusers' pipelines open one around each call; nothing is cached on this side."""
        yield


__all__ = ["ExpertRelay", "RelayedExpert"]
