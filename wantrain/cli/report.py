"""``wantrain report RUN_DIR [--out report.png]``: parse the arguments, draw the dashboard and print the summary
that ``wantrain.app.report`` builds (docs/metrics.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from wantrain.app.report import METRICS_FILE, build_report, load_records, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR",
                        help=f"a run directory holding {METRICS_FILE} (or the metrics file itself)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the PNG dashboard (default: RUN_DIR/report.png)")


def run(args: argparse.Namespace) -> int:
    path, records = load_records(args.run_dir)
    out = args.out if args.out is not None else path.parent / "report.png"
    fig = build_report(records, title=str(path.parent))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(summarize(records, path.parent))
    print(f"report: {out}")
    return 0
