"""Observer overhead: optimizer steps per second of the real loop on the tiny Wan model, with every metric
observer attached (Norms, MemoryProbe, TensorBoardWriter, JsonlMetrics, ProgressLine) versus none.

Not a test (timing belongs here, not in tests/). Runs ``wantrain.core.loop.Trainer`` on the ``tiny-t2v`` twin
(both experts, switching every 10 steps, rank-4 LoRA, AdamW) over one cached batch, so the loop measures forward,
backward and optimizer work plus whatever the observers add. Configurations run interleaved, ``--repeats`` times
each, after a warm-up run. The box this was written on is shared, so the figure reported is the best of the runs
(least interference) and steps per second are given both by wall time and by the process's CPU time (which other
processes on the machine do not inflate; it includes the TensorBoard writer's background thread).

    python bench/bench_observers.py                 # CPU, log_every 10 and 1
    python bench/bench_observers.py --device cuda --steps 200
    python bench/bench_observers.py --markdown      # also print the rows for docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from wantrain.core.bus import Bus
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter
from wantrain.observers.jsonl_metrics import JsonlMetrics
from wantrain.observers.memory_probe import MemoryProbe
from wantrain.observers.norms import Norms
from wantrain.observers.progress import ProgressLine
from wantrain.observers.tensorboard import TensorBoardWriter


def cached_batch(adapter, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.rand(1, 3, 9, 64, 64, generator=g) * 2 - 1
    return adapter.encode_batch({"pixels": pixels, "captions": ["a red ball bouncing on the grass"]})


class Timed:
    """Wraps an observer so the bus calls its handlers through a timer (per-observer cost, summed over a run)."""

    def __init__(self, observer, totals: dict[str, float]) -> None:
        self.observer, self.totals = observer, totals
        self.name, self.priority, self.critical = observer.name, observer.priority, observer.critical
        totals.setdefault(self.name, 0.0)

    def handlers(self):
        for event_type, handler in self.observer.handlers():
            def timed(event, ctx, handler=handler):
                start = time.perf_counter()
                try:
                    return handler(event, ctx)
                finally:
                    self.totals[self.name] += time.perf_counter() - start
            yield event_type, timed

    def close(self) -> None:
        self.observer.close()


def one_run(device: torch.device, steps: int, log_every: int, observers_on: bool, run_dir: Path,
            devnull, handler_s: dict[str, float] | None = None) -> tuple[float, float]:
    """Optimizer steps per second of one run by wall time and by process CPU time (fresh adapter and optimizer,
    same seed)."""
    adapter = build_adapter(ModelConfig(variant="tiny-t2v"), LoraConfig(rank=4), seed=0, device=device,
                            base_lr=1e-4)
    batch = cached_batch(adapter)
    optimizer = torch.optim.AdamW(adapter.param_groups(), weight_decay=0.0)
    bus = Bus()
    if observers_on:
        for observer in (Norms(), MemoryProbe(), TensorBoardWriter(run_dir / "tensorboard", hparams={"bench": 1}),
                         JsonlMetrics(run_dir / "metrics.jsonl"), ProgressLine(stream=devnull)):
            bus.attach(Timed(observer, handler_s) if handler_s is not None else observer)
    trainer = Trainer(adapter=adapter, batches=itertools.repeat(batch), optimizer=optimizer,
                      settings=LoopSettings(max_steps=steps, log_every=log_every), bus=bus, run_dir=run_dir)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start, start_cpu = time.perf_counter(), time.process_time()
    trainer.run()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps / (time.perf_counter() - start), steps / (time.process_time() - start_cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timed-runs", type=int, default=3, help="extra runs that time each observer's handlers")
    parser.add_argument("--log-every", type=int, nargs="+", default=[10, 1])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        one_run(device, 5, 1, True, Path(tmp) / "warmup", devnull)  # imports, allocator, first-call costs
        for log_every in args.log_every:
            runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for rep in range(args.repeats):
                for on in (False, True) if rep % 2 == 0 else (True, False):  # interleaved against drift
                    run_dir = Path(tmp) / f"le{log_every}-{rep}-{int(on)}"
                    runs[on].append(one_run(device, args.steps, log_every, on, run_dir, devnull))
            best = {on: (max(r[0] for r in runs[on]), max(r[1] for r in runs[on])) for on in runs}
            rows.append((log_every, best))
            for i, clock in enumerate(("wall", "cpu")):
                off, on = best[False][i], best[True][i]
                extra_ms = (1 / on - 1 / off) * 1e3
                print(f"log_every={log_every:>3} {clock:>4}: off {off:7.2f} steps/s, on {on:7.2f} steps/s, "
                      f"ratio on/off {on / off:.3f}, {extra_ms:+.2f} ms/step = {extra_ms * log_every:+.1f} ms per "
                      f"log step  (all runs off {[round(r[i], 1) for r in runs[False]]}, "
                      f"on {[round(r[i], 1) for r in runs[True]]})", flush=True)
        # Where the added time goes: handler time per observer, per log step (best of --timed-runs).
        timed_rows = []
        for log_every in args.log_every:
            best: dict[str, float] = {}
            for rep in range(args.timed_runs):
                totals: dict[str, float] = {}
                one_run(device, args.steps, log_every, True, Path(tmp) / f"timed{log_every}-{rep}", devnull, totals)
                log_steps = -(-args.steps // log_every)
                for name, seconds in totals.items():
                    best[name] = min(best.get(name, float("inf")), seconds / log_steps * 1e3)
            timed_rows.append((log_every, best))
            print(f"log_every={log_every:>3} handler ms per log step: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in best.items()) + f", total {sum(best.values()):.2f}")
    if args.markdown:
        print()
        print(f"Machine: {platform.machine()}, {device}, torch {torch.__version__}, {args.threads} CPU thread(s); "
              f"tiny-t2v (both experts, switch every 10 steps), rank-4 LoRA, AdamW, {args.steps} steps per run, "
              f"best of {args.repeats} interleaved runs.")
        print()
        print("| log_every | clock | observers off (steps/s) | all metric observers on (steps/s) | ratio on/off "
              "| added time per log step |")
        print("|---|---|---|---|---|---|")
        for log_every, best in rows:
            for i, clock in enumerate(("wall", "process CPU")):
                off, on = best[False][i], best[True][i]
                print(f"| {log_every} | {clock} | {off:.2f} | {on:.2f} | {on / off:.3f} | "
                      f"{(1 / on - 1 / off) * 1e3 * log_every:+.1f} ms |")
        print()
        names = list(timed_rows[0][1])
        print("| log_every | " + " | ".join(names) + " | all |")
        print("|---" * (len(names) + 2) + "|")
        for log_every, best in timed_rows:
            print(f"| {log_every} | " + " | ".join(f"{best[n]:.2f} ms" for n in names)
                  + f" | {sum(best.values()):.2f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
