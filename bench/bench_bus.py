"""Bus cost: per event and per receiver, against calling the same handlers directly and against blinker's bare send.

Not a test. The cases, each a callable run many times:

* ``emit_0`` -- ``bus.emit(event)`` of ``OptimizerStepped`` (the per-step event observers subscribe to most) with
  no receiver; ``emit_R`` with R no-op observers attached; ``direct_R`` the same R handlers called in a plain loop,
  ``for h in handlers: h(event, ctx)``; ``blinker_R`` a bare ``blinker.Signal`` with R no-op receivers and
  ``send(event, ctx=None)``: what blinker's ``send`` itself costs, without the bus's wrappers and bookkeeping.
* ``recorder`` -- an emit with the event recorder's journal and no receiver (record + JSON line).
* ``step`` -- one optimizer step of the bus's work in a default run at ``--log-every`` (grad_accum 1, the expert
  switching every ``--log-every`` steps as in bench_overhead.py): the loop's ``bus.wants`` checks and emits, sent
  to no-op receivers subscribed as the default observers (RunLog, MemoryProbe, Norms, TensorBoardWriter,
  JsonlMetrics, ProgressLine) subscribe, read from their ``@on`` marks. Per step, averaged over ``--log-every``
  steps (GradsReady and OptimizerStepped each step, ExpertSwitched and MetricsLogged once).

Two modes:

    python bench/bench_bus.py                    # CPU microseconds: median of --repeats batches (compare cases
                                                 # within one run: a loaded machine slows every case)
    python bench/bench_bus.py --instructions     # instructions per call under valgrind's callgrind (one thread,
                                                 # fixed hash seed): deterministic, what docs/benchmarks.md quotes
    python bench/bench_bus.py --receivers 1 5 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import blinker
from callgrind import Control, run_counted

from wantrain.core.bus import Bus, Observer, on
from wantrain.core.events import (
    ExpertSwitched,
    GradsReady,
    LossComputed,
    MetricsLogged,
    OptimizerStepped,
    StepStarted,
)
from wantrain.observers.event_recorder import EventRecorder

EVENT = OptimizerStepped(step=1, expert="high_noise", skipped=False, skip_reason=None, lrs=(1e-4, 1e-4),
                         group_names=("high_noise", "low_noise"), is_log_step=False)


class NoOp(Observer):
    @on(OptimizerStepped)
    def stepped(self, event, ctx) -> None:
        return None


def noop_receiver(sender, **kwargs) -> None:
    return None


def default_run_bus() -> Bus:
    """A bus with a no-op receiver for every (observer, event type) a default run subscribes, at its priority."""
    from wantrain.observers.jsonl_metrics import JsonlMetrics
    from wantrain.observers.memory_probe import MemoryProbe
    from wantrain.observers.norms import Norms
    from wantrain.observers.progress import ProgressLine
    from wantrain.observers.run_log import RunLog
    from wantrain.observers.tensorboard import TensorBoardWriter

    bus = Bus()
    for cls in (RunLog, MemoryProbe, Norms, TensorBoardWriter, JsonlMetrics, ProgressLine):
        for attr in dir(cls):
            for event_type in getattr(getattr(cls, attr, None), "_wantrain_events", ()):
                bus.subscribe(event_type, lambda e, c: None, name=cls.__name__, priority=cls.priority)
    return bus


def step_cycle(bus: Bus, log_every: int) -> Callable[[], None]:
    """``log_every`` optimizer steps of the loop's bus calls (see core/loop.py), as one callable."""
    metrics = MetricsLogged(step=log_every, values={"train/loss": 0.1, "train/lr": 1e-4}, expert="high_noise",
                            elapsed_s=1.0, total_steps=100)
    switched = ExpertSwitched(step=1, previous="low_noise", expert="high_noise")
    steps = [(GradsReady(step=s, is_log_step=s == log_every, expert="high_noise"),
              OptimizerStepped(step=s, expert="high_noise", skipped=False, skip_reason=None, lrs=(1e-4,),
                               group_names=("high_noise",), is_log_step=s == log_every))
             for s in range(1, log_every + 1)]
    wants, emit = bus.wants, bus.emit

    def cycle() -> None:
        emit(switched)
        for grads, stepped in steps:
            wants(StepStarted), wants(LossComputed)  # per micro-step: not built when nobody listens
            if wants(GradsReady):
                emit(grads)
            if wants(OptimizerStepped):
                emit(stepped)
        emit(metrics)

    return cycle


