"""``wantrain run CONFIG [--resume auto|PATH]``: parse the arguments and hand them to ``wantrain.runner``, the one
place that assembles a run. Exit codes: 0 completed, 1 failed, 2 bad input, 3 stopped (resumable), 130 aborted."""

from __future__ import annotations

import argparse
import json
import sys

from wantrain.cli.common import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--run-id", help="suffix of the run directory: letters, digits, '.', '_' or '-'")
    parser.add_argument("--max-steps", type=int, help="optimizer steps to train (overrides train.max_steps)")
    parser.add_argument(
        "--resume", metavar="auto|PATH",
        help="continue from a checkpoint: 'auto' (the latest complete checkpoint of the latest run with the same "
             "run.name under run.output_dir), a run directory or a checkpoint directory",
    )


def run(args: argparse.Namespace) -> int:
    from wantrain.runner import train

    overrides = list(args.set or [])
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.run_id is not None:
        overrides.append(f"run.run_id={json.dumps(args.run_id)}")
    outcome = train(args.config, overrides=overrides, resume=args.resume)
    print(f"wantrain: run {outcome.status} after {outcome.steps} steps; run directory: {outcome.run_dir}",
          file=sys.stderr)
    if outcome.status != "completed" and outcome.reason:
        print(f"  reason: {outcome.reason}", file=sys.stderr)
    for path in outcome.saved:
        print(f"  {path}", file=sys.stderr)
    if outcome.checkpoint:
        print(f"  checkpoint: {outcome.checkpoint}", file=sys.stderr)
    if outcome.status == "stopped" and outcome.checkpoint:
        print("  continue with: wantrain run CONFIG --resume auto", file=sys.stderr)
    return outcome.exit_code
