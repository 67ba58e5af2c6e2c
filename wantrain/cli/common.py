"""Shared CLI pieces. Every subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``;
``wantrain.cli.main`` wires them and turns a ``UserError`` into one line and exit code 2."""

from __future__ import annotations

import argparse


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The CONFIG positional and repeated ``--set section.key=value`` overrides."""
    parser.add_argument("config", help="run config (.toml)")
    parser.add_argument(
        "--set", dest="set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a config key (value read as TOML; repeatable)",
    )
    add_allow_code_argument(parser)


def add_allow_code_argument(parser: argparse.ArgumentParser) -> None:
    """``--allow-code``: the person's consent to import the code a config names (``wantrain.core.trust``)."""
    parser.add_argument(
        "--allow-code", dest="allow_code", action="store_true",
        help="import and run the code the config names outside wantrain's allowed modules: users' observers "
             "([observers] extra), an external optimizer or scheduler class. Only for configs you trust; a config "
             "cannot allow this itself (docs/observers.md)",
    )


def load_run_config(args: argparse.Namespace):  # -> wantrain.config.RunConfig
    from wantrain.app.config import load_config

    return load_config(args.config, list(getattr(args, "set", []) or []))
