"""``wantrain run CONFIG [--resume auto|PATH [--allow-data-changes]] [--lr-finder ...]``: parse the arguments and
hand them to ``wantrain.app.assemble``, the one place that assembles a run. Exit codes: 0 completed, 1 failed, 2 bad
input, 3 stopped (resumable), 130 aborted."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from wantrain.cli.common import add_config_arguments

SERVE_LINGER_S = 3.0
"""Seconds the page of ``--serve`` stays up after the run ended, so an open page shows the end."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--run-id", help="suffix of the run directory: letters, digits, '.', '_' or '-'")
    parser.add_argument("--max-steps", type=int, help="optimizer steps to train (overrides train.max_steps)")
    parser.add_argument(
        "--resume", metavar="auto|PATH",
        help="continue from a checkpoint: 'auto' (the latest complete checkpoint of the latest unfinished run of "
             "this config file, run.name and run id under run.output_dir; a completed run or a changed config is "
             "refused), a run directory or a checkpoint directory (finished or not)",
    )
    parser.add_argument(
        "--allow-data-changes", dest="allow_data_changes", action="store_true",
        help="with --resume: train on media whose content or caption changed since the checkpoint (named, and "
             "recorded in the event log) instead of refusing; files added or removed are still refused",
    )
    parser.add_argument(
        "--serve", nargs="?", const=8765, type=int, metavar="PORT",
        help="also show the run's live page (wantrain serve on run.output_dir, 127.0.0.1:PORT, default 8765) while "
             "it trains: a separate process that only reads the run's files, ended a few seconds after the run "
             "(docs/serve.md)",
    )
    add_lr_finder_arguments(parser)


def add_lr_finder_arguments(parser: argparse.ArgumentParser) -> None:
    """The range test's flags (docs/lr_finder.md); each sets a key of ``[lr_finder]``. The seed's underscore
    spellings (``--lr_finder``, ``--lr_finder_steps``, ...) are accepted too."""
    group = parser.add_argument_group("learning-rate range test (docs/lr_finder.md)")
    group.add_argument("--lr-finder", "--lr_finder", dest="lr_finder", action="store_true",
                       help="run the LR range test instead of training (run directory <time>__lr_finder; no LoRA or "
                            "checkpoint is written), print the suggested LR and exit")
    group.add_argument("--lr-finder-then-train", dest="lr_finder_then_train", action="store_true",
                       help="run the range test, restore the state from before it, then train with the suggested LR")
    group.add_argument("--lr-finder-steps", "--lr_finder_steps", dest="lr_finder_steps", type=int, metavar="N",
                       help="learning rates tested per expert (lr_finder.steps, default 100)")
    group.add_argument("--lr-finder-start", "--lr_finder_start", dest="lr_finder_start", type=float, metavar="LR",
                       help="first LR of the sweep (lr_finder.start_lr, default 1e-7)")
    group.add_argument("--lr-finder-end", "--lr_finder_end", dest="lr_finder_end", type=float, metavar="LR",
                       help="last LR of the sweep (lr_finder.end_lr, default 10)")
    group.add_argument("--lr-finder-mode", dest="lr_finder_mode", choices=("exp", "linear"),
                       help="spacing of the LRs (lr_finder.mode, default exp)")


def lr_finder_overrides(args: argparse.Namespace) -> list[str]:
    """``--set``-style overrides for the LR finder's flags."""
    out = []
    if getattr(args, "lr_finder", False):
        out.append("lr_finder.enabled=true")
    if getattr(args, "lr_finder_then_train", False):
        out.append("lr_finder.then_train=true")
    for flag, key in (("lr_finder_steps", "steps"), ("lr_finder_start", "start_lr"), ("lr_finder_end", "end_lr")):
        if getattr(args, flag, None) is not None:
            out.append(f"lr_finder.{key}={getattr(args, flag)!r}")
    if getattr(args, "lr_finder_mode", None) is not None:
        out.append(f"lr_finder.mode={json.dumps(args.lr_finder_mode)}")
    return out


