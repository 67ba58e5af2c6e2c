"""Event recording cost per optimizer step on the tiny model (CPU, or CUDA when present):

    python bench/bench_recorder.py [--steps 60] [--log-every 10] [--variant tiny-t2v] [--rank 8]

Trains the tiny Wan model (one expert, fused AdamW) and emits the loop's events through a bus three times over
the same steps' events: without a journal, with the event recorder writing plain JSONL, and writing gzip. Times,
per optimizer step, the model work and the bus dispatch of the step's events (StepStarted, LossComputed,
GradsReady, OptimizerStepped, and MetricsLogged on log steps) with and without the recorder, and reports the bytes
per step written. The recorder's flush at each optimizer step is included (the OS page cache absorbs it; no
fsync). Figures go into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from wantrain.core.bus import Bus
from wantrain.core.events import GradsReady, LossComputed, MetricsLogged, OptimizerStepped, RunEnded, StepStarted
from wantrain.core.events.log import event_log_path
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter
from wantrain.observers.event_recorder import EventRecorder


def _step_events(step: int, expert: str, log: bool, total: int, loss: float) -> list:
    common = dict(step=step, micro_step=step, accumulation_index=1, ends_optimizer_step=True, is_log_step=log,
                  expert=expert)
    events = [StepStarted(**common), LossComputed(**common), GradsReady(step=step, is_log_step=log, expert=expert),
              OptimizerStepped(step=step, expert=expert, skipped=False, skip_reason=None, lrs=(1e-3, 1e-3),
                               group_names=("high_noise", "low_noise"), is_log_step=log)]
    if log:  # a realistic log step: the metrics `wantrain run` logs on the tiny model
        values = {"train/loss": loss, f"train/loss/{expert}": loss, "train/lr": 1e-3, "train/grad_norm": 0.5,
                  "train/param_norm": 3.2, "train/skipped_steps": 0.0, "memory/ram_gb": 1.9, "perf/step_s": 0.3}
        events.append(MetricsLogged(step=step, expert=expert, values=values, elapsed_s=0.3 * step, total_steps=total))
    return events


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--variant", default="tiny-t2v")
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    adapter = build_adapter(ModelConfig(variant=args.variant, experts="high_noise", gradient_checkpointing=False),
                            LoraConfig(rank=args.rank), seed=0, device=device, base_lr=1e-3)
    optimizer = torch.optim.AdamW(adapter.param_groups(), fused=True)
    g = torch.Generator().manual_seed(0)
    batch = adapter.encode_batch({"pixels": torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1,
                                  "captions": ["a red ball"]})
    generator = torch.Generator(device=device).manual_seed(0)
    expert = adapter.experts[0]
    model_s, steps = 0.0, []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = adapter.loss(batch, expert, generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())  # syncs: the bench's own measurement, not part of any figure below
        t1 = time.perf_counter()
        if step > 10:
            model_s += t1 - t0
        steps.append(_step_events(step, expert, step % args.log_every == 0, args.steps, value))
    measured = args.steps - 10

    def dispatch(compression: str | None) -> tuple[float, int]:
        with tempfile.TemporaryDirectory() as tmp:
            bus = Bus()
            bus.subscribe(MetricsLogged, lambda e, c: None)  # one sink, as a run always has
            path = None
            if compression is not None:
                path = event_log_path(Path(tmp), compression)
                EventRecorder(path).attach_to(bus)
            spent = 0.0
            for i, events in enumerate(steps):
                t0 = time.perf_counter()
                for event in events:
                    bus.emit(event)
                if i >= 10:
                    spent += time.perf_counter() - t0
            bus.emit(RunEnded(step=args.steps, status="completed", reason=None))
            bus.close()
            size = path.stat().st_size if path is not None else 0
        return spent / measured, size

    base_s, _ = dispatch(None)
    print(f"device {device.type}, {args.variant} rank {args.rank}, log every {args.log_every}, {args.steps} steps")
    print(f"model step (forward+backward+AdamW):   {1e3 * model_s / measured:9.3f} ms/step")
    print(f"bus dispatch, no recorder:             {1e6 * base_s:9.1f} us/step")
    for compression in ("none", "gzip"):
        spent, size = dispatch(compression)
        extra = spent - base_s
        print(f"recorder ({compression:>4}): {1e6 * extra:9.1f} us/step more "
              f"({100 * extra / (model_s / measured):.3f} % of the model step), {size / args.steps:7.1f} bytes/step")


if __name__ == "__main__":
    main()