def cases(receivers: list[int], log_every: int, tmp: Path) -> dict[str, tuple[Callable[[], None], int]]:
    """name -> (callable, how many of the measured unit one call is: emits, or steps for ``step``)."""
    out: dict[str, tuple[Callable[[], None], int]] = {}
    empty = Bus()
    out["emit_0"] = (lambda: empty.emit(EVENT), 1)
    for r in receivers:
        bus = Bus()
        handlers = [bus.attach(NoOp()).stepped for _ in range(r)]
        signal = blinker.Signal()
        for _ in range(r):
            signal.connect(lambda sender, **kw: None, weak=False)

        def direct(handlers=handlers):
            for h in handlers:
                h(EVENT, None)

        out[f"emit_{r}"] = (lambda bus=bus: bus.emit(EVENT), 1)
        out[f"direct_{r}"] = (direct, 1)
        out[f"blinker_{r}"] = (lambda signal=signal: signal.send(EVENT, ctx=None), 1)
    recorded = Bus()
    EventRecorder(tmp / "events.jsonl").attach_to(recorded)
    out["recorder"] = (lambda: recorded.emit(EVENT), 1)
    out["step"] = (step_cycle(default_run_bus(), log_every), log_every)
    return out


# -- timing ---------------------------------------------------------------------------------------------------------
def per_call(fn: Callable[[], None], number: int, repeats: int) -> float:
    """Median CPU seconds per call of ``fn`` over ``repeats`` batches of ``number`` calls (process CPU time: on a
    shared machine a wall clock also counts the time other processes held the core)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(number):
            fn()
        times.append((time.process_time() - start) / number)
    return statistics.median(times)


def timed(args, tmp: Path) -> dict:
    out: dict = {}
    for name, (fn, unit) in cases(args.receivers, args.log_every, tmp).items():
        number = max(1, args.number // (unit * (4 if name == "recorder" else 1)))
        out[name] = round(per_call(fn, number, args.repeats) * 1e6 / unit, 3)
    return {"us_per_call": out, **derived(out, args.receivers)}


# -- instructions (callgrind) ---------------------------------------------------------------------------------------
def counted_child(args, tmp: Path) -> None:
    """Under callgrind (:func:`callgrind.run_counted`): for each case, N calls and 3N calls, each between zeroed
    counters and a named dump; counting is on only around them."""
    control = Control()
    for name, (fn, unit) in cases(args.receivers, args.log_every, tmp).items():
        n = max(1, args.calls // unit)
        for _ in range(n):  # warm: caches, the recorder's file
            fn()
        control("-i", "on")
        for k in (1, 3):
            control("-z")
            for _ in range(k * n):
                fn()
            control("-d", f"{name}@{k}")
        control("-i", "off")


def counted(args, argv: list[str]) -> dict:
    """Instructions per call of each case: (3N calls - N calls) / 2N, so the switching costs cancel."""
    dumps = run_counted(__file__, [*argv, "--counted-child"])
    out = {}
    for name in dict.fromkeys(trigger.split("@")[0] for trigger in sorted(dumps)):
        unit = args.log_every if name == "step" else 1
        n = max(1, args.calls // unit)
        out[name] = round((dumps[f"{name}@3"] - dumps[f"{name}@1"]) / (2 * n * unit))
    return {"instructions_per_call": out, **derived(out, args.receivers)}


def derived(per: dict[str, float], receivers: list[int]) -> dict:
    """The bus's own cost per receiver (emit minus direct calls, over R) and blinker's send's share of the emit."""
    return {"per_receiver": {r: round((per[f"emit_{r}"] - per[f"direct_{r}"]) / r, 3) for r in receivers},
            "blinker_send_share_of_emit": {r: round(per[f"blinker_{r}"] / per[f"emit_{r}"], 3) for r in receivers}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--log-every", type=int, default=10, help="the step case's log interval")
    parser.add_argument("--number", type=int, default=20000, help="timing: calls per batch")
    parser.add_argument("--repeats", type=int, default=15, help="timing: batches (the median is reported)")
    parser.add_argument("--instructions", action="store_true", help="count instructions under callgrind instead")
    parser.add_argument("--calls", type=int, default=2000, help="instructions: N (and 3N) calls per case")
    parser.add_argument("--counted-child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=open(os.devnull, "w")))  # noqa: SIM115
    with tempfile.TemporaryDirectory() as tmp:
        if args.counted_child:
            counted_child(args, Path(tmp))
            return 0
        result = counted(args, argv) if args.instructions else timed(args, Path(tmp))
    result.update(cpus=os.cpu_count(), python=sys.version.split()[0], blinker=_version("blinker"))
    print(json.dumps(result, indent=1))
    return 0


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
