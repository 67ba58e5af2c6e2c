"""Headline overhead figure: the wantrain Trainer (with no observers, and with every observer a default run
attaches) against a bare PyTorch loop and a pytorch-ignite Engine doing the same work.

Not a test (timing belongs here). Every variant trains its own copy of the ``tiny-t2v`` twin (both experts,
switching every 10 steps, rank-4 LoRA, fused AdamW as ``wantrain run`` builds it, gradient clipping at 1.0 as the
default ``[train]`` has it, one cached 9x64x64 batch) and reads the loss on the host once per ``log_every`` steps.

* ``bare`` -- the ~25-line loop a user would write (:func:`bare_steps`): expert switch, forward, backward,
  ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad``, a running loss sum read with ``.item()`` every
  ``log_every`` steps. It has no non-finite guard, no events, no metrics beyond the loss.
* ``bare_guard`` -- the bare loop plus the core's device-side work (:func:`bare_guard_steps`): the non-finite
  guard's fused check per step and the losses kept for the log step; what the core costs beyond it is the
  framework itself (events, control object, bookkeeping).
* ``trainer_none`` -- ``wantrain.core.loop.Trainer`` on a bus with no observers (the core alone: per-step events
  not built, the non-finite guard's one check per step, one gather per log step).
* ``trainer_all`` -- what a default ``wantrain run`` attaches: everything ``wantrain.app.observers.build_observers``
  builds for a default config (RunLog, MemoryProbe, Norms, TensorBoardWriter, JsonlMetrics, ProgressLine) plus
  the EventRecorder journal (``observers.record_events``, on by default); ``trainer_default`` the same without
  the recorder (its share is the difference).
* ``ignite_all`` -- an ignite ``Engine`` whose process function is the bare step, with handlers doing the same
  work as ``trainer_all`` every ``log_every`` iterations (loss, grad and param norms, RSS, TensorBoard scalars,
  a JSONL line, a progress line); ``ignite_min`` only reads the loss.

Rounds are short (``--steps`` optimizer steps per variant) and interleaved in one process (the order rotates every
round), so drift on a shared machine hits every variant alike; the figures are medians over ``--rounds`` rounds of
the per-round ratio to ``bare`` (process CPU time; wall time also reported), with the interquartile range.

    python bench/bench_overhead.py                       # CPU, log_every 10 and 1, JSON on stdout
    python bench/bench_overhead.py --rounds 21 --steps 40 --log-every 10
    python bench/bench_overhead.py --callgrind-steps 10 --variants bare trainer_none trainer_all
                                                         # instructions per step under valgrind (minutes)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from callgrind import Control, run_counted

from wantrain.app.config import RunConfig
from wantrain.app.observers import build_observers
from wantrain.core.bus import Bus
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter
from wantrain.observers.event_recorder import EventRecorder

CLIP = 1.0
VARIANTS = ("bare", "bare_guard", "trainer_none", "trainer_default", "trainer_all", "ignite_min", "ignite_all")
# under callgrind: work that happens every N seconds (MemoryProbe's /proc scan every 30 s, TensorBoard's flush every
# 10 s) runs once per run instead, as valgrind's ~50x slower clock would otherwise run it ~50x too often per step
COUNTING = False
# one observer of the default set alone (where the cost goes): only_RunLog, only_Norms, ..., only_EventRecorder
SINGLE = ("RunLog", "MemoryProbe", "Norms", "TensorBoardWriter", "JsonlMetrics", "ProgressLine", "EventRecorder")


class Setup:
    """One variant's model, optimizer and batch, built once and trained on for every round."""

    def __init__(self, checkpointing: bool, seed: int = 0) -> None:
        self.adapter = build_adapter(ModelConfig(variant="tiny-t2v", gradient_checkpointing=checkpointing),
                                     LoraConfig(rank=4), seed=seed, device=torch.device("cpu"), base_lr=1e-4)
        g = torch.Generator().manual_seed(seed)
        pixels = torch.rand(1, 3, 9, 64, 64, generator=g) * 2 - 1
        self.batch = self.adapter.encode_batch({"pixels": pixels, "captions": ["a red ball bouncing on the grass"]})
        self.adapter.release_encoders()
        self.optimizer = torch.optim.AdamW(self.adapter.param_groups(), weight_decay=0.0, fused=True)
        self.generator = torch.Generator().manual_seed(seed)
        self.step = 0  # steps done so far (rounds continue the schedule, so experts keep switching)


