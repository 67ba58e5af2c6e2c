"""``wantrain serve [OUTPUT_DIR] [--host H] [--port P] [--read-only]``: the live page of the runs under an output
directory (docs/serve.md). Binds to 127.0.0.1 unless ``--host`` names another address; on every address the page,
its data and its controls need the token in the URL it prints (``$WANTRAIN_SERVE_TOKEN`` sets a fixed one)."""

from __future__ import annotations

import argparse
import errno
import os
import threading
import time
from pathlib import Path

from wantrain.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", nargs="?", default="runs", type=Path,
                        help="the folder holding the run directories (run.output_dir; default: ./runs)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1, this machine only); on any address, "
                             "open the printed URL: it carries the token the page needs")
    parser.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free port)")
    parser.add_argument("--read-only", action="store_true", help="show runs only: the save/sample/stop buttons are off")
    parser.add_argument("--data", type=Path, action="append", default=[], metavar="FOLDER",
                        help="also show this folder's clips with their captions, editable (a folder "
                             "`wantrain prepare` wrote; repeatable)")
    # `wantrain run --serve`'s child: end when the run's process is gone, even if it was killed (no orphan server)
    parser.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from wantrain.app.serve import PageServer, is_loopback

    missing = [str(d) for d in args.data if not d.is_dir()]
    if missing:
        raise UserError(f"--data folder '{missing[0]}' does not exist: give a folder of clips (wantrain prepare's)")
    if not args.output_dir.is_dir() and not args.data:
        raise UserError(f"output folder '{args.output_dir}' does not exist: give the folder that holds the run "
                        "directories (the config's run.output_dir)")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port {args.port} is not valid: use 0-65535")
    from wantrain.app.serve import TOKEN_ENV

    fixed = os.environ.get(TOKEN_ENV)
    if fixed is not None and len(fixed) < 16:
        raise UserError(f"${TOKEN_ENV} has {len(fixed)} characters: use at least 16 (whoever guesses it can stop "
                        "the runs), or unset it for a random token")
    try:
        server = PageServer(args.output_dir, host=args.host, port=args.port, read_only=args.read_only,
                            data=tuple(args.data))
    except OSError as exc:
        hint = ""
        if exc.errno == errno.EADDRINUSE:  # started by `wantrain run --serve`: the port is the run's option
            hint = ("; another process listens there: give `wantrain run` another port, --serve PORT (0: any free one)"
                    if args.exit_with_parent else "; another process listens there: use --port PORT (0: any free one)")
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}{hint}") from None
    print(f"wantrain serve: {args.output_dir.resolve()}")
    print(f"  open {server.token_url}")
    where = "" if is_loopback(args.host) else " from the network"
    print(f"  (the token lets whoever has it see and stop your runs{where}; the page keeps it in a cookie)")
    if args.read_only:
        print("  read-only: the controls are off")
    print("  Ctrl-C to stop", flush=True)
    if args.exit_with_parent:
        threading.Thread(target=_end_with_parent, args=(server, os.getppid()), daemon=True).start()
    server.serve_forever()
    return 0


def _end_with_parent(server, parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    server.server.should_exit = True
