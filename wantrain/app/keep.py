"""The step to keep: which saved LoRA set of a run the evidence in ``metrics.jsonl`` favours (``wantrain report``
and the page).

The rule, in order:

1. **Candidates**: the steps with a validation (``val/loss/t_<t>`` values) and, when the run directory is known and
   holds LoRA files, a saved LoRA set (``<name>_stepNNNNNN*.safetensors``, or the final files, whose metadata
   ``step`` says which step they are).
2. **Smoothed loss**: at each validation step, each timestep's loss is averaged with the validations just before
   and after it (a window of :data:`WINDOW`); the step's figure is the mean over the timesteps. The lowest is the
   **pick**.
3. **Comparable timesteps**: the losses compare over the timesteps the latest candidate's validation has (today's
   ``validation.timesteps``) that every candidate sharing any of them has too; a candidate validated at none of
   them (a resume changed ``validation.timesteps``) is **not compared**, and named so.
4. **Yardstick**: the validations use the same clips, timesteps and noise, so two steps compare timestep by
   timestep: for a candidate ``c`` the differences ``d_t = L_t(c) - L_t(pick)`` over the ``n`` shared timesteps have
   a mean and ``sd(d) / sqrt(n)``. That is the standard error of the mean difference *if* the timesteps were drawn
   at random; they are a fixed grid and each value is averaged with its neighbours, so it is a heuristic yardstick
   (said so wherever it is shown), not a confidence interval. A candidate within :data:`SEPARATION` yardsticks of
   the pick is **not separated** from it (one timestep: no spread, so nothing is separated).
5. **Motion**: when the candidates not separated from the pick have ``samples/motion_ratio`` (``[sample]`` on and
   sampled at those steps), the one closest to 1 (|log ratio| smallest: twice as fast is as far as half as fast)
   is kept instead, and the text says so.

Without validation values the motion ratio alone decides, and without either there is no pick.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

WINDOW = 3
SEPARATION = 2.0
_T_FIELD = re.compile(r"^val/loss/t_(?P<t>[0-9.e-]+)$")


@attrs.frozen
class KeepPick:
    """The step to keep and the evidence (see the module docstring)."""

    step: int
    files: tuple[str, ...]  # the LoRA files of that step (names in the run directory); () when unknown
    lowest: int | None  # the candidate with the lowest smoothed validation loss
    loss: float | None  # its smoothed validation loss
    runner_up: int | None  # the candidate with the next lowest
    difference: float | None  # runner-up minus lowest, mean over timesteps
    standard_error: float | None  # the yardstick of that difference: sd(d_t) / sqrt(n) (None: one timestep)
    not_separated: tuple[int, ...]  # candidates the loss does not separate from the lowest (it included)
    motion_ratio: float | None  # samples/motion_ratio at the kept step
    by_motion: bool  # the motion ratio chose among steps the loss does not separate (or alone, without loss)
    timesteps: int = 0  # n: the timesteps the losses compare over
    not_compared: tuple[int, ...] = ()  # candidates validated at none of those timesteps

    def lines(self) -> list[str]:
        """What ``wantrain report`` prints (and the page shows)."""
        files = f" ({', '.join(self.files)})" if self.files else ""
        out = [f"keep: step {self.step}{files}"]
        if self.lowest is not None and self.loss is not None:
            out.append(f"  lowest smoothed val/loss: step {self.lowest}, {self.loss:.5g} (each timestep averaged "
                       f"over up to {WINDOW} validations)")
        if self.runner_up is not None and self.difference is not None:
            spread = (f" +- {self.standard_error:.2g} (sd of the {self.timesteps} per-timestep differences / "
                      f"sqrt({self.timesteps}): a yardstick, not a confidence interval)"
                      if self.standard_error is not None else " (one timestep: no spread to judge by)")
            out.append(f"  next: step {self.runner_up}, {self.difference:.3g} higher{spread}")
        if self.not_compared:
            steps = ", ".join(str(s) for s in self.not_compared)
            out.append(f"  steps {steps}: validated at other timesteps (validation.timesteps changed), not compared")
        if len(self.not_separated) > 1:
            steps = ", ".join(str(s) for s in self.not_separated)
            out.append(f"  the evidence does not separate steps {steps} (within {SEPARATION:g} yardsticks)")
        elif self.runner_up is not None:
            out.append(f"  the loss separates step {self.lowest} from the other saved steps")
        if self.motion_ratio is not None:
            why = (" (closest to 1 among the steps the loss does not separate)" if self.by_motion and self.loss
                   is not None else " (closest to 1; no validation loss)" if self.by_motion else "")
            out.append(f"  samples/motion_ratio at step {self.step}: {self.motion_ratio:.3g}{why}")
        return out


def _smoothed(series: Sequence[dict[float, float]]) -> list[dict[float, float]]:
    """Each validation's per-timestep losses averaged with its neighbours' (window :data:`WINDOW`, cut at the
    ends), each timestep over the neighbours that have it (a resume may change ``validation.timesteps``)."""
    half = WINDOW // 2
    out = []
    for i, own in enumerate(series):
        window = series[max(0, i - half):i + half + 1]
        out.append({t: sum(w[t] for w in window if t in w) / sum(1 for w in window if t in w) for t in own})
    return out


def _per_timestep(record: dict[str, Any]) -> dict[float, float]:
    out = {}
    for key, value in record.items():
        match = _T_FIELD.match(key)
        if match and isinstance(value, int | float) and math.isfinite(value):
            out[float(match.group("t"))] = float(value)
    return out


def lora_files(run_dir: Path | None) -> dict[int, tuple[str, ...]]:
    """Step -> LoRA file names of ``run_dir`` (top level): ``*_stepNNNNNN[_expert].safetensors`` by name, the final
    files by their metadata's ``step``."""
    if run_dir is None or not Path(run_dir).is_dir():
        return {}
    out: dict[int, list[str]] = {}
    for path in sorted(Path(run_dir).glob("*.safetensors")):
        match = re.search(r"_step(\d{6})(_high_noise|_low_noise)?\.safetensors$", path.name)
        step = int(match.group(1)) if match else _metadata_step(path)
        if step is not None:
            out.setdefault(step, []).append(path.name)
    return {s: tuple(names) for s, names in out.items()}


