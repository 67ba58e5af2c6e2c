"""docs/distributed.md's table of what composes with what under each several-GPU layout is generated from the rules
the code refuses with (issue #57; one generator with docs/config.md's table since #59: ``wantrain.app.compose``):
each cell loads the quickstart with the layout and the feature, as ``wantrain check --gpus 2`` and ``wantrain run``
under torchrun would, and says whether it runs; each refusal's rule ids and line are listed below the table. These
tests keep the page equal to the rules; ``python -m wantrain.app.compose`` rewrites it (and docs/config.md)."""

from __future__ import annotations

from pathlib import Path

from wantrain.app.compose import BEGIN, END, FEATURES, LAYOUTS, layout_markdown, layout_refusal
from wantrain.app.preflight import declared_rules

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "distributed.md"


def test_the_compose_table_of_the_docs_is_the_one_the_rules_give():
    text = DOC.read_text()
    assert BEGIN in text and END in text, "docs/distributed.md lost its compose table markers"
    written = text[text.index(BEGIN):text.index(END) + len(END)]
    assert written == layout_markdown(ROOT), ("docs/distributed.md's compose table is stale: run "
                                              "python -m wantrain.app.compose")


def test_every_refused_cell_is_a_declared_pair_listed_in_docs_config_md():
    """The two tables agree through the declarations: each refused cell of the layout grid is refused by declared
    rules that refuse a pair (no inline refusal), and each of those is a row of docs/config.md's table."""
    pairs = {r.id for r in declared_rules() if r.pair is not None}
    config_md = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    named = set()
    for layout in LAYOUTS:
        for feature in FEATURES:
            refused = layout_refusal(layout, feature, ROOT)
            if refused is not None:
                rules, line = refused
                assert rules and set(rules) <= pairs, (layout, feature, rules, line)
                named.update(rules)
    assert len(named) >= 2, named  # the grid refuses through several rules, not one catch-all (issue 57 left 2)
    for rule in named:
        assert f"| `{rule}` |" in config_md, rule
