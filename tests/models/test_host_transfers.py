"""Host->device copies of the loop do not block the host: a cached batch is copied with ``non_blocking=True`` (from
pinned memory on CUDA, where that makes the copy asynchronous; the stream pins cached batches for a CUDA device).
On a CPU-only machine ``meta`` plays the device (tests/simulated_device.py) so that the copies are observable."""

from __future__ import annotations

import torch
from wan22_helpers import make_adapter, raw_batch

from tests.simulated_device import DEVICE, MetaAsDevice

_aten = torch.ops.aten


class _CopiesToDevice(MetaAsDevice):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._to_copy.default and args[0].device.type == "cpu" and str(kwargs.get("device")) == "meta":
            self.seen.append((tuple(args[0].shape), bool(kwargs.get("non_blocking"))))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_the_loss_copies_a_cached_batch_to_the_device_without_blocking():
    batch = make_adapter("tiny-t2v", experts="high_noise").encode_batch(raw_batch())
    with _CopiesToDevice() as copies:
        adapter = make_adapter("tiny-t2v", experts="high_noise", device=DEVICE, offload_device="cpu")
        copies.seen.clear()
        loss = adapter.loss(batch, "high_noise", torch.Generator().manual_seed(0))
        with adapter.evaluating():
            adapter.validation_loss(batch, 0.95, torch.zeros(batch["latents"].shape))
    assert loss.device == DEVICE
    batch_shapes = {tuple(batch["latents"].shape), tuple(batch["text_embeds"].shape)}
    of_batch = [blocking for shape, blocking in copies.seen if shape in batch_shapes]
    assert len(of_batch) == 6 and all(of_batch)  # latents, text and noise of each


class _OneBatchData:
    """The least of a TrainingData a BatchStream reads: one plan entry per epoch, one cached batch."""

    seed, steps_per_epoch, ranks = 0, 1, 1  # one process: no global draws

    def _usable_epoch(self, epoch, carry):
        return [((32, 32, 9), [0])], {}

    def rank_share(self, idx):
        return idx

    def sample_texts(self, epoch, index, idx):
        return ["" for _ in idx]

    def trained_samples(self, samples):
        return []

    def _batch_for(self, key, idx, encoders, cache):
        return {"latents": torch.zeros(1, 16, 3, 4, 4), "text_embeds": torch.zeros(1, 16, 32), "bucket": key}


def test_a_stream_for_a_cuda_device_pins_every_cached_tensor(monkeypatch):
    from wantrain.data.training import BatchStream

    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: pinned.append(tuple(self.shape)) or self)
    batch = next(iter(BatchStream(_OneBatchData(), None, pin_memory=True)))
    assert sorted(pinned) == [(1, 16, 3, 4, 4), (1, 16, 32)] and batch["bucket"] == (32, 32, 9)
    pinned.clear()
    next(iter(BatchStream(_OneBatchData(), None)))  # a CPU run: nothing to pin
    assert pinned == []
