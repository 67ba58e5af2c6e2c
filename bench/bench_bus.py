"""Bus cost: microseconds per event per receiver, against calling the same handlers directly.

Not a test. Emits ``OptimizerStepped`` (the per-step event observers subscribe to most) to R no-op handlers and
times ``bus.emit(event)`` against a plain loop ``for h in handlers: h(event, ctx)``. The figure is
(emit time - direct time) / R, the bus's own cost per receiver; the cost of an emit with no receiver and of one
with the event recorder's journal (record + JSON line) are reported too. Medians of ``--repeats`` timings.

    python bench/bench_bus.py                    # JSON on stdout
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
from pathlib import Path

from wantrain.core.bus import Bus, Observer, on
from wantrain.core.events import OptimizerStepped
from wantrain.observers.event_recorder import EventRecorder


def noop(event, ctx) -> None:
    return None


class NoOp(Observer):
    @on(OptimizerStepped)
    def stepped(self, event, ctx) -> None:
        return None


def per_call(fn, number: int, repeats: int) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` batches of ``number`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - start) / number)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 5, 10])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args(argv)
    event = OptimizerStepped(step=1, expert="high_noise", skipped=False, skip_reason=None, lrs=(1e-4, 1e-4),
                             group_names=("high_noise", "low_noise"), is_log_step=False)
    out: dict = {"us_per_emit_no_receiver": None, "receivers": {}}
    empty = Bus()
    out["us_per_emit_no_receiver"] = round(per_call(lambda: empty.emit(event), args.number, args.repeats) * 1e6, 3)
    for r in args.receivers:
        bus = Bus()
        observers = [bus.attach(NoOp()) for _ in range(r)]
        handlers = [o.stepped for o in observers]

        def direct(handlers=handlers):
            for h in handlers:
                h(event, None)

        emit_s = per_call(lambda bus=bus: bus.emit(event), args.number, args.repeats)
        direct_s = per_call(direct, args.number, args.repeats)
        out["receivers"][r] = {"us_per_emit": round(emit_s * 1e6, 3), "us_direct_calls": round(direct_s * 1e6, 3),
                               "us_per_receiver_per_event": round((emit_s - direct_s) / r * 1e6, 3)}
    with tempfile.TemporaryDirectory() as tmp:
        bus = Bus()
        recorder = EventRecorder(Path(tmp) / "events.jsonl")
        recorder.attach_to(bus)
        out["us_per_emit_event_recorder"] = round(
            per_call(lambda: bus.emit(event), args.number // 4, args.repeats) * 1e6, 3)
        bus.close()
    out["cpus"] = os.cpu_count()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
