"""Alpha controller cost per optimizer step on the tiny model (CPU, or CUDA when present):

    python bench/bench_alpha.py [--steps 200] [--log-every 10] [--variant tiny-t2v] [--rank 8] [--window N]

Trains the tiny Wan model with AdamW (fused on CPU/CUDA, as `wantrain run`) and times, per optimizer step, the
model work (forward, backward, optimizer step) and the controller's handlers (LossComputed, GradsReady: window push
and gradient sign agreement; OptimizerStepped on log steps: window statistics; MetricsLogged: the decision). The
controller's device work is timed with a device sync around each handler here, which the real loop never does, so
the figure is an upper bound. Prints one table; figures go into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from wantrain.app.config import LoraSection
from wantrain.core.bus import Bus
from wantrain.core.config import check_value
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import GradsReady, LossComputed, MetricsLogged, OptimizerStepped, RunStarted, StepStarted
from wantrain.models.wan22 import ModelConfig, build_adapter
from wantrain.observers.alpha.config import AlphaScheduleConfig
from wantrain.observers.alpha.controller import AlphaController


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--variant", default="tiny-t2v")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--window", type=int, default=None, help="lora.alpha_schedule.window (default: the preset's)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    phases = check_value(AlphaScheduleConfig, "phases", [{"name": "a", "alpha": 4.0, "min_steps": 10**9},
                                                         {"name": "b", "alpha": 8.0}], "phases")
    schedule = AlphaScheduleConfig(enabled=True, phases=phases, window=args.window,
                                   min_samples=None if args.window is None else args.window // 2)
    adapter = build_adapter(ModelConfig(variant=args.variant, experts="high_noise", gradient_checkpointing=False),
                            LoraSection(rank=args.rank, alpha_schedule=schedule), seed=0, device=device, base_lr=1e-3)
    optimizer = torch.optim.AdamW(adapter.param_groups(), fused=True)
    g = torch.Generator().manual_seed(0)
    raw = {"pixels": torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1, "captions": ["a red ball"]}
    batch = adapter.encode_batch(raw)
    ctx = Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(), adapter=adapter,
                  optimizer=optimizer)
    bus = Bus(ctx)
    bus.attach(AlphaController(schedule, adapter.experts))
    generator = torch.Generator(device=device).manual_seed(0)
    expert = adapter.experts[0]
    bus.emit(RunStarted(step=0, run_dir="", total_steps=args.steps, grad_accum=1, experts=adapter.experts,
                        log_every=args.log_every))
    model_s = controller_s = every_s = log_s = 0.0
    logs = 0
    tensors = len(adapter.trainable_parameters(expert))
    elements = sum(p.numel() for p in adapter.trainable_parameters(expert))
    for step in range(1, args.steps + 1):
        log = step % args.log_every == 0
        common = dict(step=step, micro_step=step, accumulation_index=1, ends_optimizer_step=True, is_log_step=log,
                      expert=expert)
        _sync(device)
        t0 = time.perf_counter()
        loss = adapter.loss(batch, expert, generator)
        _sync(device)
        t1 = time.perf_counter()
        bus.emit(StepStarted(**common))
        ctx.live.loss = loss.detach()
        bus.emit(LossComputed(**common))
        ctx.live.clear()
        _sync(device)
        t2 = time.perf_counter()
        loss.backward()
        _sync(device)
        t3 = time.perf_counter()
        bus.emit(GradsReady(step=step, is_log_step=log, expert=expert))
        _sync(device)
        t4 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        t5 = time.perf_counter()
        bus.emit(OptimizerStepped(step=step, expert=expert, skipped=False, skip_reason=None, lrs=(1e-3,),
                                  group_names=("high_noise",), is_log_step=log))
        values = ctx.metrics.gather() if log else {}
        t6 = time.perf_counter()
        if log:
            bus.emit(MetricsLogged(step=step, expert=expert, values=values, elapsed_s=0.0, total_steps=args.steps))
        t7 = time.perf_counter()
        if step > 10:  # warm-up excluded
            model_s += (t1 - t0) + (t3 - t2) + (t5 - t4)
            controller_s += (t2 - t1) + (t4 - t3) + (t6 - t5) + (t7 - t6)
            every_s += (t2 - t1) + (t4 - t3)
            log_s += (t6 - t5) + (t7 - t6)
            logs += log
    n = args.steps - 10
    print(f"device {device.type}, {args.variant} rank {args.rank}: {tensors} LoRA tensors, {elements} elements, "
          f"log every {args.log_every}")
    print(f"model step (forward+backward+AdamW): {1e3 * model_s / n:8.3f} ms/step")
    print(f"alpha controller (all handlers):    {1e3 * controller_s / n:8.3f} ms/step "
          f"({100 * controller_s / model_s:.2f} % of the model step)")
    print(f"  every step (loss push, sign agreement): {1e3 * every_s / n:8.3f} ms/step")
    print(f"  per log step (window statistics of a {schedule.resolved('window')}-step window, the gather, the "
          f"decision): {1e3 * log_s / max(logs, 1):8.3f} ms per log step")


if __name__ == "__main__":
    main()
