"""``wantrain ctl RUN_DIR save|sample|validate|stop``: ask a running run to save, sample, validate or stop (save
and end, resumable) after its current step, through its inbox (``core.inbox``; docs/serve.md). The run records
each request in its event log (``ControlRequested``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from wantrain.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from wantrain.app.serve.rundata import ACTIONS

    parser.add_argument("run_dir", type=Path, help="the run directory (runs/<timestamp>)")
    parser.add_argument("action", choices=ACTIONS, help="save: LoRA + checkpoint now; sample / validate: a round now; "
                                                         "stop: save and end (resumable)")


def run(args: argparse.Namespace) -> int:
    from wantrain.app.serve.rundata import RunGone, ask

    try:
        request_id = ask(args.run_dir, args.action, "ctl")
    except (RunGone, ValueError) as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        raise UserError(f"cannot write the inbox of {args.run_dir}: {exc.strerror or exc}") from None
    print(f"wantrain ctl: asked {args.run_dir} to {args.action} (request {request_id}); the run acts after its "
          "current step and records it in events.jsonl")
    return 0
