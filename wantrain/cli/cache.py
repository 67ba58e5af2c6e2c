"""``wantrain cache CONFIG``: encode and cache every clip's latents and every caption's text embeddings.

Loads the VAE and text encoder only if something is missing (the model adapter loads them on first use), and
removes cache entries no current clip or caption uses. ``wantrain run`` then trains from the cache.
"""

from __future__ import annotations

import argparse

from wantrain.cli.common import add_config_arguments, load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from wantrain.app.preflight import fill_cache

    stats, report = fill_cache(load_run_config(args))
    print(stats.format())
    if report.verification:
        print(f"{len(report.verification)} clips re-bucketed or skipped while decoding:")
        for v in report.verification:
            print(f"  {v['path']}: {v['action']} ({v['reason']})")
    return 0
