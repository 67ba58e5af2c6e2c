"""Weights & Biases beside TensorBoard: ``[observers] wandb = true`` (the ``wandb`` extra: ``pip install
"wantrain[wandb]"``).

At ``RunStarted`` one wandb run starts (``wandb.init``) in ``<run_dir>/wandb/``: project ``observers.wandb_project``,
name ``observers.wandb_run_name`` (unset: the run directory's name), tags ``observers.wandb_tags``, mode
``observers.wandb_mode`` (unset: wandb's own default, the ``WANDB_MODE`` environment variable or ``online``), and the
resolved config (what ``config.toml`` holds) as the run's config. Every ``MetricsLogged`` is logged at its optimizer
step under the names of ``metrics.jsonl`` (``train/loss``, ``val/loss``, ...); every ``SamplesWritten`` logs its
mp4 files as videos ``samples/00``, ``samples/01``, ... at that step. ``RunEnded`` finishes the run (exit code 0
for a completed or stopped run, 1 for a failed one).

Only rank 0 logs (torchrun). A resumed run starts a new wandb run with the same name, from the resumed step on.
Nothing imports wandb unless this observer is on; a missing package is refused before the run directory exists.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from wantrain.core.bus import Observer, Priority, on
from wantrain.core.events import MetricsLogged, RunEnded, RunStarted, SamplesWritten

_INDEX = re.compile(r"_(\d+)\.mp4$")


class WandbLogger(Observer):
    """Logs metrics, sample videos and the config to a wandb run (see the module docstring). A passive sink."""

    priority = Priority.SINK

    def __init__(self, *, project: str | None, run_name: str | None, tags: list[str], mode: str | None,
                 config: dict[str, Any] | None) -> None:
        self.project, self.run_name, self.tags, self.mode = project, run_name, list(tags), mode
        self.config = config or {}
        self.run: Any = None

    @on(RunStarted)
    def on_run_started(self, event: RunStarted, ctx) -> None:
        import wandb

        run_dir = Path(event.run_dir)
        settings = {"project": self.project, "name": self.run_name or run_dir.name, "tags": self.tags or None,
                    "dir": str(run_dir), "config": self.config}
        if self.mode is not None:
            settings["mode"] = self.mode
        self.run = wandb.init(**settings)

    @on(MetricsLogged)
    def on_metrics(self, event: MetricsLogged, ctx) -> None:
        if self.run is not None:
            self.run.log(dict(event.values), step=event.step)

    @on(SamplesWritten)
    def on_samples(self, event: SamplesWritten, ctx) -> None:
        if self.run is None or not event.paths:
            return
        import wandb

        videos = {}
        for n, path in enumerate(event.paths):
            match = _INDEX.search(path)
            videos[f"samples/{int(match.group(1)) if match else n:02d}"] = wandb.Video(path, format="mp4")
        self.run.log(videos, step=event.step)

    @on(RunEnded)
    def on_run_ended(self, event: RunEnded, ctx) -> None:
        self._finish(1 if event.status == "failed" else 0)

    def close(self) -> None:
        self._finish(1)  # only still open after a crash

    def _finish(self, code: int) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=code)