# -- the bare loop: what a user writes by hand ----------------------------------------------------------------------
def bare_steps(s: Setup, steps: int, log_every: int) -> list[float]:
    adapter, optimizer, losses, running = s.adapter, s.optimizer, [], None
    for step in range(s.step + 1, s.step + steps + 1):
        expert = adapter.expert_for_step(step)
        adapter.activate(expert, optimizer)
        loss = adapter.loss(s.batch, expert, s.generator)
        loss.backward()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.detach() if running is None else running + loss.detach()
        if step % log_every == 0:
            losses.append(running.item() / log_every)  # the one host sync of the interval
            running = None
    s.step += steps
    return losses


def bare_guard_steps(s: Setup, steps: int, log_every: int) -> list[float]:
    """The bare loop plus the core's device-side work (``core.interval``): each step's loss is kept (a reference)
    and one fused check of the loss and the gradient norm writes the step's non-finite flag, which decides the
    step (read on the CPU, ``found_inf`` on a GPU); at the log step the losses and flags travel in one transfer and
    the means and counts are taken on the host. No events, no observers."""
    adapter, optimizer, losses = s.adapter, s.optimizer, []
    one = torch.ones(())
    kept: list[torch.Tensor] = []
    flags = torch.zeros(log_every)
    views = flags.unbind(0)
    for step in range(s.step + 1, s.step + steps + 1):
        expert = adapter.expert_for_step(step)
        adapter.activate(expert, optimizer)
        loss = adapter.loss(s.batch, expert, s.generator)
        kept.append(loss.detach())
        loss.backward()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        flag = views[len(kept) - 1]
        torch._amp_foreach_non_finite_check_and_unscale_([kept[-1], norm], flag, one)
        if not flag.item():
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % log_every == 0:
            host = torch.cat([torch.stack(kept), flags[:len(kept)]]).tolist()  # one host sync
            finite = [v for v in host[:len(kept)] if v == v and abs(v) != float("inf")]
            losses.append(sum(finite) / max(len(finite), 1))
            kept.clear()
            flags = torch.zeros(log_every)
            views = flags.unbind(0)
    s.step += steps
    return losses


# -- the wantrain Trainer ---------------------------------------------------------------------------------------------
def trainer_steps(s: Setup, steps: int, log_every: int, run_dir: Path | None, devnull, *,
                  record_events: bool = True, only: str | None = None) -> None:
    bus = Bus()
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = RunConfig()
        for observer in build_observers(cfg, run_dir, hparams={"bench": {"log_every": log_every}}):
            if only is None or observer.name == only:
                if COUNTING:  # timed work once per run (its start and end), not at valgrind's slowed-down clock
                    for attr in ("children_refresh_s", "flush_secs"):
                        if hasattr(observer, attr):
                            setattr(observer, attr, float("inf"))
                bus.attach(observer)
        if record_events and only in (None, "EventRecorder"):
            EventRecorder(run_dir / "events.jsonl").attach_to(bus)
    # Trainer counts steps from its state: start where the previous round ended so experts switch as in one run
    from wantrain.core.state import TrainState

    trainer = Trainer(adapter=s.adapter, batches=itertools.repeat(s.batch), optimizer=s.optimizer,
                      settings=LoopSettings(max_steps=s.step + steps, log_every=log_every, clip_grad_norm=CLIP),
                      bus=bus, run_dir=run_dir, state=TrainState(step=s.step))
    with contextlib.redirect_stderr(devnull):
        result = trainer.run()
    assert result.status == "completed", result
    s.step += steps


