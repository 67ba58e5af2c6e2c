"""ProgressLine: step/total, it/s, ETA, loss EMA, LR, expert and alpha phase; in place on a TTY, plain lines in CI."""

from __future__ import annotations

import io

from wantrain.core.bus import Bus
from wantrain.core.context import Context, DeviceMetrics, Live, TrainState
from wantrain.core.control import Control
from wantrain.core.events import MetricsLogged, OptimizerStepped, RunEnded, RunStarted
from wantrain.observers.progress import ProgressLine, format_duration

from .fakes import FakeLoop


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class TtyStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def drive(progress: ProgressLine, clock: FakeClock, steps: int = 10, log_every: int = 5, total: int = 100,
          values: dict[str, float] | None = None) -> None:
    bus = Bus(Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live()))
    bus.attach(progress)
    bus.emit(RunStarted(step=0, run_dir="", total_steps=total, grad_accum=1, experts=("high_noise", "low_noise"),
                        log_every=log_every))
    for step in range(1, steps + 1):
        clock.now += 0.5  # 2 it/s
        log = step % log_every == 0
        bus.emit(OptimizerStepped(step=step, expert="low_noise", skipped=False, skip_reason=None,
                                  lrs=(1e-4, 2e-4), group_names=("high_noise", "low_noise"), is_log_step=log))
        if log:
            bus.emit(MetricsLogged(step=step, expert="low_noise", elapsed_s=clock.now - 100,
                                   values=values or {"train/loss": 0.5, "train/loss/low_noise": 0.5 + step / 100,
                                                     "alpha/phase": 1.0},
                                   total_steps=total))
    bus.emit(RunEnded(step=steps, status="stopped", reason="test"))
    bus.close()


def test_progress_line_shows_step_rate_eta_loss_ema_lr_expert_and_alpha_phase():
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine(stream=out, clock=clock)
    drive(progress, clock)
    line = progress.render()
    ema = 0.9 * 0.55 + 0.1 * 0.60  # EMA of the low_noise losses logged at steps 5 and 10
    assert line == (f"step 10/100 (10%) | 2.00 it/s | ETA 0:00:45 | loss {ema:.4g} (EMA) | lr 0.0002 | "
                    "expert low_noise | alpha phase 1")


def test_progress_prints_one_plain_line_per_log_step_when_the_stream_is_not_a_tty():
    clock, out = FakeClock(), io.StringIO()
    drive(ProgressLine(stream=out, clock=clock), clock)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 5/100 (5%)", "step 10/100 (10%)", "step 10/100 (10%)"]
    assert lines[-1].endswith("| stopped")


def test_progress_redraws_in_place_on_a_tty_at_every_step_and_ends_with_a_newline():
    clock, out = FakeClock(), TtyStream()
    drive(ProgressLine(stream=out, clock=clock, refresh_s=0.0), clock)
    text = out.getvalue()
    assert text.count("\r") == 11  # 10 steps and the final line
    assert text.endswith("| stopped\n") and text.count("\n") == 1


def test_progress_shows_skipped_steps_and_ignores_a_nan_loss_in_its_average():
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine(stream=out, clock=clock)
    drive(progress, clock, values={"train/loss": float("nan"), "train/skipped_steps": 2.0})
    assert "loss ?" in progress.render() and "skipped 2" in progress.render()


def test_disabled_progress_writes_nothing():
    clock, out = FakeClock(), TtyStream()
    drive(ProgressLine(stream=out, enabled=False, clock=clock), clock)
    assert out.getvalue() == ""


def test_progress_in_a_run_writes_to_a_closed_stream_without_failing():
    out = io.StringIO()
    out.close()
    loop = FakeLoop([ProgressLine(stream=out)], total_steps=3, log_every=1)
    loop.run()
    assert not loop.failures


def test_format_duration():
    assert format_duration(3725) == "1:02:05"
    assert format_duration(float("inf")) == "?"


def test_progress_prints_the_last_step_once_with_the_run_status():
    out = io.StringIO()
    FakeLoop([ProgressLine(stream=out)], total_steps=4, log_every=2).run()
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4 (50%)", "step 4/4 (100%)"]
    assert lines[-1].endswith("| completed")


def test_a_plain_stream_reads_the_clock_at_log_steps_only():
    class CountingClock(FakeClock):
        calls = 0

        def __call__(self) -> float:
            self.calls += 1
            return super().__call__()

    clock, out = CountingClock(), io.StringIO()
    drive(ProgressLine(stream=out, clock=clock), clock, steps=10, log_every=5)
    assert clock.calls == 4  # the run's start, the first step's end and the two log steps, not every step
    assert "2.00 it/s" in out.getvalue().splitlines()[-1]


def test_progress_shows_an_adaptive_optimizers_effective_lr_beside_its_multiplier():
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine(stream=out, clock=clock)
    drive(progress, clock, values={"train/loss": 0.5, "optimizer/effective_lr/high_noise": 3e-5,
                                   "optimizer/effective_lr/low_noise": 4e-5})
    assert "| lr 0.0002 (effective 4e-05) |" in progress.render()  # the active expert's group


def test_a_compiling_run_says_so_until_its_first_step_and_its_rate_leaves_that_step_out():
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine(stream=out, clock=clock, compiling=True)
    bus = Bus(Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live()))
    bus.attach(progress)
    bus.emit(RunStarted(step=0, run_dir="", total_steps=100, grad_accum=1, experts=(None,), log_every=5))
    for step in range(1, 6):
        clock.now += 60.0 if step == 1 else 0.5  # the compiling step takes a minute, the others 2 it/s
        bus.emit(OptimizerStepped(step=step, expert=None, skipped=False, skip_reason=None, lrs=(1e-4,),
                                  group_names=("lora",), is_log_step=step == 5))
    bus.emit(MetricsLogged(step=5, expert=None, elapsed_s=clock.now - 100, values={"train/loss": 0.5},
                           total_steps=100))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 0/100") and "compiling the transformer blocks (model.compile)" in lines[0]
    assert "compiling" not in lines[1] and "| 2.00 it/s |" in lines[1]


def test_the_first_plain_line_is_printed_once_and_the_first_steps_warm_up_does_not_drive_the_eta():
    """Issue 58: the step-0 validation and samples each logged a "step 0" line, and the first ETA counted the first
    step's warm-up (and the step-0 rounds) as the pace: 26 minutes for a run of one."""
    clock, out = FakeClock(), io.StringIO()
    progress = ProgressLine(stream=out, clock=clock)
    bus = Bus(Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live()))
    bus.attach(progress)
    bus.emit(RunStarted(step=0, run_dir="", total_steps=100, grad_accum=1, experts=(None,), log_every=5))
    for key in ("val/loss", "samples/motion"):  # the step-0 rounds, before any step
        clock.now += 5.0
        bus.emit(MetricsLogged(step=0, expert=None, elapsed_s=clock.now - 100, values={key: 1.0}, total_steps=100))
    for step in range(1, 6):
        clock.now += 30.0 if step == 1 else 0.5  # a slow first step (allocator, first kernels), then 2 it/s
        bus.emit(OptimizerStepped(step=step, expert=None, skipped=False, skip_reason=None, lrs=(1e-4,),
                                  group_names=("lora",), is_log_step=step == 5))
    bus.emit(MetricsLogged(step=5, expert=None, elapsed_s=clock.now - 100, values={"train/loss": 0.5},
                           total_steps=100))
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 0/100 (0%)", "step 5/100 (5%)"]
    assert "| 2.00 it/s | ETA 0:00:48 |" in lines[1]  # 95 steps at 2 it/s