def continue_command(args: argparse.Namespace) -> str:
    """The command that resumes this run: the config as given, the same overrides, run id (and ``--allow-code``),
    ``--resume auto``."""
    words = ["wantrain", "run", str(args.config)]
    for item in args.set or []:
        words += ["--set", item]
    if args.max_steps is not None:
        words += ["--max-steps", str(args.max_steps)]
    if getattr(args, "run_id", None) is not None:  # --resume auto continues only a run of the same run id
        words += ["--run-id", args.run_id]
    if getattr(args, "allow_code", False):
        words.append("--allow-code")
    if getattr(args, "allow_data_changes", False):
        words.append("--allow-data-changes")
    return shlex.join([*words, "--resume", "auto"])


def first_line(args: argparse.Namespace) -> None:
    """The run's first console line, printed before the heavy imports (torch and diffusers take seconds to import:
    without it a fresh ``wantrain run`` says nothing for that long). Rank 0 only; this path imports nothing heavy
    (a test checks it)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"wantrain run: {args.config}: loading torch and diffusers, then the model and the data ...", flush=True)


def load_libraries() -> Callable[..., Any]:
    """Import torch, then diffusers and wantrain's training code, with a line after each (rank 0): on a loaded
    machine they take tens of seconds, and a console silent that long looks hung. Returns ``train``."""
    started = time.monotonic()
    say = print if os.environ.get("RANK", "0") == "0" else (lambda *_, **__: None)
    import torch

    say(f"wantrain run: torch {torch.__version__} loaded ({time.monotonic() - started:.0f} s); loading diffusers "
        "and the Wan model code ...", flush=True)
    from wantrain.app.train import train

    say(f"wantrain run: libraries loaded ({time.monotonic() - started:.0f} s); building the model, then caching the "
        "clips' latents and captions ...", flush=True)
    return train


def run(args: argparse.Namespace) -> int:
    first_line(args)
    train = load_libraries()

    overrides = list(args.set or [])
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.run_id is not None:
        overrides.append(f"run.run_id={json.dumps(args.run_id)}")
    overrides += lr_finder_overrides(args)
    page = start_page(args, overrides) if getattr(args, "serve", None) is not None else None
    try:
        outcome = train(args.config, overrides=overrides, resume=args.resume, allow_code=args.allow_code,
                        allow_data_changes=args.allow_data_changes)
    finally:
        if page is not None:
            time.sleep(SERVE_LINGER_S)  # the open page's next polls see how the run ended
            page.terminate()
            page.wait(timeout=10)
    out, err = summary(outcome, args)
    for line in out:
        print(line)
    for line in err:
        print(line, file=sys.stderr)
    return outcome.exit_code


def start_page(args: argparse.Namespace, overrides: list[str]) -> subprocess.Popen | None:
    """``wantrain serve`` on the config's ``run.output_dir`` in a child process (rank 0 of a torchrun only): it
    reads the run's files and shares nothing with the training process but them. It also ends by itself when this
    process is gone (killed before it could end the child)."""
    from wantrain.app.config import load_config

    if os.environ.get("RANK", "0") != "0":
        return None
    output_dir = load_config(args.config, overrides).run.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "wantrain", "serve", str(output_dir), "--port", str(args.serve),
                             "--exit-with-parent"])


def summary(outcome, args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """What ``wantrain run`` prints when the run ends, as (stdout lines, stderr lines): the LR finder's lines on
    stdout; the status, the saved files, the checkpoint and how to continue on stderr. Only rank 0 of a torchrun
    prints them: the run directory, its files and its checkpoints are rank 0's, and another rank's view of them may
    be stale (it does not wait for rank 0's last save); every rank's warnings still reach the console through the
    log."""
    if outcome.rank != 0:
        return [], []
    from wantrain.core.readable import shown_path

    out = list(outcome.lr_finder)
    if outcome.lr_finder_dir is not None:
        where = outcome.lr_finder_dir
        out.append(f"lr_finder: chart {shown_path(where / 'lr_finder.png')}, "
                   f"sweep {shown_path(where / 'lr_finder.csv')}")
    err = [f"wantrain: run {outcome.status} after {outcome.steps} steps; run directory: {shown_path(outcome.run_dir)}"]
    if outcome.status != "completed" and outcome.reason:
        err.append(f"  reason: {outcome.reason}")
    err.extend(f"  {shown_path(path)}" for path in outcome.saved)
    if outcome.checkpoint:
        err.append(f"  checkpoint: {shown_path(outcome.checkpoint)}")
    if outcome.status == "stopped" and outcome.checkpoint:
        err.append(f"  continue with: {continue_command(args)}")
    return out, err
