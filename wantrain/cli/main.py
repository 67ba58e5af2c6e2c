"""``wantrain`` command line. Only the chosen subcommand's module is imported (``wantrain check`` stays fast).

A ``UserError`` (bad config key or value, missing file, unreadable media or checkpoint) prints one line and
exits with code 2, without a traceback; a ``StorageError`` (a disk full or read-only while writing) the same line
with code 1: the input was fine, the run failed (README, exit codes). Anything else is a bug and keeps its
traceback. Code a config names outside wantrain's allowed modules is imported only under ``--allow-code``
(``wantrain.core.trust``).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from wantrain.core.atomic import StorageError
from wantrain.core.errors import UserError
from wantrain.core.problems import Refused
from wantrain.core.trust import allowing_code
from wantrain.core.version import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("wantrain.cli.run", "train a LoRA from a config"),
    "check": ("wantrain.cli.check", "pre-flight report: buckets, skipped files, steps per epoch, VRAM estimate"),
    "prepare": ("wantrain.cli.prepare", "cut long videos into scene clips on the frame buckets, with manifests"),
    "caption": ("wantrain.cli.caption", "caption each clip of a folder with a local vision-language model"),
    "cache": ("wantrain.cli.cache", "precompute VAE latents and text embeddings"),
    "schedule": ("wantrain.cli.schedule", "preview the learning-rate schedule (plot and key points)"),
    "report": ("wantrain.cli.report", "draw a PNG dashboard and a summary of a run directory"),
    "inspect-lora": ("wantrain.cli.inspect_lora", "show and validate a LoRA .safetensors file"),
    "replay": ("wantrain.cli.replay", "replay a run's event log into observers (regenerate outputs, alpha what-if)"),
    "serve": ("wantrain.cli.serve", "a live page of the runs under an output folder, with save/sample/stop buttons"),
    "ctl": ("wantrain.cli.ctl", "ask a running run to save, sample, validate or stop now"),
    "convert": ("wantrain.cli.convert", "write a wantrain config from a musubi-tuner or ai-toolkit config"),
}


FAILED = 1
"""The exit code of a command that failed for a reason other than its input (README: 0 completed, 1 failed, 2 bad
input, 3 stopped, 130 aborted)."""


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wantrain", description="LoRA trainer for Wan 2.2 video models.")
    parser.add_argument("--version", action="version", version=f"wantrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args, extra = parser.parse_known_args(argv)
    if extra:
        from wantrain.app.migration import peer_arguments

        hints = peer_arguments(extra)
        if hints and args.command is not None:  # --network_dim 32: the --set that does it, every one at once
            print(f"wantrain {args.command}: error: " + "; ".join(hints), file=sys.stderr)
            return UserError.exit_code
        parser.parse_args(argv)  # argparse's own message and exit code for anything else
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with allowing_code(getattr(args, "allow_code", False)):  # only the person's flag, never the config
            code = int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
        sys.stdout.flush()  # a reader that went away (`| head`) shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader closed the pipe: stop quietly, as `cat` does; stdout goes to /dev/null so that the
        # interpreter's own flush at exit does not raise again (the recipe of Python's signal docs)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what the shell reports for a tool killed by a closed pipe
    except UserError as exc:  # several problems of one pass (core.problems.Refused): one line each, by section
        lines = exc.lines() if isinstance(exc, Refused) else [str(exc)]
        print(f"wantrain {args.command}: error: {lines[0]}", *lines[1:], sep="\n", file=sys.stderr)
        return FAILED if isinstance(exc, StorageError) else exc.exit_code  # RankFailed: 1
    except KeyboardInterrupt as exc:  # a run's abort says what it saved (wantrain.app.signals.describe_abort)
        print(f"wantrain {args.command}: {exc or 'aborted (Ctrl-C)'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
