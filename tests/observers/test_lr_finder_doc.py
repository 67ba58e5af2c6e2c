"""docs/lr_finder.md's sample output: the block's command and lines, as ``tests/test_newcomer_path.py`` runs and
compares them on the shipped quickstart (where the cache is filled already, so the check costs one short sweep)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "lr_finder.md"
RUN_DIR = re.compile(r"\S*runs/\d{8}_\d{6}(-\d+)?__lr_finder/")


def doc_output() -> tuple[list[str], list[str]]:
    """(the documented command's arguments after ``wantrain run examples/quickstart.toml``, its expected lines)."""
    block = re.search(r"<!-- lr-finder-output:start -->\s*```\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert block, "docs/lr_finder.md lost its sample output block"
    command, *lines = block.group(1).rstrip("\n").splitlines()
    words = shlex.split(command.removeprefix("$ "))
    assert words[:3] == ["wantrain", "run", "examples/quickstart.toml"], command
    return words[3:], lines


def summary_of(stdout: str) -> list[str]:
    """The finder's summary in ``stdout`` (from the first ``lr_finder [`` line to the chart line), with the run
    directory written as the doc writes it (``runs/<time>__lr_finder/``)."""
    lines = stdout.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("lr_finder ["))
    end = next(i for i, x in enumerate(lines) if x.startswith("lr_finder: chart"))
    return [RUN_DIR.sub("runs/<time>__lr_finder/", x) for x in lines[start:end + 1]]


def test_the_documented_output_parses_and_names_a_short_sweep_of_the_quickstart():
    args, lines = doc_output()
    assert args[0] == "--lr-finder" and "--lr-finder-steps" in args
    assert int(args[args.index("--lr-finder-steps") + 1]) <= 20  # cheap enough for the newcomer-path test
    assert lines[0].startswith("lr_finder [high_noise]: suggested LR") and any("[low_noise]" in x for x in lines)
    assert lines[-1] == "lr_finder: chart runs/<time>__lr_finder/lr_finder.png, sweep runs/<time>__lr_finder/" \
        "lr_finder.csv"


def test_summary_of_normalises_the_run_directory():
    out = "step 1/2\nlr_finder [lora]: suggested LR 0.01 (valley)\n  valley    0.01  <- default\n" \
          "lr_finder: chart /tmp/x/runs/20261201_131552__lr_finder/lr_finder.png, sweep " \
          "/tmp/x/runs/20261201_131552__lr_finder/lr_finder.csv\nwantrain: done\n"
    assert summary_of(out) == ["lr_finder [lora]: suggested LR 0.01 (valley)", "  valley    0.01  <- default",
                               "lr_finder: chart runs/<time>__lr_finder/lr_finder.png, sweep "
                               "runs/<time>__lr_finder/lr_finder.csv"]
