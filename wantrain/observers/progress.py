"""A one-line progress display: step/total, it/s, ETA, loss (EMA), LR, active expert, alpha phase (index and name).

It keeps every ``OptimizerStepped`` and reads host-side values only (the step number, a monotonic clock and the
LRs the event carries); it never touches a tensor. On a stream that is not a terminal a step costs nothing beyond
keeping the event: the clock is read and the line rendered at log steps only. Loss, alpha phase and skipped steps
come from the latest ``MetricsLogged`` (host floats), so they change once per log interval.

On a terminal the line is redrawn in place with a carriage return, at most every ``refresh_s`` seconds (and always
on log steps and the last step). When the stream is not a TTY (CI, a file, a pipe) nothing is redrawn: one plain
line is printed per log step (the last one with the run's status), so logs stay readable.

* it/s: optimizer steps per second over about the last ``window`` steps (a moving window, so it follows
  slowdowns), from the clock read at each redraw (terminal) or log step (otherwise).
* ETA: remaining steps at the average pace since the first logged loss (sample rounds, validations and saves
  included, as they recur; the run page's ETA is the same rule), remaining steps / it/s before that.
* loss: exponential moving average (``beta`` 0.9) of the logged interval means, per expert (``train/loss/<expert>``)
  when the model has experts, else of ``train/loss``; the active expert's is shown.
* LR: the LR the step used, of the parameter group named after the active expert if there is one, else the first.
* warm-up: it/s counts from the end of the run's first step, never from its start: that step carries the
  step-0 validation and samples, the allocator's and kernels' first calls and, with ``model.compile``, the blocks'
  compilation (the line says so until it ends), any of which would make the first ETA many times too long.
* one line per state on a stream that is not a terminal: a log event that changes nothing the line shows (the
  step-0 validation and samples each log before any step) prints no second, identical line.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import MetricsLogged, OptimizerStepped, RunEnded, RunStarted


def format_duration(seconds: float) -> str:
    """``3725`` -> ``"1:02:05"``; unknown or infinite -> ``"?"``."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressLine(Observer):
    """Progress on ``stream`` (default: ``sys.stderr`` at write time). ``enabled=False`` makes it silent."""

    priority = Priority.SINK
    replayable = True  # from MetricsLogged and the other events alone

    def __init__(
        self,
        stream: TextIO | None = None,
        enabled: bool = True,
        *,
        refresh_s: float = 0.1,
        window: int = 50,
        beta: float = 0.9,
        clock: Callable[[], float] = time.monotonic,
        alpha_phases: tuple[str, ...] = (),
        compiling: bool = False,
    ) -> None:
        self.enabled = enabled
        self.compiling = compiling  # model.compile is on: the first step compiles the blocks
        self._first_step_pending = False  # the run's first step has not ended yet (the rate starts after it)
        self._printed = ""  # the last line printed on a stream that is not a terminal
        self.alpha_phases = tuple(alpha_phases)  # the alpha schedule's phase names, by index (the line names them)
        self._stream = stream
        self.refresh_s = refresh_s
        self.beta = beta
        self._clock = clock
        self.window = max(2, window)
        self._times: deque[tuple[float, int]] = deque(maxlen=self.window)  # (clock, step) samples
        self._since: tuple[float, int] | None = None  # (clock, step) of the first logged loss: the ETA's start
        self.total_steps = 0
        self.step = 0
        self.expert: str | None = None
        self.lr: float | None = None
        self.effective_lr: float | None = None  # an adaptive optimizer's d x lr (optimizer/effective_lr/<group>)
        self._stepped: OptimizerStepped | None = None  # the latest step's event, read when the line is drawn
        self.loss_ema: dict[str | None, float] = {}
        self.alpha_phase: float | None = None
        self.skipped_steps = 0
        self._last_draw = -math.inf
        self._drawn_width = 0  # characters of the line currently on a terminal (0: none)
        self._tty: bool | None = None  # whether the stream is a terminal, asked once per run (None: not yet)

    # -- events ------------------------------------------------------------------------------------------------
    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        self.total_steps = event.total_steps
        self.step = event.step
        self._tty = None
        self._stepped = None
        self._times.clear()
        self._times.append((self._clock(), event.step))
        self._since = None
        self._first_step_pending = True  # the rate starts when the first step ends (its warm-up left out)
        self._printed = ""
        if self.compiling:
            line = f"{self.render()} | compiling the transformer blocks (model.compile): the first step is slow"
            if self._is_tty():
                self._write("\r" + line)
                self._drawn_width = len(line)
            else:
                self._print_line(line)

    @on(OptimizerStepped)
    def on_optimizer_stepped(self, event: OptimizerStepped, ctx) -> None:
        self._stepped = event
        if self._first_step_pending:  # the first step has ended: the rate starts here (one clock read per run)
            self._first_step_pending = False
            self._times.clear()
            self._times.append((self._clock(), event.step))
        if self._tty is not False and self._is_tty() and not event.is_log_step and event.step != self.total_steps:
            self._draw(force=False)

    def _take_step(self) -> None:
        """Step, expert, LR and a clock sample from the latest ``OptimizerStepped`` (when the line is drawn)."""
        event, self._stepped = self._stepped, None
        if event is None:
            return
        self.step = event.step
        self.expert = event.expert
        if event.lrs:
            names = tuple(event.group_names)
            index = names.index(event.expert) if event.expert in names else 0
            self.lr = event.lrs[index] if index < len(event.lrs) else event.lrs[0]
        times = self._times
        times.append((self._clock(), event.step))
        while len(times) > 2 and times[-1][1] - times[1][1] >= self.window:
            times.popleft()  # keep about `window` steps (a terminal samples every redraw, a log file every log step)

    @on(MetricsLogged)
    def on_metrics_logged(self, event: MetricsLogged, ctx) -> None:
        self._take_step()
        values = event.values
        if self._since is None and self._times and any(k.startswith("train/loss") for k in values):
            self._since = self._times[-1]
        self.total_steps = event.total_steps or self.total_steps
        keyed = {k.removeprefix("train/loss/"): v for k, v in values.items() if k.startswith("train/loss/")}
        if not keyed and "train/loss" in values:
            keyed = {None: values["train/loss"]}
        for expert, loss in keyed.items():
            if not math.isfinite(loss):
                continue  # a NaN would poison the average forever; the sinks still record it
            previous = self.loss_ema.get(expert)
            self.loss_ema[expert] = loss if previous is None else self.beta * previous + (1 - self.beta) * loss
        effective = {k.removeprefix("optimizer/effective_lr/"): v for k, v in values.items()
                     if k.startswith("optimizer/effective_lr/")}
        if effective:  # the active expert's group, else the first one
            self.effective_lr = effective.get(self.expert, next(iter(effective.values())))
        if "alpha/phase" in values:
            self.alpha_phase = values["alpha/phase"]
        if "train/skipped_steps" in values and math.isfinite(values["train/skipped_steps"]):
            self.skipped_steps = int(values["train/skipped_steps"])
        if self._is_tty():
            self._draw(force=True)
        elif event.step != self.total_steps:  # the last step's line is printed by RunEnded, with the status
            line = self.render()
            if line != self._printed:  # the step-0 validation and samples log twice before any step
                self._printed = line
                self._print_line(line)

    @on(RunEnded)
    def on_run_ended(self, event: RunEnded, ctx) -> None:
        self._take_step()
        line = f"{self.render()} | {event.status}"
        if self._is_tty():
            self._write("\r" + line.ljust(self._drawn_width) + "\n")
            self._drawn_width = 0
        else:
            self._print_line(line)

    def close(self) -> None:
        if self._drawn_width:
            self._write("\n")
            self._drawn_width = 0

    # -- rendering ---------------------------------------------------------------------------------------------
    def steps_per_second(self) -> float | None:
        """Optimizer steps per second over the recent window; None before two steps were seen."""
        if len(self._times) < 2:
            return None
        (t0, s0), (t1, s1) = self._times[0], self._times[-1]
        if t1 <= t0 or s1 <= s0:
            return None
        return (s1 - s0) / (t1 - t0)

    def eta_seconds(self, rate: float) -> float | None:
        """Seconds left: the remaining steps at the average pace since the first logged loss -- sample rounds,
        validations and saves included, as they recur -- which is how the run page computes it (``rate``, the
        recent window's, until a second log step); None without a total."""
        if not self.total_steps:
            return None
        left = max(self.total_steps - self.step, 0)
        if self._since is not None and self._times:
            (t0, s0), (t1, s1) = self._since, self._times[-1]
            if s1 > s0 and t1 > t0:
                return left * (t1 - t0) / (s1 - s0)
        return left / rate

    def render(self) -> str:
        """The progress line as text (no carriage return)."""
        total = self.total_steps
        pct = f" ({100 * self.step / total:.0f}%)" if total else ""
        rate = self.steps_per_second()
        parts = [f"step {self.step}/{total or '?'}{pct}"]
        if rate is None:
            parts += ["? it/s", "ETA ?"]
        else:
            parts.append(f"{rate:.2f} it/s" if rate >= 1 else f"{1 / rate:.2f} s/it")
            eta = self.eta_seconds(rate)
            parts.append(f"ETA {format_duration(eta) if eta is not None else '?'}")
        loss = self.loss_ema.get(self.expert, self.loss_ema.get(None))
        parts.append(f"loss {loss:.4g} (EMA)" if loss is not None else "loss ?")  # not the last logged loss
        parts.append(f"lr {self.lr:.3g}" if self.lr is not None else "lr ?")
        if self.effective_lr is not None:  # Prodigy: lr is a multiplier; this is the step size it takes
            parts[-1] += f" (effective {self.effective_lr:.3g})"
        if self.expert is not None:
            parts.append(f"expert {self.expert}")
        if self.alpha_phase is not None and math.isfinite(self.alpha_phase):
            phase = self.alpha_phase
            index = int(phase) if phase == int(phase) else None
            name = self.alpha_phases[index] if index is not None and 0 <= index < len(self.alpha_phases) else None
            parts.append(f"alpha phase {index if index is not None else phase}" + (f" ({name})" if name else ""))
        if self.skipped_steps:
            parts.append(f"skipped {self.skipped_steps}")
        return " | ".join(parts)

    def _draw(self, force: bool) -> None:
        now = self._clock()
        if not force and now - self._last_draw < self.refresh_s:
            return
        self._last_draw = now
        self._take_step()
        line = self.render()
        self._write("\r" + line.ljust(self._drawn_width))
        self._drawn_width = max(len(line), 1)

    def _print_line(self, line: str) -> None:
        self._write(line + "\n")

    def _stream_now(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        if not self.enabled:
            return False
        if self._tty is None:
            self._tty = self._ask_tty()
        return self._tty

    def _ask_tty(self) -> bool:
        isatty = getattr(self._stream_now(), "isatty", None)
        try:
            return bool(isatty()) if callable(isatty) else False
        except (ValueError, OSError):  # a closed stream
            return False

    def _write(self, text: str) -> None:
        if not self.enabled:
            return
        stream = self._stream_now()
        try:
            stream.write(text)
            stream.flush()
        except (ValueError, OSError):  # closed or broken stream: progress is not worth failing a run for
            self.enabled = False