# -- pytorch-ignite ---------------------------------------------------------------------------------------------------
def ignite_steps(s: Setup, steps: int, log_every: int, run_dir: Path | None, devnull) -> None:
    from ignite.engine import Engine, Events

    adapter, optimizer = s.adapter, s.optimizer
    first = s.step

    def process(engine, batch):
        step = first + engine.state.iteration
        expert = adapter.expert_for_step(step)
        adapter.activate(expert, optimizer)
        loss = adapter.loss(batch, expert, s.generator)
        loss.backward()
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach(), grad_norm

    engine = Engine(process)
    sums = {"loss": None}

    @engine.on(Events.ITERATION_COMPLETED)
    def accumulate(engine):
        loss = engine.state.output[0]
        sums["loss"] = loss if sums["loss"] is None else sums["loss"] + loss

    if run_dir is None:
        @engine.on(Events.ITERATION_COMPLETED(every=log_every))
        def read_loss(engine):
            sums["loss"].item()
            sums["loss"] = None
    else:
        import psutil
        from tensorboardX import SummaryWriter

        from wantrain.observers.norms import sum_of_squares

        run_dir.mkdir(parents=True, exist_ok=True)
        writer = SummaryWriter(str(run_dir / "tensorboard"), flush_secs=10**6 if COUNTING else 10)
        jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        process_handle = psutil.Process()
        params = {g["name"]: list(g["params"]) for g in optimizer.param_groups}  # listed once, like Norms

        @engine.on(Events.ITERATION_COMPLETED(every=log_every))
        def log_metrics(engine):
            step = first + engine.state.iteration
            expert = adapter.expert_for_step(step)
            grad_norm = engine.state.output[1]
            param_sq = {e: sum_of_squares(params[e]) for e in adapter.experts}
            parts = [sums["loss"] / log_every, grad_norm, *(sq.sqrt() for sq in param_sq.values()),
                     sum(param_sq.values()).sqrt()]
            host = torch.stack(parts).tolist()
            sums["loss"] = None
            values = {"train/loss": host[0], "train/grad_norm": host[1], "train/total_param_norm": host[-1],
                      "train/lr": optimizer.param_groups[0]["lr"],
                      "memory/ram_main_process_gb": process_handle.memory_info().rss / 2**30}
            for e, v in zip(adapter.experts, host[2:-1], strict=True):
                values[f"train/param_norm/{e}"] = v
            for name, value in values.items():
                writer.add_scalar(name, value, step)
            jsonl.write(json.dumps({"step": step, "time": time.time(), "expert": expert, **values}) + "\n")
            jsonl.flush()
            print(f"step {step} | loss {values['train/loss']:.4g}", file=devnull, flush=True)

        @engine.on(Events.COMPLETED)
        def close(engine):
            writer.close()
            jsonl.close()

    engine.run(itertools.repeat(s.batch), max_epochs=1, epoch_length=steps)
    s.step += steps


# -- timing -----------------------------------------------------------------------------------------------------------
def run_variant(name: str, s: Setup, steps: int, log_every: int, run_dir: Path, devnull) -> None:
    if name == "bare":
        bare_steps(s, steps, log_every)
    elif name == "bare_guard":
        bare_guard_steps(s, steps, log_every)
    elif name == "trainer_none":
        trainer_steps(s, steps, log_every, None, devnull)
    elif name == "trainer_default":
        trainer_steps(s, steps, log_every, run_dir, devnull, record_events=False)
    elif name == "trainer_all":
        trainer_steps(s, steps, log_every, run_dir, devnull)
    elif name.startswith("only_"):
        trainer_steps(s, steps, log_every, run_dir, devnull, only=name.removeprefix("only_"))
    elif name == "ignite_min":
        ignite_steps(s, steps, log_every, None, devnull)
    else:
        ignite_steps(s, steps, log_every, run_dir, devnull)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def measure(args, log_every: int, tmp: Path, devnull) -> dict:
    setups = {name: Setup(args.checkpointing) for name in args.variants}
    for name in args.variants:  # warm-up: first-call costs, allocator, imports
        run_variant(name, setups[name], log_every, log_every, tmp / f"warm-{name}-{log_every}", devnull)
    cpu: dict[str, list[float]] = {n: [] for n in args.variants}
    wall: dict[str, list[float]] = {n: [] for n in args.variants}
    for r in range(args.rounds):
        order = args.variants[r % len(args.variants):] + args.variants[:r % len(args.variants)]
        for name in order:
            run_dir = tmp / f"le{log_every}-r{r}-{name}"
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            run_variant(name, setups[name], args.steps, log_every, run_dir, devnull)
            cpu[name].append((time.process_time() - start_cpu) / args.steps)
            wall[name].append((time.perf_counter() - start_wall) / args.steps)
    out: dict = {"log_every": log_every, "ms_per_step": {}, "ratio_to_bare": {}}
    for clock, table in (("cpu", cpu), ("wall", wall)):
        out["ms_per_step"][clock] = {n: round(statistics.median(v) * 1e3, 3) for n, v in table.items()}
        if "bare" in table:
            # speed ratio of a round (bare time / variant time: 1.0 = as fast as bare), median and quartiles
            out["ratio_to_bare"][clock] = {
                n: dict(zip(("q1", "median", "q3"), (round(x, 4) for x in quartiles(
                    [b / v for b, v in zip(table["bare"], table[n], strict=True)]))))
                for n in table if n != "bare"}
        if "trainer_none" in table and "trainer_all" in table:
            out.setdefault("ratio_all_to_none", {})[clock] = dict(zip(("q1", "median", "q3"), (
                round(x, 4) for x in quartiles([a / b for a, b in zip(table["trainer_none"], table["trainer_all"],
                                                                      strict=True)]))))
    return out


