"""The README and docs/ name only commands, paths and test files that exist (issue 29: a command missing from the
table, a test path that had moved, an example telling users to run a command that does not exist)."""

from __future__ import annotations

import re
from pathlib import Path

from wantrain.cli.main import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
# a repository path as docs write it: tests/..., wantrain/..., examples/..., docs/..., bench/...
PATH = re.compile(r"(?<![\w./-])((?:tests|wantrain|examples|docs|bench)/[\w./-]*\w)")


def test_every_wantrain_command_named_in_the_docs_and_examples_exists():
    """A command as a user types it: in backticks, on a line of a shell block, or after ``then:`` in a comment."""
    bad = []
    for page in [*PAGES, *EXAMPLES]:
        text = page.read_text()
        shell = "\n".join(re.findall(r"```(?:bash|sh|console|shell)\n(.*?)```", text, re.S))
        for match in re.finditer(r"(?:`|^\s*|then: |&& |\$ )wantrain ([a-z][a-z-]*)",
                                 re.sub(r"^(?!\s*wantrain).*$", "", shell, flags=re.M) + "\n" +
                                 re.sub(r"^\s*wantrain", "", text, flags=re.M), re.M):
            if match.group(1) not in COMMANDS:
                bad.append(f"{page.relative_to(ROOT)}: {match.group(0).strip()}")
    assert not bad, bad


def test_the_readme_commands_table_lists_every_command():
    table = (ROOT / "README.md").read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `wantrain ([a-z-]+)", table, re.M))
    assert listed == set(COMMANDS), sorted(set(COMMANDS) ^ listed)


def test_every_repository_path_in_the_docs_exists():
    missing = []
    for page in [*PAGES, *EXAMPLES]:
        for path in PATH.findall(page.read_text()):
            path = path.rstrip(".")
            if "*" in path or "<" in path or path.endswith(("/", "_")):
                continue
            if not (ROOT / path).exists() and not (ROOT / path.split("::")[0]).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, missing
