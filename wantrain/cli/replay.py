"""``wantrain replay RUN_DIR [--observers a,b] [--set key=value ...] [--until STEP] [--out DIR] [--allow-code]``:
parse the arguments and hand them to :func:`wantrain.app.replay.replay` (docs/replay.md). Prints where the output
went, the observers left out, and, when the alpha controller was replayed, the recorded transitions beside the
replayed ones. Exit codes: 0 replayed, 2 bad input."""

from __future__ import annotations

import argparse
import sys

from wantrain.cli.common import add_allow_code_argument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory written by `wantrain run` (with events.jsonl[.gz])")
    parser.add_argument(
        "--observers", metavar="NAME,NAME",
        help="observers to replay: run_log, tensorboard, jsonl, progress, alpha, or a user observer's name "
             "(default: every replayable observer of the run but progress)",
    )
    parser.add_argument(
        "--set", dest="set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a key of the run's config (read as TOML; arrays of tables by index: "
             "lora.alpha_schedule.phases.0.min_steps=5); repeatable",
    )
    add_allow_code_argument(parser)  # the run's own observers: replay imports them only with it, as run does
    parser.add_argument("--until", type=int, metavar="STEP", help="stop after the events of this optimizer step")
    parser.add_argument("--out", metavar="DIR", help="new folder for the output (default: beside the run, "
                                                     "<run_dir>__replay_<time>)")


def run(args: argparse.Namespace) -> int:
    from wantrain.app.logs import configure_logging
    from wantrain.app.replay import alpha_whatif, replay
    from wantrain.core.readable import shown_path

    configure_logging(None)
    observers = [n.strip() for n in args.observers.split(",") if n.strip()] if args.observers else None
    result = replay(args.run_dir, observers=observers, overrides=args.set, until=args.until, out=args.out,
                    allow_code=args.allow_code)
    print(f"wantrain: replayed {result.events} events through step {result.last_step} into "
          f"{shown_path(result.out_dir)}", file=sys.stderr)
    print(f"  observers: {', '.join(result.observers)}", file=sys.stderr)
    for note in (*result.skipped, *result.notes):
        print(f"  note: {note}", file=sys.stderr)
    table = alpha_whatif(result)
    if table:
        print(table)
    return 0
