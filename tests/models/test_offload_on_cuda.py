"""Activation offload on a CUDA adapter, on a CPU-only machine: fake CUDA tensors (``FakeTensorMode``: a tensor made
with ``device="cuda"`` reports ``cuda:0``) and, for the streams, a recorder standing in for ``torch.cuda``'s
streams and events. Autograd cannot run on fake CUDA tensors in a CPU build of torch, so the saved-tensor hooks are
called as autograd calls them: pack in the forward order, unpack in about the reverse order."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from wantrain.core.devices import resolve_device, same_device
from wantrain.models.wan22.offload import ActivationOffload

MIB = 2**20


def test_cuda_and_cuda_0_are_one_device_and_other_indices_or_types_are_not():
    assert same_device("cuda", "cuda:0") and same_device(torch.device("cuda:0"), "cuda")
    assert not same_device("cuda", "cuda:1") and not same_device("cuda:0", "cpu")
    assert same_device("cpu", torch.device("cpu")) and same_device("meta", "meta")
    assert resolve_device("cuda") == torch.device("cuda:0")  # no CUDA here: the index a fake CUDA tensor reports


def test_a_cuda_adapter_offloads_cuda_tensors_and_brings_them_back_to_their_device():
    sizes = []
    offload = ActivationOffload(torch.device("cuda"), "cpu", on_pack=sizes.append)
    with FakeTensorMode():
        block_input = torch.randn(512, 1024, device="cuda")  # 2 MiB, float32
        small = torch.randn(16, device="cuda")
        assert block_input.device == torch.device("cuda:0")  # what a real CUDA tensor reports too
        packed, kept = offload._pack(block_input), offload._pack(small)
        assert packed is not block_input and kept is small  # under min_bytes: stays where it is
        assert packed.host.device.type == "cpu" and packed.host.shape == block_input.shape
        back = offload._unpack(packed)
    assert sizes == [2 * MIB] and offload.packed == 1
    assert back.device == torch.device("cuda:0") and back.shape == block_input.shape


class _Streams:
    """``torch.cuda``'s streams, events and ``Tensor.record_stream``, recorded: ``log`` holds ("wait", stream, on),
    ("copy", stream, to device type), ("record_stream", stream, tensor id), ("event", stream, id),
    ("wait_event", stream, id) in the order the offload issues them."""

    def __init__(self, monkeypatch) -> None:
        self.log: list[tuple] = []
        self.current = "compute"
        streams = self

        class Stream:
            def __init__(self, name: str = "side", *args, **kwargs) -> None:
                self.name = name if isinstance(name, str) else "side"

            def wait_stream(self, other) -> None:
                streams.log.append(("wait", self.name, other.name))

            def wait_event(self, event) -> None:
                streams.log.append(("wait_event", self.name, event.id))

        class Event:
            count = 0

            def __init__(self) -> None:
                Event.count += 1
                self.id = Event.count

            def record(self, stream) -> None:
                streams.log.append(("event", stream.name, self.id))

            def synchronize(self) -> None:
                streams.log.append(("synchronize", self.id))

        @contextlib.contextmanager
        def stream(s):
            before, streams.current = streams.current, s.name
            try:
                yield
            finally:
                streams.current = before

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(streams.current))
        monkeypatch.setattr(torch.Tensor, "record_stream",
                            lambda t, s: streams.log.append(("record_stream", s.name, id(t))), raising=False)

    def copies(self):
        """A dispatch mode logging every cross-device copy with the stream it was issued on."""
        streams = self

        class Copies(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten.copy_.default and args[0].device.type != args[1].device.type:
                    streams.log.append(("copy", streams.current, args[0].device.type))
                target = (kwargs or {}).get("device")
                if func is torch.ops.aten._to_copy.default and target is not None and \
                        torch.device(target).type != args[0].device.type:
                    streams.log.append(("copy", streams.current, torch.device(target).type))
                return func(*args, **(kwargs or {}))

        return Copies()


def test_the_device_to_host_copy_runs_on_the_side_stream_after_the_tensor_is_written(monkeypatch):
    streams = _Streams(monkeypatch)
    offload = ActivationOffload(torch.device("cuda"), "cpu")
    with FakeTensorMode():
        x = torch.randn(512, 1024, device="cuda")
        with streams.copies():
            offload._pack(x)
    # the side stream waits for the compute stream (which wrote x), copies off the compute stream, and x's memory
    # is not handed out again before that copy has read it
    assert streams.log == [("wait", "side", "compute"), ("copy", "side", "cpu"), ("record_stream", "side", id(x))]


def test_a_prefetched_buffer_is_never_freed_while_its_copy_is_in_flight(monkeypatch):
    """An out-of-memory error in the backward pass drops the graph, and with it the buffers prefetches are still
    writing: each is allocated on the side stream (its pool is reused only by work queued behind the copy); the
    compute stream uses one only after waiting on its copy's event, and marks it as its own when it does."""
    streams = _Streams(monkeypatch)
    offload = ActivationOffload(torch.device("cuda"), "cpu")
    with FakeTensorMode():
        inputs = [torch.randn(512, 1024, device="cuda") for _ in range(3)]
        packed = [offload._pack(x) for x in inputs]
        streams.log.clear()
        with streams.copies():
            last = offload._unpack(packed[2])  # copies block 2's input back and prefetches block 1's
        prefetched = packed[1].ready
        assert prefetched is not None and packed[1].event is not None
        assert [e for e in streams.log if e[0] == "copy"] == [("copy", "side", "cuda")] * 2
        first_event = next(e[2] for e in streams.log if e[0] == "event")
        # the unpacked tensor: the compute stream waits on its copy, then owns it; the prefetched one is untouched
        assert [e for e in streams.log if e[0] in ("wait_event", "record_stream")] == [
            ("wait_event", "compute", first_event), ("record_stream", "compute", id(last))]
        streams.log.clear()
        assert offload._unpack(packed[1]) is prefetched
        assert ("record_stream", "compute", id(prefetched)) in streams.log
        assert packed[0].event is not None  # prefetched, never unpacked: the backward stopped here
        streams.log.clear()
        offload._reset()  # the next forward drops it without waiting on the host (its memory is the side stream's)
        assert packed[0].ready is None and streams.log == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (real streams)")
def test_offload_on_a_real_cuda_adapter_gives_the_same_gradients():
    x = torch.randn(256, 1024, device="cuda", requires_grad=True)
    w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    ((x @ w).relu() @ w).sum().backward()
    expected = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    sizes = []
    offload = ActivationOffload(torch.device("cuda"), "cpu", min_bytes=1, on_pack=sizes.append)
    with offload.active():
        ((x @ w).relu() @ w).sum().backward()
    assert sizes and torch.equal(x.grad, expected[0]) and torch.equal(w.grad, expected[1])
