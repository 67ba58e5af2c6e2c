"""``wantrain.train()``: load the config, prepare the run and pick the mode -- a training run
(:meth:`~wantrain.app.assemble.PreparedRun.execute`) or, with ``[lr_finder]`` on, the range test
(:func:`wantrain.app.lr_finder.run_lr_finder`). Nothing else.

Python users call :func:`wantrain.train`::

    import wantrain
    outcome = wantrain.train("examples/quickstart.toml", overrides=["train.max_steps=50"])
    outcome = wantrain.train("examples/quickstart.toml", resume="auto")
    outcome = wantrain.train("my.toml", allow_code=True)  # it names my_observers:LossWatch (wantrain.core.trust)
    print(outcome.status, outcome.run_dir, outcome.exit_code)
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wantrain.app.assemble import RunOutcome, prepare
from wantrain.app.config import load_config
from wantrain.app.lr_finder import run_lr_finder
from wantrain.app.signals import RunInterrupted
from wantrain.core.trust import allowing_code


def train(config: Any, *, overrides: Sequence[str] = (), resume: str | Path | None = None,
          config_dir: Path | None = None, allow_code: bool = False, allow_data_changes: bool = False) -> RunOutcome:
    """Train from a config file path (with ``section.key=value`` overrides) or a loaded ``RunConfig``.

    ``resume``: ``"auto"`` or a run/checkpoint directory; ``allow_data_changes``: resume on media whose content or
    caption changed since the checkpoint (recorded in the event log; docs/resume.md). ``allow_code``: import the
    code the config names outside wantrain's allowed modules (users' observers, an external optimizer or scheduler
    class); without it such a config is refused, whatever the config itself says (``wantrain.core.trust``; the
    CLI's ``--allow-code``). Raises
    :class:`wantrain.core.errors.UserError` (one line) for bad input; returns the outcome otherwise
    (``outcome.exit_code`` is what ``wantrain run`` exits with).
    """
    with allowing_code(allow_code):
        if isinstance(config, str | Path):
            path = Path(config)
            cfg = load_config(path, list(overrides))
            config_dir = config_dir or path.resolve().parent
            config_file = path
        else:
            if overrides:
                raise TypeError("overrides apply to a config file; pass a path, or change the RunConfig yourself")
            cfg = config
            config_file = None
        try:
            prepared = prepare(cfg, config_dir=config_dir, resume=resume, allow_data_changes=allow_data_changes,
                               config_file=config_file)
        except RunInterrupted as exc:  # a signal while prepare() filled the cache: no run directory exists yet
            return RunOutcome("stopped", f"{exc} before the first step, while the cache filled (before the run "
                              "directory was made; the cache keeps every entry written: run again)", 0,
                              Path(cfg.run.output_dir), ())
        try:
            return run_lr_finder(prepared) if cfg.lr_finder.active else prepared.execute()
        except BaseException as exc:
            other = prepared.sync.fail(exc)  # torchrun: the other ranks learn it and end (core.parallel.failures)
            if other is not None:  # this rank's collective failed because another rank failed first: say that
                raise other from None
            raise
        finally:
            prepared.release()  # the run directory's lock, should execute not have run
            prepared.sync.close()  # torchrun: leave the process group (one process: nothing to do)
