"""Every example config's header tells the user a command line; that command line must parse with the real CLI and
its config must pass validation (issue 27: the headers said ``wantrain train``, which is no command)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from wantrain.cli.common import load_run_config
from wantrain.cli.main import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
COMMAND = re.compile(r"\bwantrain\s+(?P<args>[a-z][\w-]*\s+[^#`]*)")


def documented_commands(path: Path) -> list[list[str]]:
    """The ``wantrain ...`` command lines in the comment block that opens ``path``."""
    commands = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        for match in COMMAND.finditer(line):
            commands.append(shlex.split(match.group("args")))
    return commands


def test_every_example_documents_a_command_line():
    assert EXAMPLES
    missing = [p.name for p in EXAMPLES if not documented_commands(p)]
    assert not missing, f"examples whose header names no wantrain command: {missing}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_documented_command_line_parses_and_its_config_validates(path):
    for argv in documented_commands(path):
        assert argv[0] in COMMANDS, f"{path.name}: 'wantrain {argv[0]}' is not a command ({', '.join(COMMANDS)})"
        args = build_parser(argv[0]).parse_args(argv)
        assert (ROOT / args.config).resolve() == path.resolve(), f"{path.name}: the command names {args.config}"
        args.config = str(ROOT / args.config)  # the command is run from the repository root
        cfg = load_run_config(args)
        assert cfg.run.name


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_check_of_every_shipped_example_as_shipped_prints_a_memory_plan(path, capsys, monkeypatch):
    """Issue 59: on a machine without CUDA, without the data (the placeholder data.path) and without the weights,
    ``wantrain check`` of each example prints the memory plan of the card it is meant for."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # this machine: a laptop without a GPU
    code = main(["check", str(path)])
    out, err = capsys.readouterr()
    assert "memory plan for " in out, (path.name, err[-600:])
    assert "Traceback" not in err and code in (0, 2), err
    if code == 2:  # only the weights the example names may be missing
        assert err.startswith("wantrain check: error: 1 model file missing") and len(err.splitlines()) == 1, err
