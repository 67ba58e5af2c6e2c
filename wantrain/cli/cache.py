"""``wantrain cache CONFIG``: encode and cache every clip's latents and every caption's text embeddings.

Loads the VAE and text encoder only if something is missing (the model adapter loads them on first use), then
says which entries no clip or caption of this config uses; they may be other configs' (every config on one data
folder shares its cache), so only ``--prune`` deletes them, after saying what it deletes. ``wantrain run`` then
trains from the cache.
"""

from __future__ import annotations

import argparse
import shlex

from wantrain.cli.common import add_config_arguments, load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--prune", action="store_true",
                        help="delete the cache entries no clip or caption of this config uses (they may be another "
                             "config's on the same data)")


def run(args: argparse.Namespace) -> int:
    from wantrain.app.cache import describe_entries, fill_cache, remove_entries

    stats, report = fill_cache(load_run_config(args))
    print(stats.format())
    if stats.orphans and args.prune:
        print(f"cache: removing {describe_entries(stats.orphans)} that no clip or caption of this config uses")
        print(f"cache: {remove_entries(stats.orphans)} entries removed")
    elif stats.orphans:
        print(f"cache: {describe_entries(stats.orphans)} are not used by this config; other configs on the same "
              f"data (other buckets, frame counts, encoders) may use them. Kept; "
              f"`{prune_command(args)}` deletes them")
    if report.verification:
        print(f"{len(report.verification)} clips re-bucketed or skipped while decoding:")
        for v in report.verification:
            print(f"  {v['path']}: {v['action']} ({v['reason']})")
    return 0


def prune_command(args: argparse.Namespace) -> str:
    """The same command with ``--prune``: the config and overrides as given."""
    words = ["wantrain", "cache", str(args.config)]
    for item in args.set or []:
        words += ["--set", item]
    return shlex.join([*words, "--prune"])
