"""``wantrain convert FILE [--dataset DATASET.toml] [-o OUT.toml]``: a wantrain config from a musubi-tuner config
(its training arguments as TOML, its dataset TOML) or an ai-toolkit YAML (``wantrain.app.migration``), or the
``[sample]`` table from musubi-tuner's prompt file (``.txt``), with a line on stderr for every key it did not map.
Without ``-o`` the config goes to stdout; an existing ``-o`` file is never overwritten."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path,
                        help="musubi-tuner .toml (training arguments or dataset), its --sample_prompts .txt, or "
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
    config, unmapped = convert(args.file, args.dataset)
    check = ("paste it into your run config" if set(config) == {"sample"} else "check it with: wantrain check FILE")
    text = f"# converted from {args.file} by wantrain convert; {check}\n" + tomli_w.dumps(config)
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
        print(f"wantrain convert: wrote {args.out}", file=sys.stderr)
    for line in unmapped:
        print(f"wantrain convert: not mapped: {line}", file=sys.stderr)
    return 0