def _metadata_step(path: Path) -> int | None:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            step = (fh.metadata() or {}).get("step")
    except (SafetensorError, OSError):
        return None
    return int(step) if step is not None and step.isdigit() else None


def _distance_to_one(ratio: float | None) -> float:
    return abs(math.log(ratio)) if ratio is not None and ratio > 0 else math.inf


def pick_step(records: Sequence[dict[str, Any]], run_dir: Path | None = None) -> KeepPick | None:
    """The step to keep among ``records`` (``metrics.jsonl`` lines in step order), or None without evidence."""
    files = lora_files(run_dir)
    motion = {r["step"]: float(r["samples/motion_ratio"]) for r in records
              if isinstance(r.get("samples/motion_ratio"), int | float)}
    validations = [(r["step"], _per_timestep(r)) for r in records if _per_timestep(r)]
    if not validations:
        steps = [s for s in motion if not files or s in files]
        if not steps:
            return None
        step = min(steps, key=lambda s: (_distance_to_one(motion[s]), -s))
        return KeepPick(step=step, files=files.get(step, ()), lowest=None, loss=None, runner_up=None, difference=None,
                        standard_error=None, not_separated=(), motion_ratio=motion[step], by_motion=True)
    smoothed = dict(zip([s for s, _ in validations], _smoothed([v for _, v in validations]), strict=True))
    candidates = [s for s in smoothed if smoothed[s] and (not files or s in files)]
    if not candidates:
        return None
    reference = set(smoothed[candidates[-1]])  # the latest validation's timesteps
    compared = [s for s in candidates if reference & set(smoothed[s])]
    shared = reference.intersection(*(smoothed[s] for s in compared))
    if not shared:  # overlaps that share nothing all round: those validated at every timestep of the latest
        compared = [s for s in candidates if reference <= set(smoothed[s])]
        shared = reference
    timesteps = sorted(shared)
    loss = {s: sum(smoothed[s][t] for t in timesteps) / len(timesteps) for s in compared}
    best = min(compared, key=lambda s: (loss[s], -s))
    together, stats = [best], {}
    for step in compared:
        if step == best:
            continue
        diffs = [smoothed[step][t] - smoothed[best][t] for t in timesteps]
        mean = sum(diffs) / len(diffs)
        se = (math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs))
              if len(diffs) > 1 else None)
        stats[step] = (mean, se)
        if se is None or mean <= SEPARATION * se:
            together.append(step)
    runner_up = min(stats, key=lambda s: loss[s]) if stats else None
    keep, by_motion = best, False
    tied_motion = [s for s in together if s in motion]
    if len(together) > 1 and tied_motion:
        keep = min(tied_motion, key=lambda s: (_distance_to_one(motion[s]), loss[s]))
        by_motion = True
    difference, se = stats.get(runner_up, (None, None)) if runner_up is not None else (None, None)
    return KeepPick(step=keep, files=files.get(keep, ()), lowest=best, loss=loss[best], runner_up=runner_up,
                    difference=difference, standard_error=se, not_separated=tuple(sorted(together)),
                    motion_ratio=motion.get(keep), by_motion=by_motion, timesteps=len(timesteps),
                    not_compared=tuple(s for s in candidates if s not in compared))
