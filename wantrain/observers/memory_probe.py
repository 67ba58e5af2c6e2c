"""Host RAM and device VRAM, sampled once per log step with host calls only (no device sync).

Metrics (host floats, GiB = 2**30 bytes; the ``_gb`` names are the seed's, kept for compatibility):

* ``memory/ram_main_process_gb`` -- resident set size (RSS) of the training process.
* ``memory/ram_total_gb`` -- RSS of the training process plus all its descendants (data-loader workers).
  Forked workers share copy-on-write pages with the parent, so this sum is an upper bound on real use.
* ``memory/vram_allocated_gb`` -- ``torch.cuda.memory_allocated``: memory held by live tensors.
* ``memory/vram_reserved_gb`` -- ``torch.cuda.memory_reserved``: held by the caching allocator.
* ``memory/vram_peak_gb`` -- ``torch.cuda.max_memory_allocated`` since the previous log step (or the run start);
  the peak counters are reset after each reading (the seed's peak was since process start and never reset).

Cost: on Linux the main process's RSS is read from ``/proc/self/statm`` through a descriptor opened once (the field
psutil reads, without opening the file and building its named tuple each time: about 1 us instead of 9 us);
elsewhere through psutil. The descendants are listed from each thread's ``/proc/<pid>/task/<tid>/children``, level
by level (:func:`descendant_pids`: a few files for a process without workers, about 7 us), not by psutil's scan of
every process in ``/proc`` (3 ms on a shared machine with about 100 processes, growing with their number), which
remains the fallback where the kernel has no ``children`` files. The list of child process handles is refreshed at
most every ``children_refresh_s`` seconds (default 30 s, and at the first log step); between refreshes the cached
handles are read (a child that exited is dropped). A worker started after a refresh is counted from the next
refresh on.

The VRAM series exist only when the run trains on a CUDA device; without CUDA they are absent, not zero. The
``torch.cuda`` calls read the caching allocator's host-side counters: they do not synchronise the device.
"""

from __future__ import annotations

import os
import sys
import time

import psutil
import torch

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import OptimizerStepped, RunStarted

GIB = float(1 << 30)


def _cuda_device(ctx) -> torch.device | None:
    """The CUDA device the run trains on, or None (CPU run, or no CUDA)."""
    if not torch.cuda.is_available():
        return None
    device = getattr(getattr(ctx, "adapter", None), "device", None)
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    return device if device.type == "cuda" else None


class MemoryProbe(Observer):
    """Puts RAM (and, on CUDA, VRAM) gauges into ``ctx.metrics`` at ``OptimizerStepped`` of log steps."""

    priority = Priority.SINK

    def __init__(self, *, children_refresh_s: float = 30.0) -> None:
        self._process = psutil.Process()
        self._statm: int | None = None  # descriptor of /proc/self/statm (Linux), opened at the first reading
        self.children_refresh_s = children_refresh_s
        self._child_handles: list[psutil.Process] = []
        self._children_at = -float("inf")  # monotonic time of the last scan

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self._children_at = -float("inf")
        device = _cuda_device(ctx)
        if device is not None:
            torch.cuda.reset_peak_memory_stats(device)  # the first interval's peak starts with the run

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event: OptimizerStepped, ctx) -> None:
        if not event.is_log_step:
            return
        for name, value in self.sample(_cuda_device(ctx)).items():
            ctx.metrics.put(name, value)

    def sample(self, device: torch.device | None) -> dict[str, float]:
        """One reading of every gauge (host floats, GiB); resets the CUDA peak counters of ``device``."""
        main = self._rss()
        total = main
        now = time.monotonic()
        if now - self._children_at >= self.children_refresh_s:
            self._child_handles, self._children_at = self._children(), now
        alive = []
        for child in self._child_handles:
            try:
                total += child.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # a worker that exited since it was listed
            alive.append(child)
        self._child_handles = alive
        values = {"memory/ram_main_process_gb": main / GIB, "memory/ram_total_gb": total / GIB}
        if device is not None:
            values["memory/vram_allocated_gb"] = torch.cuda.memory_allocated(device) / GIB
            values["memory/vram_reserved_gb"] = torch.cuda.memory_reserved(device) / GIB
            values["memory/vram_peak_gb"] = torch.cuda.max_memory_allocated(device) / GIB
            torch.cuda.reset_peak_memory_stats(device)
        return values

    def _rss(self) -> int:
        """Resident set size of this process in bytes."""
        if self._statm is None and sys.platform == "linux":
            try:
                self._statm, self._page = os.open("/proc/self/statm", os.O_RDONLY), os.sysconf("SC_PAGE_SIZE")
            except OSError:
                self._statm = -1
        if self._statm is not None and self._statm >= 0:
            return int(os.pread(self._statm, 256, 0).split()[1]) * self._page  # statm: size resident shared ...
        return self._process.memory_info().rss

    def close(self) -> None:
        if self._statm is not None and self._statm >= 0:
            os.close(self._statm)
        self._statm = None

    def _children(self) -> list[psutil.Process]:
        pids = descendant_pids(self._process.pid)
        try:
            if pids is None:  # no /proc/<pid>/task/<tid>/children here: psutil scans every process
                return self._process.children(recursive=True)
            started = self._process.create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return []
        handles = []
        for pid in pids:
            try:
                child = psutil.Process(pid)
                if child.create_time() >= started:  # as psutil: an older process holds a reused pid
                    handles.append(child)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue  # exited since it was listed
        return handles


def descendant_pids(pid: int) -> list[int] | None:
    """The pids of every descendant of process ``pid`` (children first, then theirs), read from the kernel's
    ``/proc/<pid>/task/<tid>/children`` (one file per thread: the children that thread started); None when this
    kernel has none (not Linux, or built without ``CONFIG_PROC_CHILDREN``): the caller falls back to psutil."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return None
    found: list[int] = []
    seen = {pid}
    level = [pid]
    while level:
        below = []
        for parent in level:
            try:
                threads = os.listdir(f"/proc/{parent}/task")
            except OSError:
                continue  # exited meanwhile
            for tid in threads:
                try:
                    with open(f"/proc/{parent}/task/{tid}/children", "rb") as fh:
                        listed = fh.read().split()
                except OSError:
                    continue
                for child in map(int, listed):
                    if child not in seen:  # a reused pid cannot loop the walk
                        seen.add(child)
                        found.append(child)
                        below.append(child)
        level = below
    return found
