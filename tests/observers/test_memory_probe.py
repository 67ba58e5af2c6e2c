"""MemoryProbe: RAM of the process and its workers, VRAM only on CUDA, peak reset at every log step."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
import torch

from wantrain.core.bus import Bus
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import OptimizerStepped, RunStarted
from wantrain.observers.memory_probe import GIB, MemoryProbe

from .fakes import FakeLoop, LoraAdapter

RAM_KEYS = {"memory/ram_main_process_gb", "memory/ram_total_gb"}
VRAM_KEYS = {"memory/vram_allocated_gb", "memory/vram_reserved_gb", "memory/vram_peak_gb"}


def make_bus(adapter) -> tuple[Bus, Context]:
    ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(), adapter=adapter)
    bus = Bus(ctx)
    bus.attach(MemoryProbe())
    return bus, ctx


def stepped(step: int, is_log_step: bool = True) -> OptimizerStepped:
    return OptimizerStepped(step=step, expert=None, skipped=False, skip_reason=None, lrs=(0.1,),
                            group_names=("lora",), is_log_step=is_log_step)


def started() -> RunStarted:
    return RunStarted(step=0, run_dir="", total_steps=10, grad_accum=1, experts=(None,), log_every=2)


def test_memory_probe_emits_no_vram_keys_without_cuda():
    bus, ctx = make_bus(LoraAdapter(experts=(None,), device="cpu"))
    bus.emit(started())
    bus.emit(stepped(2))
    values = ctx.metrics.gather()
    assert set(values) == RAM_KEYS


def test_ram_of_the_main_process_is_its_resident_set_size():
    bus, ctx = make_bus(LoraAdapter(experts=(None,)))
    bus.emit(stepped(2))
    rss = psutil.Process().memory_info().rss / GIB
    assert ctx.metrics.gather()["memory/ram_main_process_gb"] == pytest.approx(rss, rel=0.05)


def test_ram_total_includes_data_loader_worker_processes():
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys,time; b = bytearray(96 << 20); b[::4096] = b'x' * len(b[::4096]); "
                               "print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert worker.stdout.readline().strip() == "ready"
        bus, ctx = make_bus(LoraAdapter(experts=(None,)))
        bus.emit(stepped(2))
        values = ctx.metrics.gather()
        child_rss = psutil.Process(worker.pid).memory_info().rss / GIB
        # children an earlier test of this process left running (inductor's compile workers, say) count as well
        others = sum(p.memory_info().rss for p in psutil.Process().children(recursive=True) if p.pid != worker.pid)
    finally:
        worker.kill()
        worker.wait()
    assert child_rss > 90 / 1024
    assert values["memory/ram_total_gb"] - values["memory/ram_main_process_gb"] == \
        pytest.approx(child_rss + others / GIB, rel=0.2)


def test_memory_is_sampled_only_on_log_steps():
    loop = FakeLoop([MemoryProbe()], total_steps=5, log_every=2)
    logged = loop.run()
    assert [e.step for e in logged] == [2, 4, 5]
    assert all(set(e.values) >= RAM_KEYS for e in logged)
    bus, ctx = make_bus(LoraAdapter())
    bus.emit(stepped(1, is_log_step=False))
    assert ctx.metrics.pending() == ()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vram_peak_is_the_peak_since_the_previous_log_step():
    bus, ctx = make_bus(LoraAdapter(experts=(None,), device="cuda"))
    bus.emit(started())
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # 0.25 GiB, freed before the log step
    del big
    bus.emit(stepped(2))
    first = ctx.metrics.gather()
    small = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
    bus.emit(stepped(4))
    second = ctx.metrics.gather()
    del small
    assert set(first) >= VRAM_KEYS
    assert first["memory/vram_peak_gb"] >= 0.25
    assert first["memory/vram_allocated_gb"] < 0.25  # the big block is gone; only the peak remembers it
    assert second["memory/vram_peak_gb"] < 0.25  # reset after the first log: the big block is not in it
    assert second["memory/vram_peak_gb"] >= 16 / 1024


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_memory_probe_on_a_cpu_run_has_no_vram_keys_even_with_cuda_present():
    bus, ctx = make_bus(LoraAdapter(experts=(None,), device="cpu"))
    bus.emit(stepped(2))
    assert set(ctx.metrics.gather()) == RAM_KEYS


def spawn_worker(mib: int) -> subprocess.Popen:
    worker = subprocess.Popen(
        [sys.executable, "-c", f"import sys,time; b = bytearray({mib} << 20); b[::4096] = b'x' * len(b[::4096]); "
                               "print('ready', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    )
    assert worker.stdout.readline().strip() == "ready"
    return worker


@pytest.mark.parametrize("refresh_s", [0.0, 3600.0])
def test_children_are_listed_again_only_after_children_refresh_s(refresh_s):
    ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(),
                  adapter=LoraAdapter(experts=(None,)))
    bus = Bus(ctx)
    bus.attach(MemoryProbe(children_refresh_s=refresh_s))
    bus.emit(started())
    bus.emit(stepped(2))
    before = ctx.metrics.gather()
    worker = spawn_worker(64)  # started after the first listing
    try:
        bus.emit(stepped(4))
        after = ctx.metrics.gather()
    finally:
        worker.kill()
        worker.wait()
    added = (after["memory/ram_total_gb"] - after["memory/ram_main_process_gb"]) - (
        before["memory/ram_total_gb"] - before["memory/ram_main_process_gb"])
    if refresh_s == 0:
        assert added > 50 / 1024  # listed again at the second log step: the new worker is counted
    else:
        assert abs(added) < 10 / 1024  # the cached list (no worker yet) is read until the next refresh


def test_descendants_are_listed_without_scanning_every_process(monkeypatch):
    """A worker's own child counts too, and the listing reads the process tree from the kernel's per-thread
    ``children`` files: psutil's scan of every process in /proc (3 ms on a busy machine) is not used."""
    def no_scan():
        raise AssertionError("every process in /proc was scanned")

    grandparent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', "
                               "\"import time; b = bytearray(80 << 20); b[::4096] = b'x' * len(b[::4096]); "
                               "print('ready', flush=True); time.sleep(30)\"], stdout=sys.stdout); c.wait()"],
        stdout=subprocess.PIPE, text=True,
    )
    grandchildren = []
    try:
        assert grandparent.stdout.readline().strip() == "ready"
        grandchildren = psutil.Process(grandparent.pid).children()
        monkeypatch.setattr(psutil, "_ppid_map", no_scan)  # what Process.children(recursive=True) scans with
        bus, ctx = make_bus(LoraAdapter(experts=(None,)))
        bus.emit(stepped(2))
        values = ctx.metrics.gather()
    finally:
        for child in grandchildren:
            child.kill()
        grandparent.kill()
        grandparent.wait()
    assert values["memory/ram_total_gb"] - values["memory/ram_main_process_gb"] > 80 / 1024