# -- callgrind: instructions per optimizer step -----------------------------------------------------------------------
def callgrind_child(args, tmp: Path, devnull) -> None:
    """Runs under ``valgrind --tool=callgrind --instr-atstart=no`` (see :func:`callgrind_parent`). Instrumentation
    is switched on after the models are built and warmed up (``callgrind_control -i on``); for each variant and
    log_every the counters are zeroed, N steps run, a dump is taken, then the same for 3N steps. The difference of
    the two dumps over 2N is the per-step count without the start/end costs of a run."""
    global COUNTING
    COUNTING = True
    n = args.callgrind_steps
    control = Control()

    setups = {name: Setup(args.checkpointing) for name in args.variants}
    for name in args.variants:
        run_variant(name, setups[name], args.log_every[0], args.log_every[0], tmp / f"warm-{name}", devnull)
    control("-i", "on")
    for log_every in args.log_every:
        for name in args.variants:
            for k in (1, 3):
                control("-z")
                run_variant(name, setups[name], k * n, log_every, tmp / f"cg-{name}-{log_every}-{k}", devnull)
                control("-d", f"{name}@{log_every}@{k}")


def callgrind_parent(args, argv: list[str]) -> dict:
    """Re-runs this script under callgrind and reads the dumps back."""
    dumps = run_counted(__file__, [*argv, "--callgrind-child"], keep=args.callgrind_keep)
    counts: dict[tuple[str, int, int], int] = {}
    for trigger, total in dumps.items():
        name, log_every, k = trigger.split("@")
        counts[(name, int(log_every), int(k))] = total
    n = args.callgrind_steps
    out: dict = {"steps": [n, 3 * n], "instructions_per_step": {}, "ratios": {}}
    for log_every in args.log_every:
        per_step = {name: (counts[(name, log_every, 3)] - counts[(name, log_every, 1)]) / (2 * n)
                    for name in args.variants}
        out["instructions_per_step"][log_every] = {k: round(v) for k, v in per_step.items()}
        ratios = {}
        if "trainer_none" in per_step and "trainer_all" in per_step:
            ratios["trainer_none / trainer_all"] = round(per_step["trainer_none"] / per_step["trainer_all"], 4)
        if "bare" in per_step:
            for name in per_step:
                if name != "bare":
                    ratios[f"bare / {name}"] = round(per_step["bare"] / per_step[name], 4)
        out["ratios"][log_every] = ratios
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per variant per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--log-every", type=int, nargs="+", default=[10, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS),
                        choices=[*VARIANTS, *(f"only_{name}" for name in SINGLE)])
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing (default: off)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier on a shared box)")
    parser.add_argument("--callgrind-steps", type=int, default=0,
                        help="count instructions per step under callgrind instead of timing: N and 3N steps")
    parser.add_argument("--callgrind-keep", metavar="DIR", help="copy the callgrind dumps into DIR")
    parser.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.callgrind_steps and not args.callgrind_child:
        print(json.dumps({"torch": torch.__version__, "threads": args.threads, "log_every": args.log_every,
                          "gradient_checkpointing": args.checkpointing,
                          "callgrind": callgrind_parent(args, argv)}, indent=1))
        return 0
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        import structlog

        # RunLog's lines are still rendered (their cost counts), but to /dev/null: stdout carries the JSON only
        structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=devnull))
        if args.callgrind_child:
            callgrind_child(args, Path(tmp), devnull)
            return 0
        results = [measure(args, le, Path(tmp), devnull) for le in args.log_every]
    print(json.dumps({
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "cpus": os.cpu_count(),
        "torch": torch.__version__, "threads": args.threads, "steps_per_round": args.steps, "rounds": args.rounds,
        "gradient_checkpointing": args.checkpointing, "results": results,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
