"""One device->host sync per log interval: the metric observers add none, and the counter would catch one."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from wantrain.core.events import MetricsLogged
from wantrain.observers.jsonl_metrics import JsonlMetrics
from wantrain.observers.memory_probe import MemoryProbe
from wantrain.observers.norms import Norms
from wantrain.observers.progress import ProgressLine
from wantrain.observers.tensorboard import TensorBoardWriter

from .fakes import ConvertsEveryStep, CountingBus, FakeLoop, LoraAdapter, SyncCounter, batches


def metric_observers(tmp_path):
    return [Norms(), MemoryProbe(), TensorBoardWriter(tmp_path / "tb", hparams={"train": {"lr": 0.05}}),
            JsonlMetrics(tmp_path / "metrics.jsonl"), ProgressLine(stream=io.StringIO())]


def syncs_outside_gather(loop: FakeLoop, counter: SyncCounter) -> dict[int, int]:
    """Conversions per step beyond the core's one ``gather`` on log steps."""
    allowed = dict.fromkeys(loop.log_steps(), 1)
    return {step: n - allowed.get(step, 0) for step, n in counter.counts.items() if n != allowed.get(step, 0)}


def test_metric_observers_cause_no_host_conversion_besides_the_log_step_gather(tmp_path):
    counter = SyncCounter()
    loop = FakeLoop(metric_observers(tmp_path), run_dir=tmp_path, total_steps=7, log_every=3, counter=counter)
    logged = loop.run()
    assert [e.step for e in logged] == [3, 6, 7]
    assert "train/grad_norm" in logged[0].values  # the observers did run and put metrics
    assert not loop.failures
    assert syncs_outside_gather(loop, counter) == {}
    assert [counter.counts[s] for s in loop.log_steps()] == [1, 1, 1]


def run_real_loop(tmp_path, observers, counter: SyncCounter) -> list[MetricsLogged]:
    from wantrain.core.loop import LoopSettings, Trainer

    adapter, logged = LoraAdapter(), []
    bus = CountingBus(counter)
    for observer in observers:
        bus.attach(observer)
    bus.subscribe(MetricsLogged, lambda e, c: logged.append(e))
    trainer = Trainer(adapter=adapter, batches=batches(), optimizer=torch.optim.AdamW(adapter.param_groups()),
                      settings=LoopSettings(max_steps=7, log_every=3, grad_accum=2, clip_grad_norm=1.0), bus=bus,
                      run_dir=tmp_path)
    assert trainer.run().status == "completed"
    return logged


def test_metric_observers_in_the_real_loop_convert_no_tensor_while_handling_events(tmp_path):
    counter = SyncCounter()
    logged = run_real_loop(tmp_path, metric_observers(tmp_path), counter)
    assert [e.step for e in logged] == [3, 6, 7] and "train/grad_norm/low_noise" in logged[0].values
    assert counter.calls == []  # the core's own gather runs outside dispatch; handlers convert nothing
    # negative control: the same counting bus sees an observer's per-step .item()
    counter = SyncCounter()
    run_real_loop(tmp_path / "negative", [*metric_observers(tmp_path / "negative"), ConvertsEveryStep()], counter)
    assert sorted({step for step, _ in counter.calls}) == list(range(1, 8))


@pytest.mark.parametrize("how", ["item", "float", "bool", "tolist", "cpu", "repr"])
def test_sync_counter_catches_an_observer_that_converts_a_tensor_every_step(tmp_path, how):
    counter = SyncCounter()
    negative = ConvertsEveryStep(how)
    loop = FakeLoop([*metric_observers(tmp_path), negative], run_dir=tmp_path, total_steps=7, log_every=3,
                    grad_accum=2, counter=counter)
    loop.run()
    assert len(negative.seen) == 14  # it ran on every micro-step
    extra = syncs_outside_gather(loop, counter)
    assert extra == dict.fromkeys(range(1, 8), 2)  # two micro-steps per optimizer step, on every step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_observers_do_not_synchronize_the_cuda_device_on_steps_that_do_not_log(tmp_path):
    def sync_debug(step: int, is_log_step: bool):
        if is_log_step:
            return contextlib.nullcontext()
        return _sync_debug_mode("error")

    loop = FakeLoop(metric_observers(tmp_path), adapter=LoraAdapter(device="cuda"), run_dir=tmp_path,
                    total_steps=7, log_every=3, around_dispatch=sync_debug)
    logged = loop.run()
    assert [e.step for e in logged] == [3, 6, 7]
    assert not loop.failures, [f.error for f in loop.failures]

    # negative control: the same guard turns a per-step .item() into an observer failure
    loop = FakeLoop([ConvertsEveryStep("item")], adapter=LoraAdapter(device="cuda"), run_dir=tmp_path,
                    total_steps=2, log_every=2, around_dispatch=sync_debug)
    loop.run()
    assert loop.failures and "synchroniz" in loop.failures[0].error


@contextlib.contextmanager
def _sync_debug_mode(mode: str):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.mark.slow
def test_whole_loop_on_the_tiny_wan_model_converts_one_tensor_per_log_step_and_none_otherwise():
    """The core's promise end to end: real tiny Wan forward/backward, gradient accumulation, clipping, the
    scheduler, the non-finite guard and every metric observer, with the fused AdamW `wantrain run` builds (its step
    counter lives on the device and the guard hands it `found_inf`, so nothing is read back per step). That is the
    path of a GPU run; a CPU run reads the guard's flag instead (free there), so the test asks for the GPU path."""
    import itertools
    from pathlib import Path

    from wantrain.app.config import load_config
    from wantrain.core.bus import Bus
    from wantrain.core.events import StepStarted
    from wantrain.core.loop import LoopSettings, Trainer
    from wantrain.models.wan22 import build_adapter
    from wantrain.schedulers import build_scheduler

    cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml")
    adapter = build_adapter(cfg.model, cfg.lora, seed=0, device=torch.device("cpu"), base_lr=1e-3)
    pixels = torch.rand(1, 3, 9, 64, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    batch = {**adapter.encode_media(pixels), **adapter.encode_text(["a red circle moving left"])}
    counter = SyncCounter()
    bus = Bus()
    bus.subscribe(StepStarted, lambda e, c: setattr(counter, "step", e.step))
    for observer in (Norms(), MemoryProbe(), ProgressLine(stream=io.StringIO())):
        bus.attach(observer)
    optimizer = torch.optim.AdamW(adapter.param_groups(), lr=1e-3, fused=True)  # as wantrain run builds it
    trainer = Trainer(adapter=adapter, batches=itertools.repeat(batch), optimizer=optimizer, bus=bus,
                      scheduler=build_scheduler(cfg.lr_scheduler, optimizer, total_steps=6),
                      settings=LoopSettings(max_steps=6, grad_accum=2, log_every=3, clip_grad_norm=1.0))
    assert trainer._device_skip is False  # CPU: the flag is read
    trainer._device_skip = True  # what a CUDA device gets
    with counter:
        assert trainer.run().status == "completed"
    assert counter.calls == [(3, "tolist"), (6, "tolist")]
