"""``wantrain convert FILE [--dataset DATASET.toml] [-o OUT.toml]``: a wantrain config from a musubi-tuner config
(its training arguments as TOML or as its command line in a text file, its dataset TOML) or an ai-toolkit YAML
(``wantrain.app.convert``), or the ``[sample]`` table from musubi-tuner's prompt file (``.txt``), with a line on
stderr for every key it did not map and every peer default it wrote out. Without ``-o`` the config goes to stdout;
an existing ``-o`` file is never overwritten."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path,
                        help="musubi-tuner .toml (training arguments or dataset), a file holding its command "
                             "line (accelerate launch ... wan_train_network.py ...), its --sample_prompts .txt, or "
                             "ai-toolkit .yaml")
    parser.add_argument("--dataset", type=Path, default=None, metavar="DATASET.toml",
                        help="musubi-tuner's dataset config, when the training arguments do not name it")
    parser.add_argument("-o", "--out", type=Path, default=None, metavar="OUT.toml",
                        help="write the config there (a new file) instead of stdout")


def run(args: argparse.Namespace) -> int:
    import tomli_w

    from wantrain.app.convert import convert
    from wantrain.core.errors import UserError

    for given in (args.file, args.dataset):
        if given is not None and not given.is_file():
            raise UserError(f"'{given}' is not a file; give a musubi-tuner .toml or prompt .txt, or an ai-toolkit "
                            ".yaml")
    if args.out is not None and args.out.exists():
        raise UserError(f"'{args.out}' exists; wantrain convert writes a new file (choose another -o)")
    conversion = convert(args.file, args.dataset)
    config = conversion.config()
    check = ("paste it into your run config" if set(config) == {"sample"} else "check it with: wantrain check FILE")
    text = f"# converted from {args.file} by wantrain convert; {check}\n" + tomli_w.dumps(config)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"wantrain convert: wrote {args.out}", file=sys.stderr)
    problem = _check_problem(config)
    if problem is not None:
        print(f"wantrain convert: check will refuse the output: {problem}", file=sys.stderr)
    for line in conversion.defaults:
        print(f"wantrain convert: written, the peer's default: {line}", file=sys.stderr)
    for line in conversion.unmapped:
        print(f"wantrain convert: not mapped: {line}", file=sys.stderr)
    return 0


def _check_problem(config: dict) -> str | None:
    """What ``check``'s key validation says of the converted config (every problem in one line), or ``None``; a
    prompt-file ``[sample]`` table alone is checked once pasted, not here."""
    from wantrain.app.config import RunConfig
    from wantrain.app.migration import peer_hint
    from wantrain.core.config import structure
    from wantrain.core.errors import ConfigError

    if set(config) == {"sample"}:
        return None
    try:
        structure(RunConfig, config, hint=peer_hint)
    except ConfigError as exc:
        return str(exc)
    return None
